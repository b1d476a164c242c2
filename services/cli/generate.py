"""``tokenmill generate "PROMPT"``: stream a completion to stdout.

From a running stack over the public gRPC API (address by --address or TOKENMILL_ADDRESS),
or with --in-process from a model directory loaded in this process.

``--chat "MESSAGE"`` (with an optional ``--system "..."``) sends a conversation instead: the
model's chat template renders it with the cue for the assistant's turn, its markup becomes the
model's special tokens, and generation stops at the end-of-turn token; only the reply is printed.
A plain PROMPT is text: "<|im_start|>" typed in it stays those characters, not the special token.
"""

from __future__ import annotations

import argparse
import os
import sys

from services.common.errors import TokenmillError
from services.stack.client import default_address
from services.runtime.model.attention.names import BACKEND_NAMES, KV_CACHE_DTYPE_NAMES

DEFAULT_MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "models", "stories260K")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenmill generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", default="", help="prompt text; empty = start from BOS alone")
    p.add_argument("--chat", metavar="MESSAGE", help="a user message, rendered with the model's chat template")
    p.add_argument("--system", metavar="TEXT", help="with --chat: a system message before it")
    p.add_argument("--in-process", action="store_true", help="load the model here instead of calling a stack")
    p.add_argument("--model", default=os.environ.get("TOKENMILL_MODEL", DEFAULT_MODEL),
                   help="model directory for --in-process (env TOKENMILL_MODEL; default: the shipped stories260K)")
    p.add_argument("--address", default=default_address(),
                   help="public API address of a running stack (env TOKENMILL_ADDRESS; default 127.0.0.1 on "
                        "TOKENMILL_SCHEDULER_PORT, else 50051: %(default)s)")
    p.add_argument("--token", default=os.environ.get("TOKENMILL_TOKEN", ""),
                   help="bearer token for a stack with tenants (env TOKENMILL_TOKEN)")
    p.add_argument("--tls-ca", default=os.environ.get("TOKENMILL_TLS_CA", ""),
                   help="CA certificate to verify the stack with; connect over TLS (env TOKENMILL_TLS_CA)")
    p.add_argument("--tls-cert", default=os.environ.get("TOKENMILL_TLS_CERT", ""),
                   help="client certificate for a stack that requires one (mTLS; env TOKENMILL_TLS_CERT)")
    p.add_argument("--tls-key", default=os.environ.get("TOKENMILL_TLS_KEY", ""),
                   help="private key of --tls-cert (env TOKENMILL_TLS_KEY)")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="0 disables (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="make sampling reproducible")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--dtype", default="auto", help="--in-process: fp32, bf16, fp16 or auto")
    p.add_argument("--device", default="auto", help="--in-process: cpu, cuda or auto")
    p.add_argument("--attention-backend", default="auto", choices=BACKEND_NAMES,
                   help="--in-process: attention implementation (auto = triton on CUDA, cpu on a CPU)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_NAMES,
                   help="--in-process: KV-cache storage, auto (the model's dtype), int8 or fp8_e4m3")
    p.add_argument("--stats", action="store_true", help="print TTFT and tokens/s to stderr at the end")
    return p


def _run_in_process(args, messages: list[dict[str, str]] | None) -> int:
    from services.common.logging import configure_logging
    from services.common.sampling_params import SamplingParams
    from services.scheduler.request.stop import StopConditions
    from services.executor.config import ExecutorConfig
    from services.inprocess.engine import Engine, EngineConfig

    # stdout carries the text alone; the engine's log lines (warnings and up) go to stderr.
    configure_logging("generate", level="warning", json=False)
    prompt = _render_chat(args.model, messages) if messages is not None else args.prompt or None
    engine = Engine(EngineConfig(ExecutorConfig(model=args.model, dtype=args.dtype, device=args.device,
                                                attention_backend=args.attention_backend,
                                                kv_cache_dtype=args.kv_cache_dtype)))
    if messages is None:
        _warn_special_text(args.prompt, engine.tokenizer)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              min_p=args.min_p, seed=args.seed)
    stop = StopConditions(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, stop=tuple(args.stop))
    sys.stdout.write(args.prompt if messages is None else "")
    sys.stdout.flush()
    final = None
    for _, delta in engine.generate([prompt], sampling, stop):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        if delta.finished:
            final = delta
    sys.stdout.write("\n")
    sys.stdout.flush()  # before the stats line on stderr
    if args.stats and final is not None and final.timings is not None:
        _print_stats(final.usage.completion_tokens, final.timings.time_to_first_token_ms,
                     final.timings.decode_time_ms, final.finish_reason.value)
    return 0


def chat_messages(args) -> list[dict[str, str]] | None:
    """The conversation of --system/--chat; None without --chat."""
    if args.chat is None:
        if args.system is not None:
            raise ValueError("--system needs --chat")
        return None
    if args.prompt:
        raise ValueError("give either a PROMPT or --chat, not both")
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    return system + [{"role": "user", "content": args.chat}]


def _render_chat(model_dir: str, messages: list[dict[str, str]]) -> list[int]:
    """The conversation's prompt ids, rendered as the tokenizer service's RenderChat does."""
    from services.tokenizer.text_service import TextService

    return TextService(model_dir).render_chat(messages).token_ids


def _warn_special_text(prompt: str, tokenizer) -> None:
    """Say so when a plain prompt spells special tokens: they are encoded as text, not as those ids."""
    found = [t for i in sorted(tokenizer.skipped_special_ids) if (t := tokenizer.id_to_token(i)) and t in prompt]
    if found:
        print(f"tokenmill generate: note: the prompt spells {', '.join(found)}; a prompt is plain text, so these "
              "are encoded as characters, not as the model's special tokens. Use --chat \"MESSAGE\" (and "
              "--system) to have the model's chat template write them.", file=sys.stderr)


def _print_stats(tokens: int, ttft_ms: float, decode_ms: float, reason: str) -> None:
    tps = (tokens - 1) / (decode_ms / 1000.0) if decode_ms > 0 and tokens > 1 else float("nan")
    print(f"[{tokens} tokens, finish={reason}, TTFT {ttft_ms:.1f} ms, {tps:.1f} tokens/s]", file=sys.stderr)


def _run_remote(args, messages: list[dict[str, str]] | None) -> int:
    import grpc

    from services.cli.terminal import stream_to_terminal
    from services.common.tls import ClientTLS
    from services.stack.client import build_request, model_info

    tls = ClientTLS(args.tls_ca, args.tls_cert, args.tls_key) if args.tls_ca or args.tls_cert or args.tls_key else None
    if tls is not None:
        tls.check()  # a bad file: exit 2 naming the flag

    try:
        bos = None
        if not args.prompt and messages is None:
            info = model_info(args.address, tls=tls, token=args.token or None)
            bos = info.bos_token_id if info.HasField("bos_token_id") else None
        request = build_request(args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                                ignore_eos=args.ignore_eos, stop=args.stop, bos_token_id=bos, chat=messages)
        sys.stdout.write(args.prompt)
        stream_to_terminal(args.address, request, tls=tls, token=args.token or None)
    except grpc.RpcError as exc:
        print(f"\ntokenmill generate: {exc.code().name}: {exc.details()} (address {args.address})", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        messages = chat_messages(args)
        return _run_in_process(args, messages) if args.in_process else _run_remote(args, messages)
    except (ValueError, FileNotFoundError, TokenmillError) as exc:
        print(f"tokenmill generate: error: {exc}", file=sys.stderr)
        return 2

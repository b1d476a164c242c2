"""One-shot GPU check of the Triton kernels (meant for an H200; finishes in under 8 minutes).

  (a) runs ``pytest tests/runtime/kernels`` on CUDA over the full grid (TOKENMILL_FULL_KERNEL_GRID=1);
  (b) measures the two ceilings (HBM bandwidth from a large device copy, bf16 matmul rate), then
      times paged decode and prefill attention against them and against
      torch.nn.functional.scaled_dot_product_attention on the same shapes (dense K/V), then the
      weight-only quantized matmul and the fused-MoE kernels at three families' layer shapes;
  (c) end-to-end decode tokens/s of a ~1B-parameter random-weight Llama in bf16 per backend,
      through the executor's ModelRunner: torch, triton eager (--enforce-eager) and triton with
      decode steps replayed from CUDA graphs (skipped with a message if that API is not importable);
  (d) the same model through the four services as `tokenmill up` starts them: the first burst of
      streams after SERVING against a warm burst (TTFT p99), one stream and 16 streams (TPOT),
      each against ModelRunner's step from (c).

Each section is guarded: an error is printed and the next section runs. Timings are medians of
triton.testing.do_bench (CUDA events). The markdown report goes to stdout and to ``--out``.

  python -m benchmarks gpu --out gpu_check.md
  python -m benchmarks gpu --dry-run --out /tmp/gpu_check.md   # CPU: tiny shapes, every path

Run from the checkout's root (the GPU image runs it without installing the package). Imports
only torch, triton, numpy, the standard library and the harness's standard-library parts at
module level (the GPU image has no structlog); the engine is imported inside section (c), the
services inside (d).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness import flags
from benchmarks.harness.flags import setting
from benchmarks.harness.paths import REPO_ROOT
from benchmarks.harness.report import command_line, git_revision

PROG = "python -m benchmarks gpu"
SECTIONS = ("tests", "kernels", "e2e", "services")


@dataclass
class Report:
    parts: list[str] = field(default_factory=list)

    def heading(self, text: str) -> None:
        self._emit(f"\n## {text}\n")

    def note(self, text: str) -> None:
        self._emit(text + "\n")

    def table(self, header: list[str], rows: list[list[object]]) -> None:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(_cell(value) for value in row) + " |" for row in rows]
        self._emit("\n".join(lines) + "\n")

    def _emit(self, text: str) -> None:
        print(text, flush=True)
        self.parts.append(text)

    def render(self) -> str:
        return "\n".join(self.parts)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


@dataclass
class Shapes:
    """What each section runs: the H200 settings, or tiny ones for --dry-run."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    decode_contexts: tuple[int, ...] = (512, 2048, 8192, 32768)
    decode_batches: tuple[int, ...] = (1, 8, 32, 128, 256)
    max_cached_tokens: int = 2 * 1024 * 1024
    """Skip (batch, context) pairs above this many tokens: paged + dense K/V stay under ~16 GiB."""
    prefill_cases: tuple[tuple[int, int, int], ...] = (
        # (sequences, context_len, query_len): whole prompts, then chunks over a cached prefix
        (1, 512, 512), (32, 512, 512), (1, 2048, 2048), (8, 2048, 2048), (1, 8192, 8192),
        (4, 8192, 8192), (1, 32768, 32768), (1, 16384, 1024), (16, 4096, 512),
    )
    copy_bytes: int = 4 * 1024**3
    matmul_size: int = 8192
    e2e_preset: str = "llama-1b"
    e2e_dtype: str = "bf16"
    e2e_batches: tuple[int, ...] = (1, 16, 64, 128)
    e2e_prompt_len: int = 512
    e2e_decode_steps: int = 64
    services_streams: int = 16
    services_tokens: int = 128
    services_prompt_len: int = 128
    moe_cases: tuple[tuple[str, int, int, int, int], ...] = (
        # (label, hidden, intermediate, experts, top_k)
        ("Mixtral 8x7B", 4096, 14336, 8, 2), ("Qwen3-30B-A3B", 2048, 768, 128, 8), ("OLMoE", 2048, 1024, 64, 8),
    )
    moe_batches: tuple[int, ...] = (1, 16, 256)
    test_selection: tuple[str, ...] = ()
    test_workers: int = 8


DRY_RUN_SHAPES = Shapes(
    heads=4, kv_heads=2, head_dim=64, decode_contexts=(32, 80), decode_batches=(1, 3), max_cached_tokens=10_000,
    prefill_cases=((1, 48, 48), (2, 96, 16)), copy_bytes=8 * 1024**2, matmul_size=128,
    e2e_preset="tiny", e2e_dtype="fp32", e2e_batches=(2,), e2e_prompt_len=20, e2e_decode_steps=3,
    services_streams=2, services_tokens=6, services_prompt_len=8,
    moe_cases=(("tiny", 32, 48, 4, 2),), moe_batches=(1, 5),
    test_selection=("-k", "choose_num_partitions or interpreter_bf16"), test_workers=0,
)


class Timer:
    """Median milliseconds of fn(): CUDA events through do_bench on a GPU, perf_counter on a CPU."""

    def __init__(self, on_gpu: bool):
        self.on_gpu = on_gpu

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.on_gpu:
            import triton.testing

            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        fn()
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)


# ---------------------------------------------------------------------------------------- (a)
def run_kernel_tests(report: Report, shapes: Shapes, on_gpu: bool, timeout_s: float) -> None:
    command = [sys.executable, "-m", "pytest", "tests/runtime/kernels", "-q", "-p", "no:cacheprovider",
               # tests/conftest.py builds model fixtures with engine imports the kernel tests do not need
               "--confcutdir", "tests/runtime/kernels", *shapes.test_selection]
    if shapes.test_workers and _has_module("xdist"):
        command += ["-n", str(shapes.test_workers)]  # kernels compile in parallel processes
    # the repository is not pip-installed on the GPU image: put its root on the path
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TOKENMILL_FULL_KERNEL_GRID="1" if on_gpu else "0", PYTHONPATH=python_path)
    if on_gpu:
        env.pop("TRITON_INTERPRET", None)
    report.note(f"`{shlex.join(command[1:])}` (TOKENMILL_FULL_KERNEL_GRID={env['TOKENMILL_FULL_KERNEL_GRID']})")
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as expired:
        tail = (expired.stdout or b"")[-3000:]
        tail = tail if isinstance(tail, str) else tail.decode(errors="replace")
        report.note(f"**timed out after {timeout_s:.0f} s**\n```\n{tail}\n```")
        return
    lines = (done.stdout + done.stderr).strip().splitlines()
    summary = next((line for line in reversed(lines) if " passed" in line or " failed" in line or "error" in line),
                   lines[-1] if lines else "(no output)")
    wall_s = time.perf_counter() - start
    report.table(["exit code", "summary", "wall s"], [[done.returncode, summary.strip("= "), wall_s]])
    if done.returncode != 0:
        failures = [line for line in lines if line.startswith(("FAILED", "ERROR"))][:40]
        report.note("```\n" + "\n".join(failures or lines[-40:]) + "\n```")


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


# ---------------------------------------------------------------------------------------- (b)
@dataclass
class Ceilings:
    bytes_per_s: float
    flops_per_s: float


def measure_ceilings(report: Report, shapes: Shapes, device, timer: Timer) -> Ceilings:
    import torch

    numel = shapes.copy_bytes // 2
    src = torch.randn(numel, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src))
    bandwidth = 2 * shapes.copy_bytes / (copy_ms * 1e-3)  # bytes read + bytes written
    del src, dst
    n = shapes.matmul_size
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    matmul_ms = timer(lambda: a @ b)
    flops = 2 * n**3 / (matmul_ms * 1e-3)
    del a, b
    _free(device)
    report.table(["ceiling", "measured", "how"], [
        ["HBM bandwidth", f"{bandwidth / 1e12:.2f} TB/s", f"copy of {shapes.copy_bytes / 2**30:.2f} GiB, read+write"],
        ["bf16 matmul", f"{flops / 1e12:.0f} TFLOP/s", f"{n}x{n}x{n} on random data"],
    ])
    return Ceilings(bandwidth, flops)


def _paged_copy(dense, block_size: int):
    """dense [B, KH, C, D] -> (pool [B*C/BS, BS, KH, D] with the blocks in shuffled order,
    block_tables [B, C/BS] int32): the same keys, laid out the way the engine stores them."""
    import torch

    batch, kv_heads, context, head_dim = dense.shape
    blocks_per_seq = context // block_size
    blocks = dense.transpose(1, 2).reshape(batch * blocks_per_seq, block_size, kv_heads, head_dim)
    order = torch.randperm(batch * blocks_per_seq, device=dense.device)
    pool = torch.empty_like(blocks)
    pool[order] = blocks
    return pool, order.view(batch, blocks_per_seq).int()


def bench_decode(report: Report, shapes: Shapes, device, timer: Timer, ceilings: Ceilings, deadline: float) -> None:
    import torch
    import torch.nn.functional as F

    from services.runtime.kernels.paged_decode import choose_num_partitions, paged_decode_attention

    heads, kv_heads, head_dim, block_size = shapes.heads, shapes.kv_heads, shapes.head_dim, shapes.block_size
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    report.note(f"bf16, {heads} query heads, {kv_heads} kv heads, head_dim {head_dim}, block size {block_size}; "
                "bytes = K+V of every context token read once; SDPA gets the same K/V dense.")
    rows = []
    for batch in shapes.decode_batches:
        for context in shapes.decode_contexts:
            if batch * context > shapes.max_cached_tokens:
                continue
            if time.perf_counter() > deadline:
                rows.append([batch, context, "skipped: section time budget spent", "", "", "", "", "", ""])
                continue
            scale = head_dim**-0.5
            k_dense = torch.randn(batch, kv_heads, context, head_dim, device=device, dtype=torch.bfloat16)
            v_dense = torch.randn_like(k_dense)
            k_pool, tables = _paged_copy(k_dense, block_size)
            v_pool = torch.empty_like(k_pool)
            v_pool[tables.view(-1).long()] = v_dense.transpose(1, 2).reshape(k_pool.shape)
            q = torch.randn(batch, heads, head_dim, device=device, dtype=torch.bfloat16)
            context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
            partitions = choose_num_partitions(batch, kv_heads, context, num_sms)
            out = torch.empty_like(q)

            def triton_decode():
                return paged_decode_attention(q, k_pool, v_pool, tables, context_lens, scale, context, partitions, out)

            def sdpa_decode():
                return F.scaled_dot_product_attention(q.unsqueeze(2), k_dense, v_dense, scale=scale, enable_gqa=True)

            triton_ms = timer(triton_decode)
            sdpa_ms = timer(sdpa_decode)
            error = (triton_decode().float() - sdpa_decode().squeeze(2).float()).abs().max().item()
            moved = 2 * batch * context * kv_heads * head_dim * 2 + 2 * q.numel() * 2
            floor_ms = moved / ceilings.bytes_per_s * 1e3
            rows.append([batch, context, partitions, triton_ms * 1e3, moved / (triton_ms * 1e-3) / 1e12,
                         f"{100 * floor_ms / triton_ms:.0f}%", sdpa_ms * 1e3, f"{sdpa_ms / triton_ms:.2f}x", error])
            del k_dense, v_dense, k_pool, v_pool, q, out
            _free(device)
    report.table(["batch", "context", "splits", "triton us", "TB/s", "of BW roofline", "SDPA us",
                  "SDPA/triton time", "max abs diff"], rows)


def bench_prefill(report: Report, shapes: Shapes, device, timer: Timer, ceilings: Ceilings, deadline: float) -> None:
    import torch
    import torch.nn.functional as F

    from services.runtime.kernels.prefill_attention import prefill_attention

    heads, kv_heads, head_dim, block_size = shapes.heads, shapes.kv_heads, shapes.head_dim, shapes.block_size
    report.note("bf16, same heads; causal FLOPs = 4 * heads * head_dim * (visible keys summed over queries). "
                "Whole prompts: SDPA is_causal; chunks over a cached prefix: SDPA with a boolean mask.")
    rows = []
    for batch, context, query_len in shapes.prefill_cases:
        if time.perf_counter() > deadline:
            rows.append([batch, context, query_len, "skipped: section time budget spent", "", "", "", "", ""])
            continue
        scale = head_dim**-0.5
        k_dense = torch.randn(batch, kv_heads, context, head_dim, device=device, dtype=torch.bfloat16)
        v_dense = torch.randn_like(k_dense)
        k_pool, tables = _paged_copy(k_dense, block_size)
        v_pool = torch.empty_like(k_pool)
        v_pool[tables.view(-1).long()] = v_dense.transpose(1, 2).reshape(k_pool.shape)
        q_dense = torch.randn(batch, heads, query_len, head_dim, device=device, dtype=torch.bfloat16)
        q = q_dense.transpose(1, 2).reshape(batch * query_len, heads, head_dim)
        context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        query_start_loc = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * query_len
        out = torch.empty_like(q)
        prefix = context - query_len
        if prefix == 0:
            mask = None
        else:  # query i at position prefix + i sees keys [0, prefix + i]
            mask = (torch.arange(context, device=device)[None, :]
                    <= prefix + torch.arange(query_len, device=device)[:, None])

        def triton_prefill():
            return prefill_attention(q, k_pool, v_pool, tables, context_lens, query_start_loc, scale,
                                     query_len, context, out)

        def sdpa_prefill():
            return F.scaled_dot_product_attention(q_dense, k_dense, v_dense, attn_mask=mask, is_causal=mask is None,
                                                  scale=scale, enable_gqa=True)

        triton_ms = timer(triton_prefill)
        try:
            sdpa_ms = timer(sdpa_prefill)
            expected = sdpa_prefill().transpose(1, 2).reshape(q.shape)
            error = (triton_prefill().float() - expected.float()).abs().max().item()
            sdpa_cells = [sdpa_ms, f"{sdpa_ms / triton_ms:.2f}x", error]
        except Exception as sdpa_error:  # a mask/GQA combination SDPA refuses: still report ours
            sdpa_cells = [f"n/a ({type(sdpa_error).__name__})", "", ""]
        visible = batch * (query_len * prefix + query_len * (query_len + 1) // 2)
        flops = 4 * heads * head_dim * visible
        moved = 2 * (q.numel() * 2) + 2 * batch * context * kv_heads * head_dim * 2
        floor_ms = max(flops / ceilings.flops_per_s, moved / ceilings.bytes_per_s) * 1e3
        rows.append([batch, context, query_len, triton_ms, flops / (triton_ms * 1e-3) / 1e12,
                     f"{100 * floor_ms / triton_ms:.0f}%", *sdpa_cells])
        del k_dense, v_dense, k_pool, v_pool, q_dense, q, out, mask
        _free(device)
    report.table(["seqs", "context", "new tokens", "triton ms", "TFLOP/s", "of roofline", "SDPA ms",
                  "SDPA/triton time", "max abs diff"], rows)


def bench_quant_matmul(report: Report, shapes: Shapes, device, timer: Timer, ceilings: Ceilings) -> None:
    """The weight-only quantized matmul (services/runtime/kernels/quant_matmul.py) against a bf16
    matmul of the dequantized weight: ms per product and the weight bytes read per second."""
    import torch

    from services.runtime.kernels.quant_matmul import quant_matmul
    from services.runtime.model.quant.formats import dequantize, quantize

    n = k = shapes.matmul_size // 2
    rows = []
    for fmt in ("q4_1", "q4_0", "q8_0", "int8"):
        w = quantize(torch.randn(n, k) * 0.02, fmt).to(device)
        dense = dequantize(w, torch.bfloat16)
        for m in shapes.decode_batches[:3]:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            ms = timer(lambda: quant_matmul(x, w))
            dense_ms = timer(lambda: x @ dense.t())
            rows.append([fmt, f"{n}x{k}", m, ms, dense_ms, dense_ms / ms,
                         f"{w.nbytes() / (ms * 1e-3) / ceilings.bytes_per_s:.0%}"])
        del w, dense
    report.table(["format", "weight", "rows", "quant ms", "bf16 dense ms", "speedup", "weight bytes / ceiling"], rows)


def bench_fused_moe(report: Report, shapes: Shapes, device, timer: Timer, ceilings: Ceilings) -> None:
    """The fused-MoE kernels (services/runtime/kernels/fused_moe.py) in bf16 at three families'
    layer shapes against the PyTorch reference (a product per expert with tokens): ms per layer,
    the routed experts' weight bytes per second against the ceiling, the largest difference."""
    import torch

    from services.runtime.kernels.fused_moe import fused_moe_reference, fused_moe_triton

    rows = []
    for label, hidden, intermediate, experts, top_k in shapes.moe_cases:
        g = torch.Generator(device=device).manual_seed(0)
        w_gate_up = torch.randn(experts, 2 * intermediate, hidden, device=device, dtype=torch.bfloat16, generator=g)
        w_gate_up /= hidden ** 0.5
        w_down = torch.randn(experts, hidden, intermediate, device=device, dtype=torch.bfloat16, generator=g)
        w_down /= intermediate ** 0.5
        for batch in shapes.moe_batches:
            x = torch.randn(batch, hidden, device=device, dtype=torch.bfloat16, generator=g)
            logits = torch.randn(batch, experts, device=device, generator=g)
            weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
            ms = timer(lambda: fused_moe_triton(x, w_gate_up, w_down, weights, ids))
            ref_ms = timer(lambda: fused_moe_reference(x, w_gate_up, w_down, weights, ids))
            diff = (fused_moe_triton(x, w_gate_up, w_down, weights, ids).float()
                    - fused_moe_reference(x, w_gate_up, w_down, weights, ids).float()).abs().max().item()
            used = int(torch.unique(ids).numel())
            expert_bytes = (w_gate_up[0].numel() + w_down[0].numel()) * 2 * used
            rows.append([label, batch, used, ms, ref_ms, ref_ms / ms,
                         f"{expert_bytes / (ms * 1e-3) / ceilings.bytes_per_s:.0%}", diff])
        del w_gate_up, w_down
        _free(device)
    report.table(["layer", "tokens", "experts used", "triton ms", "reference ms", "speedup",
                  "expert bytes / ceiling", "max abs diff"], rows)


def _free(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------- (c)
runner_step_ms: dict[tuple[str, int], float] = {}
"""(backend label, batch) -> ModelRunner ms per decode step, from (c); (d) compares against it."""


def bench_end_to_end(report: Report, shapes: Shapes, device, deadline: float) -> None:
    try:  # the whole engine API this section needs, checked before the model is built
        from services.tools.random_model import PRESETS, build_random_model
        from services.common.sampling_params import SamplingParams  # noqa: F401
        from services.common.step import NewSequence, RunningSequence, StepPlan  # noqa: F401
        from services.executor.config import ExecutorConfig  # noqa: F401
        from services.executor.forward_paths.decode_graphs import DecodeGraphSettings  # noqa: F401
        from services.executor.model_runner import ModelRunner  # noqa: F401
    except Exception as error:  # the engine API is still moving; say so and carry on
        report.note(f"skipped: the engine API is not importable here ({type(error).__name__}: {error})")
        return
    spec = PRESETS[shapes.e2e_preset]
    report.note(f"random-weight `{shapes.e2e_preset}` ({spec.num_parameters() / 1e9:.2f}B parameters), "
                f"{shapes.e2e_dtype}, prompt {shapes.e2e_prompt_len} tokens, then {shapes.e2e_decode_steps} "
                "greedy decode steps timed (ModelRunner.execute: prepare, forward, sampling, host sync).")
    rows = []
    with tempfile.TemporaryDirectory() as model_dir:
        build_random_model(spec, model_dir)
        # "triton" replays decode steps from CUDA graphs (captured by the warm-up); "triton eager"
        # is the same with --enforce-eager; "torch" never uses graphs.
        for label, backend, eager in (("torch", "torch", True), ("triton eager", "triton", True),
                                      ("triton graphs", "triton", False)):
            if time.perf_counter() > deadline:
                rows.append([label, "", "skipped: section time budget spent", "", ""])
                continue
            runner, label = _e2e_runner(report, shapes, device, model_dir, label, backend, eager)
            steps = itertools.count(1)
            for batch in shapes.e2e_batches:
                if time.perf_counter() > deadline:
                    rows.append([label, batch, "skipped: section time budget spent", "", ""])
                    continue
                prefill_s, decode_s = _time_batch(runner, shapes, batch, steps)
                step_ms = decode_s / shapes.e2e_decode_steps * 1e3
                runner_step_ms[(label, batch)] = step_ms
                rows.append([label, batch, batch * shapes.e2e_decode_steps / decode_s, step_ms, prefill_s * 1e3])
            del runner
            _free(device)
    report.table(["backend", "batch", "decode tokens/s", "ms / decode step", "prefill step ms (incl. compile)"], rows)


def _e2e_blocks_per_seq(shapes: Shapes) -> int:
    return math.ceil((shapes.e2e_prompt_len + shapes.e2e_decode_steps + 1) / 16)


def _e2e_runner(report: Report, shapes: Shapes, device, model_dir: str, label: str, backend: str, eager: bool):
    """A ModelRunner over the random model with room for the largest batch, warmed up (its
    decode graphs captured) when it replays graphs; and the row label, saying when it cannot."""
    from services.executor.config import ExecutorConfig
    from services.executor.forward_paths.decode_graphs import DecodeGraphSettings
    from services.executor.model_runner import ModelRunner

    max_batch = max(shapes.e2e_batches)
    tokens_per_seq = shapes.e2e_prompt_len + shapes.e2e_decode_steps + 1
    runner = ModelRunner(ExecutorConfig(
        model=model_dir, dtype=shapes.e2e_dtype, device=str(device), attention_backend=backend,
        block_size=16, num_blocks=max_batch * _e2e_blocks_per_seq(shapes) + 1, max_model_len=tokens_per_seq + 16,
        decode_graphs=DecodeGraphSettings(enforce_eager=eager, cuda_graph_max_batch_size=max_batch),
    ))
    graphs = any(path.name == "decode_graphs" for path in runner.paths)
    if not eager and not graphs:
        label += " (no graphs: eager on this device)"
    if graphs:
        from services.executor.warmup import warm_up

        warmed = warm_up(runner)
        captured = warmed.path_facts
        report.note(f"{label}: warm-up {warmed.seconds:.1f} s, of which capturing "
                    f"{len(captured.get('graph_batch_sizes', []))} decode graphs "
                    f"{captured.get('graph_seconds', 0.0):.1f} s")
    return runner, label


def _time_batch(runner, shapes: Shapes, batch: int, steps: Iterator[int]) -> tuple[float, float]:
    """Seconds of one prefill step of ``batch`` prompts and of their e2e_decode_steps decode
    steps (after one untimed, which compiles the decode kernels); the sequences finished after."""
    from services.common.sampling_params import SamplingParams
    from services.common.step import NewSequence, RunningSequence, StepPlan

    blocks_per_seq = _e2e_blocks_per_seq(shapes)
    seq_ids = [1000 * batch + i for i in range(batch)]
    new = [NewSequence(seq_id=seq_id,
                       token_ids=[(7 * seq_id + j) % 300 + 3 for j in range(shapes.e2e_prompt_len)],
                       prompt_len=shapes.e2e_prompt_len, num_computed_tokens=0,
                       num_scheduled_tokens=shapes.e2e_prompt_len,
                       block_ids=list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)),
                       sampling=SamplingParams(temperature=0.0))
           for i, seq_id in enumerate(seq_ids)]
    start = time.perf_counter()
    runner.execute(StepPlan(step_id=next(steps), new=new))
    prefill_s = time.perf_counter() - start
    decode = [RunningSequence(seq_id=seq_id, num_scheduled_tokens=1) for seq_id in seq_ids]
    runner.execute(StepPlan(step_id=next(steps), running=decode))  # warm-up: compiles decode kernels
    start = time.perf_counter()
    for _ in range(shapes.e2e_decode_steps):
        runner.execute(StepPlan(step_id=next(steps), running=decode))
    decode_s = time.perf_counter() - start
    runner.execute(StepPlan(step_id=next(steps), finished_seq_ids=seq_ids))
    return prefill_s, decode_s


# ---------------------------------------------------------------------------------------- (d)
async def _burst(address: str, prompts: list[list[int]], tokens: int) -> list:
    """The streams of ``prompts`` sent at once: their RequestRecords, sent when the burst was."""
    from benchmarks.harness.client import generation_stub, greedy_request, stream
    from benchmarks.harness.records import RequestRecord

    async with generation_stub(address) as stub:
        sent_at = time.perf_counter()
        records = await asyncio.gather(*[
            stream(stub, greedy_request(prompt, tokens), RequestRecord(i, len(prompt), tokens, sent_at), timeout=600)
            for i, prompt in enumerate(prompts)])
    failed = [r.error or "no tokens" for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} streams failed: {failed[0]}")
    return records


def _tpot_ms(records: list) -> float:
    """Median over streams of the mean time between a stream's tokens."""
    return statistics.median(1e3 * r.tpot_s for r in records)


def bench_services(report: Report, shapes: Shapes, device, deadline: float) -> None:
    """The four services as `tokenmill up` starts them, on the same model as (c)."""
    try:
        from benchmarks.harness.launch import LaunchSpec, launched
        from benchmarks.harness.stats import percentile
        from services.tools.random_model import PRESETS, build_random_model
    except Exception as error:
        report.note(f"skipped: the services are not importable here ({type(error).__name__}: {error})")
        return
    spec = PRESETS[shapes.e2e_preset]
    burst, tokens = shapes.services_streams, shapes.services_tokens
    report.note(f"`tokenmill up` with `{shapes.e2e_preset}` {shapes.e2e_dtype} on {device.type}; prompts of "
                f"{shapes.services_prompt_len} token ids, {tokens} greedy tokens per stream (ignore_eos). The first "
                f"burst of {burst} streams is sent the moment the scheduler reports SERVING; TPOT is the median "
                "over streams of (last token - first token) / (tokens - 1).")
    with tempfile.TemporaryDirectory() as model_dir:
        build_random_model(spec, model_dir)
        launch = LaunchSpec(model_dir, (f"--device={device.type}", f"--dtype={shapes.e2e_dtype}",
                                        f"--max-model-len={shapes.services_prompt_len + tokens + 64}"),
                            threads=None, quiet=False, metrics=False,
                            start_timeout_s=max(60.0, deadline - time.perf_counter()), log_prefix="gpu-check-")
        started = time.perf_counter()
        with launched(launch) as stack:
            report.note(f"stack started (warm-up and graph capture included) in {time.perf_counter() - started:.1f} s")
            address = stack.address
            vocab = spec.vocab_size

            def prompts(n: int, salt: int) -> list[list[int]]:
                return [[(97 * (i + salt) + 13 * j) % (vocab - 10) + 5 for j in range(shapes.services_prompt_len)]
                        for i in range(n)]

            rows = []
            cold = asyncio.run(_burst(address, prompts(burst, 0), tokens))
            warm = asyncio.run(_burst(address, prompts(burst, 1000), tokens))
            cold_p99, warm_p99 = (percentile([r.ttft_s for r in burst_records], 99) for burst_records in (cold, warm))
            rows.append([f"first burst of {burst} after SERVING: TTFT p99", cold_p99 * 1e3, "",
                         f"{cold_p99 / warm_p99:.2f}x the warm burst's (target <= 2x)"])
            rows.append([f"warm burst of {burst}: TTFT p99", warm_p99 * 1e3, "", ""])
            single = asyncio.run(_burst(address, prompts(1, 2000), tokens))
            single_ms = _tpot_ms(single)
            runner_1 = runner_step_ms.get(("triton graphs", 1))
            rows.append(["1 stream: TPOT", single_ms, 1e3 / single_ms,
                         f"ModelRunner batch 1 {runner_1:.2f} ms: services at {runner_1 / single_ms:.2f}x its rate "
                         "(target >= 0.9x)" if runner_1 else ""])
            multi_ms = _tpot_ms(warm)
            runner_b = runner_step_ms.get(("triton graphs", burst))
            rows.append([f"{burst} streams: TPOT", multi_ms, burst * 1e3 / multi_ms,
                         f"ModelRunner batch {burst} {runner_b:.2f} ms: {multi_ms / runner_b:.2f}x its step "
                         "(target <= 1.15x)" if runner_b else ""])
            report.table(["what", "ms", "tokens/s", "against"], rows)


# ---------------------------------------------------------------------------------------- main
@dataclass(frozen=True, slots=True)
class GpuCheckSettings:
    out: str = setting()
    """Markdown report path."""
    dry_run: bool = setting(False)
    """Tiny shapes; runs on a CPU through the interpreter."""
    sections: tuple[str, ...] = setting(SECTIONS, choices=SECTIONS)
    """Which sections to run, comma-separated."""
    test_timeout: float = setting(240.0)
    """Seconds for section (a)."""
    budget: float = setting(450.0)
    """Seconds for the whole run."""

    def validate(self) -> None:
        flags.check_choices("sections", self.sections, SECTIONS)


def _header(report: Report, device, on_gpu: bool, prog: str, argv: list[str]) -> None:
    import torch
    import triton

    gpu = torch.cuda.get_device_name(device) if on_gpu else "CPU (dry run: Triton interpreter, tiny shapes)"
    git = git_revision()
    report.note(f"# tokenmill GPU check\n\n{gpu}; torch {torch.__version__}, triton {triton.__version__}; "
                f"commit {git['short']}{' (tracked files changed)' if git['dirty'] else ''}; "
                f"`{command_line(prog, argv)}`")


def _section(report: Report, title: str, body: Callable[[], object]) -> object:
    """A section's result, or None with its traceback in the report: one failing section does
    not cost the others."""
    report.heading(title)
    section_start = time.perf_counter()
    try:
        return body()
    except Exception:
        report.note("**section failed:**\n```\n" + traceback.format_exc()[-4000:] + "```")
        return None
    finally:
        report.note(f"_{time.perf_counter() - section_start:.1f} s_")


def _kernel_sections(report: Report, shapes: Shapes, device, timer: Timer, end: float) -> None:
    ceilings = _section(report, "(b) ceilings", lambda: measure_ceilings(report, shapes, device, timer))
    if ceilings is None:
        ceilings = Ceilings(bytes_per_s=4.3e12, flops_per_s=790e12)  # earlier H200 readings
        report.note("using earlier H200 readings as ceilings: 4.3 TB/s, 790 TFLOP/s")
    remaining = end - time.perf_counter()
    decode_deadline = time.perf_counter() + 0.3 * remaining
    _section(report, "(b) paged decode attention",
             lambda: bench_decode(report, shapes, device, timer, ceilings, decode_deadline))
    prefill_deadline = time.perf_counter() + 0.4 * (end - time.perf_counter())
    _section(report, "(b) prefill attention",
             lambda: bench_prefill(report, shapes, device, timer, ceilings, prefill_deadline))
    _section(report, "(b) weight-only quantized matmul",
             lambda: bench_quant_matmul(report, shapes, device, timer, ceilings))
    _section(report, "(b) fused mixture-of-experts", lambda: bench_fused_moe(report, shapes, device, timer, ceilings))


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = flags.parse(GpuCheckSettings, argv, prog=prog, description=__doc__)

    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.dry_run:
        print("no CUDA device: run on a GPU, or pass --dry-run to exercise the code paths on the CPU", file=sys.stderr)
        return 2
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first kernel module import
    shapes = DRY_RUN_SHAPES if args.dry_run else Shapes()
    device = torch.device("cuda" if on_gpu else "cpu")
    timer = Timer(on_gpu)
    sections = set(args.sections)
    start = time.perf_counter()
    end = start + args.budget

    report = Report()
    _header(report, device, on_gpu, prog, argv)
    if "tests" in sections:
        _section(report, "(a) kernel tests on the device",
                 lambda: run_kernel_tests(report, shapes, on_gpu, min(args.test_timeout, end - time.perf_counter())))
    if "kernels" in sections:
        _kernel_sections(report, shapes, device, timer, end)
    if "e2e" in sections:
        services_reserve = 120.0 if "services" in sections else 10.0
        _section(report, "(c) end-to-end decode",
                 lambda: bench_end_to_end(report, shapes, device, end - services_reserve))
    if "services" in sections:
        _section(report, "(d) through the services", lambda: bench_services(report, shapes, device, end - 5))
    report.note(f"\ntotal {time.perf_counter() - start:.0f} s")
    Path(args.out).write_text(report.render())
    return 0


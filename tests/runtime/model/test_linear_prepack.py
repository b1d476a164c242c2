"""Linear layers with the weight prepacked for oneDNN (CPU) give F.linear's result, and fall
back to the plain path on CPUs where oneDNN's packed path does not run in a dtype.

An AVX2-only CPU (no AVX-512, no AVX-NE-CONVERT) cannot run oneDNN's bf16 path. The fallback
is checked on every machine by capping oneDNN at AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``) in a
subprocess, which makes the bf16 reorder fail exactly as it does on such a CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from services.runtime.model.linear import PREPACK_MIN_ELEMENTS, Linear, packed_path_works, worth_prepacking
from tests.conftest import REPO_ROOT, STORIES_DIR

AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_fp32_packed_path_runs_on_every_supported_cpu():
    # The pinned CPU build of torch ships oneDNN; fp32 needs nothing beyond AVX2.
    assert packed_path_works(torch.float32)


@pytest.mark.parametrize("rows", [1, 7, 66, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prepacked_matches_f_linear(rows, bias, dtype):
    torch.manual_seed(rows)
    weight = torch.randn(96, 80).to(dtype)
    b = torch.randn(96).to(dtype) if bias else None
    x = torch.randn(rows, 80).to(dtype)
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
    layer = Linear(weight.clone(), None if b is None else b.clone())
    # Where this CPU runs the packed path (bf16 needs AVX-512), it must be taken and be right;
    # elsewhere the layer keeps its plain weight.
    packed = packed_path_works(dtype)
    assert layer.prepack() == packed
    assert (layer.weight is None) == packed and (layer.packed is not None) == packed
    out = layer(x)
    assert out.shape == (rows, 96) and out.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_model_prepacks_the_linears_worth_it_and_tied_head_keeps_embedding():
    from services.runtime.model.attention.torch_backend import TorchAttentionBackend
    from services.runtime.model.llama import LlamaForCausalLM
    from services.runtime.model.linear import Linear as LinearCls

    model = LlamaForCausalLM.from_pretrained(STORIES_DIR, TorchAttentionBackend())
    linears = [m for m in model.modules() if isinstance(m, LinearCls)]
    # stories260K's fp32 matrices are all below the size where oneDNN's call pays for itself.
    assert linears and all(m.out_features * m.in_features < PREPACK_MIN_ELEMENTS[torch.float32] for m in linears)
    assert all(m.packed is None for m in linears)
    # Packed by hand, every linear of the model (the tied head included) gives the plain result.
    assert all(m.prepack() for m in linears) and all(m.packed is not None for m in linears)
    assert model.config.tie_word_embeddings and model.embed is not None  # the lookup table survives
    plain = LlamaForCausalLM.from_pretrained(STORIES_DIR, TorchAttentionBackend(), prepack_cpu_weights=False)
    assert all(m.packed is None for m in plain.modules() if isinstance(m, LinearCls))
    hidden = torch.randn(5, model.config.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), plain.compute_logits(hidden), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_worth_prepacking_by_size_in_fp32_always_in_bf16(dtype):
    small, large = torch.zeros(64, 64, dtype=dtype), torch.zeros(512, 512, dtype=dtype)
    assert worth_prepacking(large)
    assert worth_prepacking(small) == (dtype == torch.bfloat16)


def _run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO_ROOT, env=os.environ | {"OMP_NUM_THREADS": "1"} | env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # a subprocess loading the model twice
def test_avx2_only_cpu_keeps_bf16_on_the_plain_path():
    script = textwrap.dedent(f"""
        import torch, torch.nn.functional as F
        from services.runtime.model.attention.torch_backend import TorchAttentionBackend
        from services.runtime.model.linear import PREPACK_MIN_ELEMENTS, Linear, packed_path_works, worth_prepacking
        from services.runtime.model.llama import LlamaForCausalLM

        assert not packed_path_works(torch.bfloat16), "oneDNN capped at AVX2 must refuse bf16"
        assert packed_path_works(torch.float32)
        layer = Linear(torch.randn(96, 80).bfloat16())
        assert not layer.prepack() and layer.packed is None and layer.weight is not None
        x = torch.randn(7, 80).bfloat16()
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight))

        model = LlamaForCausalLM.from_pretrained({str(STORIES_DIR)!r}, TorchAttentionBackend(), dtype=torch.bfloat16)
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert linears and all(m.packed is None for m in linears)
        reference = LlamaForCausalLM.from_pretrained({str(STORIES_DIR)!r}, TorchAttentionBackend())
        hidden = torch.randn(5, model.config.hidden_size)
        torch.testing.assert_close(model.compute_logits(hidden.bfloat16()), reference.compute_logits(hidden),
                                   atol=0.1, rtol=0.05)
        print("ok")
    """)
    result = _run([sys.executable, "-c", script], AVX2_ONLY)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


@pytest.mark.slow  # `tokenmill generate` as a subprocess
def test_bf16_generation_runs_on_an_avx2_only_cpu():
    command = [sys.executable, "-m", "services.cli.main", "generate", "--in-process", "--dtype", "bf16",
               "--temperature", "0", "--max-tokens", "16", "Once upon a time"]
    result = _run(command, AVX2_ONLY)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("Once upon a time") and len(result.stdout.strip()) > len("Once upon a time")

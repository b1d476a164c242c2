"""Linear layers with the weight prepacked for oneDNN (CPU) give F.linear's result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.common.model.linear import Linear


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
    assert layer.prepack(), "oneDNN prepacking is available in the pinned CPU build of torch"
    assert layer.weight is None and layer.packed is not None
    out = layer(x)
    assert out.shape == (rows, 96) and out.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_model_linears_are_prepacked_on_cpu_and_tied_head_keeps_embedding():
    from services.common.model.attention.torch_backend import TorchAttentionBackend
    from services.common.model.llama import LlamaForCausalLM
    from services.common.model.linear import Linear as LinearCls
    from services.common.service_config import REPO_ROOT

    model = LlamaForCausalLM.from_pretrained(REPO_ROOT / "models" / "stories260K", TorchAttentionBackend())
    linears = [m for m in model.modules() if isinstance(m, LinearCls)]
    assert linears and all(m.packed is not None for m in linears)
    assert model.config.tie_word_embeddings and model.embed is not None  # the lookup table survives
    plain = LlamaForCausalLM.from_pretrained(REPO_ROOT / "models" / "stories260K", TorchAttentionBackend(),
                                             prepack_cpu_weights=False)
    assert all(m.packed is None for m in plain.modules() if isinstance(m, LinearCls))
    hidden = torch.randn(5, model.config.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), plain.compute_logits(hidden), atol=1e-4, rtol=1e-4)

"""The model computes what Hugging Face transformers computes, read through a paged KV cache.

transformers is the test-only reference: it loads the same directory, and fp32 logits must
agree within 1e-4 relative to the logit scale, whether the sequence is computed in one
prompt, in chunks, or token by token from the cache.
"""

from __future__ import annotations

import pytest
import torch

from services.runtime.model.attention.base import AttentionMetadata
from services.runtime.model.attention.torch_backend import TorchAttentionBackend
from services.runtime.model.linear import Linear
from services.runtime.model.llama import LlamaForCausalLM
from services.runtime.kv_cache import KVCache
from tests.helpers.parity_specs import PARITY_SPECS

transformers = pytest.importorskip("transformers")


def hf_logits(model_dir, ids: torch.Tensor) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


def run_chunks(model: LlamaForCausalLM, ids: torch.Tensor, chunks: list[int], block_ids: list[int], block_size: int):
    """Feed ids through the paged cache in the given chunk sizes; return logits of every position."""
    kv = KVCache.allocate(model.config, max(block_ids) + 1, block_size, torch.float32, torch.device("cpu"))
    out, start = [], 0
    table = torch.tensor([block_ids], dtype=torch.int32)
    for n in chunks:
        pos = torch.arange(start, start + n)
        slots = torch.tensor([block_ids[p // block_size] * block_size + p % block_size for p in pos.tolist()])
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=table, context_lens=torch.tensor([start + n], dtype=torch.int32),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32), query_lens_cpu=[n],
            context_lens_cpu=[start + n], max_query_len=n, max_context_len=start + n, block_size=block_size,
        )
        out.append(model.compute_logits(model(ids[start : start + n], pos, kv.layers, meta)))
        start += n
    return torch.cat(out)


def assert_close_to_reference(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4 * scale, f"max abs error {err:.3e} exceeds 1e-4 x logit scale {scale:.3f}"


@pytest.mark.parametrize("name", sorted(PARITY_SPECS))
def test_random_model_logits_match_transformers(random_model_dirs, name):
    model_dir = random_model_dirs[name]
    model = LlamaForCausalLM.from_pretrained(model_dir, TorchAttentionBackend())
    if name == "llama-wide-prepacked":  # the spec that must run the oneDNN-prepacked linears
        assert all(m.packed is not None for m in model.modules() if isinstance(m, Linear))
    ids = torch.randint(0, model.config.vocab_size, (45,), generator=torch.Generator().manual_seed(7))
    ref = hf_logits(model_dir, ids)
    # Whole prompt at once, then the same tokens as a chunked prefill followed by single-token decodes.
    assert_close_to_reference(run_chunks(model, ids, [45], [3, 0, 2], 16), ref)
    assert_close_to_reference(run_chunks(model, ids, [20, 17] + [1] * 8, [6, 1, 4, 9, 2, 7], 8), ref)


def test_stories260k_logits_match_transformers(stories_dir):
    model = LlamaForCausalLM.from_pretrained(stories_dir, TorchAttentionBackend())
    ids = torch.tensor([1] + list(range(300, 340)))
    ref = hf_logits(stories_dir, ids)
    assert_close_to_reference(run_chunks(model, ids, [41], [0, 1, 2], 16), ref)
    assert_close_to_reference(run_chunks(model, ids, [1] * 41, [5, 2, 8, 3, 1, 0], 8), ref)

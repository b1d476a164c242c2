"""Driving a model through the paged KV cache the way the executor does, for parity tests."""

from __future__ import annotations

import torch

from services.runtime.kv_cache import KVCache
from services.runtime.model.attention.base import AttentionMetadata


def step_metadata(start: int, n: int, block_ids: list[int], block_size: int) -> AttentionMetadata:
    """One sequence whose tokens [start, start + n) are new this step."""
    slots = torch.tensor([block_ids[p // block_size] * block_size + p % block_size for p in range(start, start + n)])
    return AttentionMetadata(
        slot_mapping=slots, block_tables=torch.tensor([block_ids], dtype=torch.int32),
        context_lens=torch.tensor([start + n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), query_lens_cpu=[n],
        context_lens_cpu=[start + n], max_query_len=n, max_context_len=start + n, block_size=block_size,
    )


def run_chunks(model, ids: torch.Tensor, chunks: list[int], block_ids: list[int], block_size: int) -> torch.Tensor:
    """Feed ids through the paged cache in the given chunk sizes; return logits of every position."""
    kv = KVCache.allocate(model.config, max(block_ids) + 1, block_size, torch.float32, torch.device("cpu"))
    out, start = [], 0
    for n in chunks:
        meta = step_metadata(start, n, block_ids, block_size)
        out.append(model.compute_logits(model(ids[start : start + n], torch.arange(start, start + n), kv.layers, meta)))
        start += n
    return torch.cat(out)


def greedy(model, prompt: torch.Tensor, new_tokens: int, block_size: int = 16, prefill_chunk: int = 0) -> list[int]:
    """Greedy ids after ``prompt``: the prompt in chunks of ``prefill_chunk`` (0: at once), then one token a step.
    Blocks are handed out in reverse order, so a sequence's blocks are never contiguous in the pool."""
    total = len(prompt) + new_tokens
    num_blocks = -(-total // block_size)
    block_ids = list(range(num_blocks))[::-1]
    kv = KVCache.allocate(model.config, num_blocks, block_size, torch.float32, torch.device("cpu"))
    ids = prompt.tolist()
    start, chunk = 0, prefill_chunk or len(ids)
    while start < len(ids):
        n = min(chunk, len(ids) - start)
        meta = step_metadata(start, n, block_ids, block_size)
        hidden = model(torch.tensor(ids[start : start + n]), torch.arange(start, start + n), kv.layers, meta)
        start += n
    out = []
    while True:
        token = int(model.compute_logits(hidden[-1:]).argmax(-1))
        out.append(token)
        if len(out) == new_tokens:
            return out
        ids.append(token)
        meta = step_metadata(start, 1, block_ids, block_size)
        hidden = model(torch.tensor([token]), torch.tensor([start]), kv.layers, meta)
        start += 1


def hf_greedy(hf, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    """transformers' greedy continuation, end-of-sequence ignored (so every run is ``new_tokens`` long).
    No end-of-sequence id is given rather than a minimum length, which would mask its logit."""
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def assert_close_to_reference(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4 * scale, f"max abs error {err:.3e} exceeds 1e-4 x logit scale {scale:.3f}"

"""What the runs that judge a model's quality share: the SmolLM2 chat prompts, the perplexity
text written for this project, and perplexity over the in-process engine."""

from __future__ import annotations

import json
import math

from benchmarks.harness.paths import DATA_DIR

PROMPTS_FILE = DATA_DIR / "smollm2_chat_prompts.jsonl"
PERPLEXITY_FILE = DATA_DIR / "smollm2_perplexity.txt"


def load_prompts() -> list[list[dict[str, str]]]:
    conversations = []
    for line in PROMPTS_FILE.read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            conversations.append([{"role": "system", "content": item["system"]},
                                  {"role": "user", "content": item["user"]}])
    return conversations


def perplexity(engine, text: str) -> tuple[float, int]:
    """exp(mean NLL of each next token) of ``text`` in one forward; (perplexity, tokens)."""
    import torch
    import torch.nn.functional as F

    from services.runtime.model.attention.base import AttentionMetadata

    runner = engine.runner
    ids = engine.encode_prompt(text)
    n, bs = len(ids), runner.block_size
    if n > runner.max_model_len or -(-n // bs) > runner.num_usable_blocks:
        raise ValueError(f"the perplexity text ({n} tokens) does not fit the model's context or KV pool")
    device = runner.device
    blocks = list(range(-(-n // bs)))
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device),
        block_tables=torch.tensor([blocks], dtype=torch.int32, device=device),
        context_lens=torch.tensor([n], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        query_lens_cpu=[n], context_lens_cpu=[n], max_query_len=n, max_context_len=n, block_size=bs,
    )
    tokens = torch.tensor(ids, device=device)
    with torch.inference_mode():
        hidden = runner.model(tokens, torch.arange(n, device=device), runner.kv_cache.layers, meta)
        logits = runner.model.compute_logits(hidden[:-1])
        nll = F.cross_entropy(logits, tokens[1:])
    return math.exp(nll.item()), n

"""A copy of a tied-embedding model with its config vocab padded past its tokenizer's, as
Qwen2-family checkpoints ship theirs (config vocab 151,936 rows, tokenizer 151,665 ids): for the
tests and the hostile-flood benchmark (benchmarks/hostile_flood.py).

The padded rows of the embedding (which is also the LM head) are the real rows scaled by
``PAD_SCALE``, so wherever the model's best token has a positive logit its padded twin scores
higher: a runner that does not mask the padded rows samples ids no tokenizer can decode.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

PAD_SCALE = 1.5


def pad_vocab(source: Path, out: Path, vocab_size: int) -> Path:
    """Write the padded copy of ``source`` (a tied-embedding safetensors model) to ``out``."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((source / "config.json").read_text())
    if not config.get("tie_word_embeddings"):
        raise ValueError(f"{source}: only tied-embedding models are padded (the embedding is the LM head)")
    tensors = load_file(str(source / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    if vocab_size <= embed.shape[0]:
        raise ValueError(f"vocab_size must exceed the model's {embed.shape[0]} rows, got {vocab_size}")
    out.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and item.name not in ("model.safetensors", "config.json"):
            shutil.copy2(item, out / item.name)
    (out / "config.json").write_text(json.dumps({**config, "vocab_size": vocab_size}, indent=2))
    extra = vocab_size - embed.shape[0]
    padding = (embed * PAD_SCALE).repeat(-(-extra // embed.shape[0]), 1)[:extra]
    tensors["model.embed_tokens.weight"] = torch.cat([embed, padding]).contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    return out

"""stories260K with its config vocab padded past its tokenizer's, as Qwen2-family checkpoints
ship theirs (config vocab 151,936 rows, tokenizer 151,665 ids).

The padded rows of the (tied) embedding are the real rows scaled by ``PAD_SCALE``, so wherever
the model's best token has a positive logit its padded twin scores higher: a runner that does
not mask the padded rows samples an id the tokenizer does not have.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from tests.helpers.service_harness import STORIES_DIR

PAD_SCALE = 1.5
TOKENIZER_VOCAB = 512
"""stories260K's tokenizer: ids [0, 512)."""


def padded_vocab_model(out: Path, vocab_size: int = 2 * TOKENIZER_VOCAB) -> Path:
    """A copy of stories260K at ``out`` whose config vocab is ``vocab_size`` rows (> 512)."""
    import torch

    if vocab_size <= TOKENIZER_VOCAB:
        raise ValueError(f"vocab_size must exceed the tokenizer's {TOKENIZER_VOCAB}, got {vocab_size}")
    out.mkdir(parents=True, exist_ok=True)
    for item in STORIES_DIR.iterdir():
        if item.name not in ("model.safetensors", "config.json"):
            shutil.copy2(item, out / item.name)
    config = json.loads((STORIES_DIR / "config.json").read_text())
    config["vocab_size"] = vocab_size
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(str(STORIES_DIR / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    extra = vocab_size - embed.shape[0]
    reps = -(-extra // embed.shape[0])
    padding = (embed * PAD_SCALE).repeat(reps, 1)[:extra]
    tensors["model.embed_tokens.weight"] = torch.cat([embed, padding]).contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    return out

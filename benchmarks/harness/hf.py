"""The Hugging Face baseline model: the same weights through transformers, doing the same work.

Every comparison forces the output length (tokenmill's max_tokens + ignore_eos), so the
baseline must never stop at an end token: generate() merges the model's own
generation_config, so an eos_token_id=None passed per call does not clear it, and
min_new_tokens would *ban* the end tokens, which ignore_eos does not. The model's config
is cleared instead.
"""

from __future__ import annotations

import torch


def load_model(model_dir: str, device: str = "cpu"):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model

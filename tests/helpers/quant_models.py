"""The float twin of a quantized model directory, for the tests of weight-only quantization."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.runtime.model.config import ModelConfig
from services.runtime.model.quant.formats import QuantizedWeight, dequantize
from services.runtime.model.weights import load_checkpoint


def write_dequantized(quant_dir: Path, out_dir: Path) -> Path:
    """The float model holding exactly the quantized model's numbers (each weight dequantized in fp32)."""
    config = ModelConfig.from_model_dir(quant_dir)
    tensors = load_checkpoint(quant_dir, config, torch.float32)
    state = {k: dequantize(v) if isinstance(v, QuantizedWeight) else v for k, v in tensors.items()}
    out_dir.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"))
    raw = json.loads((quant_dir / "config.json").read_text())
    del raw["quantization_config"]
    (out_dir / "config.json").write_text(json.dumps(raw))
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "generation_config.json"):
        if (quant_dir / name).is_file():
            (out_dir / name).write_bytes((quant_dir / name).read_bytes())
    return out_dir

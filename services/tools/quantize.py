"""``tokenmill quantize DIR --weights int8|int4 --out DIR2``: weight-only quantization of a safetensors model.

Round to nearest (services/runtime/model/quant/formats.py ``quantize``), group-wise along the
input axis:

- ``int4``: every linear projection in q4_1 (4-bit, a scale and a minimum per group of 32,
  llama.cpp's layout), the embedding (and an untied LM head) in q8_0, as llama.cpp's Q4 files do:
  the LM head is the largest single matrix and the most sensitive to rounding.
- ``int8``: every projection, the embedding and an untied LM head in int8 with one scale per
  output row (the layout of PyTorch's CPU int8 operator; for the embedding a row is a token).
- ``q4_0``, ``q4_1``, ``q8_0``: that format for the projections, the embedding as for int4.

A projection whose input size is not a multiple of the group size stays in float and is
listed as ``"none"`` in config.json's ``quantization_config`` (quant/config.py), which also
records every other choice. Other files of the directory (tokenizer, generation config) are
copied; the directory is built beside ``--out`` and renamed into place when complete.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.runtime.model.config import ModelConfig
from services.runtime.model.quant.checkpoint import quantized_modules
from services.runtime.model.quant.config import EMBEDDING, LM_HEAD, NONE, QuantizationConfig
from services.runtime.model.quant.formats import GGUF_GROUP_SIZE, check_shape, quantize
from services.runtime.model.weights import find_safetensors_files, load_checkpoint

SCHEMES = {"int4": ("q4_1", "q8_0"), "int8": ("int8", "int8"),
           "q4_0": ("q4_0", "q8_0"), "q4_1": ("q4_1", "q8_0"), "q8_0": ("q8_0", "q8_0")}
"""--weights -> (format of the projections, format of the embedding and an untied LM head)."""


def plan(config: ModelConfig, shapes: dict[str, tuple[int, ...]], weights: str, group_size: int) -> QuantizationConfig:
    """The quantization_config for ``weights``: exceptions for the embedding, the head and misfits."""
    linear_fmt, table_fmt = SCHEMES[weights]
    modules = {EMBEDDING: table_fmt}
    if not config.tie_word_embeddings:
        modules[LM_HEAD] = table_fmt
    draft = QuantizationConfig(linear_fmt, group_size, modules)
    for module, fmt in quantized_modules(draft, config.num_layers, config.tie_word_embeddings).items():
        out_features, in_features = shapes[module + ".weight"]
        try:
            check_shape(fmt, out_features, in_features, group_size)
        except ValueError:
            modules[module] = NONE  # e.g. stories260K's FFN of 172: not a multiple of 32
    return QuantizationConfig(linear_fmt, group_size, modules)


def quantize_model(src: Path, out_dir: Path, weights: str, group_size: int = GGUF_GROUP_SIZE,
                   force: bool = False) -> QuantizationConfig:
    if weights not in SCHEMES:
        raise ValueError(f"--weights must be one of {', '.join(SCHEMES)}; got {weights!r}")
    raw = json.loads((src / "config.json").read_text()) if (src / "config.json").is_file() else None
    if raw is None:
        raise FileNotFoundError(f"model directory {src} has no config.json")
    if raw.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({raw['quantization_config'].get('format')}); "
                         "quantize its float original")
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise FileExistsError(f"{out_dir} exists and is not empty; remove it or pass --force")
    config = ModelConfig.from_dict(raw)
    tensors = load_checkpoint(src, config, config.dtype)
    quant = plan(config, {k: tuple(v.shape) for k, v in tensors.items()}, weights, group_size)
    state: dict[str, torch.Tensor] = {}
    for module, fmt in quantized_modules(quant, config.num_layers, config.tie_word_embeddings).items():
        q = quantize(tensors.pop(module + ".weight"), fmt, group_size)
        state |= {f"{module}.{suffix}": t.contiguous() for suffix, t in q.parts().items()}
    state |= {name: t.contiguous() for name, t in tensors.items()}

    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    weight_files = {p.name for p in find_safetensors_files(src)} | {"model.safetensors.index.json", "config.json"}
    for path in src.iterdir():
        if path.is_file() and path.name not in weight_files:
            shutil.copy2(path, partial / path.name)
    save_file(state, str(partial / "model.safetensors"), metadata={"format": "pt"})
    raw["quantization_config"] = quant.to_dict()
    (partial / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    partial.rename(out_dir)
    return quant


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tokenmill quantize",
        description="Quantize a safetensors model's weights (round to nearest, group-wise) into a new directory.")
    parser.add_argument("model", type=Path, help="the model directory (config.json + *.safetensors)")
    parser.add_argument("--weights", choices=list(SCHEMES), required=True,
                        help="int4: q4_1 projections, q8_0 embedding; int8: per-channel int8 everywhere; "
                             "or one GGUF format for the projections")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--group-size", type=int, default=GGUF_GROUP_SIZE,
                        help=f"values per scale for the group-wise formats (default {GGUF_GROUP_SIZE})")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        quant = quantize_model(args.model, args.out, args.weights, args.group_size, args.force)
    except (OSError, ValueError) as error:
        print(f"tokenmill quantize: error: {error}", file=sys.stderr)
        return 1
    floats = sorted(m for m, f in quant.modules.items() if f == NONE)
    note = f"; kept in float (input size not a multiple of {args.group_size}): {len(floats)} module(s)" if floats else ""
    print(f"wrote {args.out} ({args.weights}: projections {quant.format}, embedding "
          f"{quant.format_of(EMBEDDING) or 'float'}) in {time.perf_counter() - started:.1f} s{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

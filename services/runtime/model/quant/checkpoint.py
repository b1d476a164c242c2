"""Which tensors a quantized checkpoint holds, and assembling them into QuantizedWeights at load.

weights.py asks ``split_expected`` which of the float layout's ``X.weight`` tensors are stored
as parts (``X.qweight``, ``X.scales``, ``X.mins``), checks each part's shape and dtype as it
reads it (parts are never cast), and hands the loaded dict to ``assemble``, which puts one
QuantizedWeight under each ``X.weight`` name, so the model builds from one dict either way.
"""

from __future__ import annotations

import torch

from services.runtime.model.quant.config import EMBEDDING, LINEAR_NAMES, LM_HEAD, QuantizationConfig
from services.runtime.model.quant.formats import QuantizedWeight, part_specs

PartSpecs = dict[str, tuple[tuple[int, ...], torch.dtype]]


def quantized_modules(quant: QuantizationConfig, num_layers: int, tied: bool,
                      shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, str]:
    """Module name -> format for every module the checkpoint stores quantized.

    With the float layout's ``shapes``, the projections it has: a sparse layer's routed experts
    (``...experts.N.<proj>``) and shared expert (``...shared_expert.<proj>``) count as linear
    projections, its absent dense MLP does not."""
    names = [f"model.layers.{i}.{n}" for i in range(num_layers) for n in LINEAR_NAMES]
    experts = [] if shapes is None else [k.removesuffix(".weight") for k in shapes
                                         if (".experts." in k or ".shared_expert." in k) and k.endswith(".weight")]
    unknown = sorted(set(quant.modules) - set(names) - set(experts) - {EMBEDDING, LM_HEAD})
    if unknown:
        raise ValueError(f"quantization_config modules names module(s) the model does not have: {', '.join(unknown[:5])}")
    if shapes is not None:
        names = [n for n in names if n + ".weight" in shapes] + experts
    names.append(EMBEDDING)
    if not tied:
        names.append(LM_HEAD)
    return {name: fmt for name in names if (fmt := quant.format_of(name)) is not None}


def split_expected(shapes: dict[str, tuple[int, ...]], quant: QuantizationConfig, num_layers: int, tied: bool
                   ) -> tuple[dict[str, tuple[int, ...]], PartSpecs]:
    """The float layout's shapes -> (float tensors still expected, quantized parts expected)."""
    floats = dict(shapes)
    parts: PartSpecs = {}
    for module, fmt in quantized_modules(quant, num_layers, tied, shapes).items():
        out_features, in_features = floats.pop(module + ".weight")
        try:
            specs = part_specs(fmt, out_features, in_features, quant.group_size)
        except ValueError as exc:
            raise ValueError(f"quantization_config: {module} [{out_features}, {in_features}]: {exc}") from None
        parts |= {f"{module}.{suffix}": spec for suffix, spec in specs.items()}
    return floats, parts


def assemble(tensors: dict[str, torch.Tensor], quant: QuantizationConfig, num_layers: int, tied: bool,
             shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Replace each quantized module's parts by one QuantizedWeight under ``<module>.weight``."""
    out: dict[str, torch.Tensor | QuantizedWeight] = dict(tensors)
    for module, fmt in quantized_modules(quant, num_layers, tied, shapes).items():
        parts = {suffix: out.pop(f"{module}.{suffix}") for suffix in ("qweight", "scales", "mins")
                 if f"{module}.{suffix}" in out}
        out[module + ".weight"] = QuantizedWeight.from_parts(fmt, parts, quant.group_size)
    return out

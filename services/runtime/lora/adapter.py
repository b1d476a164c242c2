"""A PEFT LoRA adapter read from its directory, checked against the base model before it is used.

PEFT saves ``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``, ...) and ``adapter_model.safetensors`` with, per adapted projection,
``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight`` [r, in] and
``...lora_B.weight`` [out, r]. The adapted projection is W + scale * B @ A, with scale =
lora_alpha / r (lora_alpha / sqrt(r) with rslora).

Everything that would change the numbers in a way this engine does not compute is refused, with
the file and the field or tensor named: other PEFT types, DoRA, per-module rank or alpha
patterns, trained biases, extra saved modules, a module other than q/k/v/o/gate/up/down, a
shape that does not fit the base model, a rank above ``max_rank``. Pickled ``adapter_model.bin``
files are never loaded (unpickling runs code).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.common.adapters import name_problem
from services.runtime.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
MAX_CONFIG_BYTES = 1 << 20
"""Largest adapter_config.json read (PEFT writes about a kilobyte)."""
DEFAULT_MAX_FILE_BYTES = 1 << 30
"""Largest adapter_model.safetensors read unless the executor says otherwise (--max-lora-file-bytes)."""

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target, by their Hugging Face names."""

LORA_FAMILIES = ("llama", "qwen3")
"""Model families whose layers apply adapters (q|k|v, o, gate|up, down as llama.py builds them)."""

_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")



class AdapterError(ValueError):
    """An adapter that cannot be served here; the message names the file and the field or tensor."""


@dataclass(slots=True)
class LoraAdapter:
    name: str
    path: Path
    rank: int
    alpha: float
    scale: float
    """What B @ A is multiplied by: alpha / rank, or alpha / sqrt(rank) with rslora."""
    target_modules: tuple[str, ...]
    fingerprint: str
    """sha256 of the config and weight files: the adapter's identity for the prefix cache (a
    name reloaded with other weights is another adapter)."""
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] | None = field(default=None, repr=False)
    """(layer, module) -> (A [r, in], B [out, r]) fp32, on the host; dropped once copied to a slot."""


def check_name(name: str) -> str:
    problem = name_problem(name)
    if problem is not None:
        raise AdapterError(problem)
    return name


def parse_lora_flag(entry: str) -> tuple[str, str]:
    """``NAME=PATH`` (a --lora flag) as (name, path)."""
    name, sep, path = entry.partition("=")
    if not sep or not path:
        raise ValueError(f"lora entries must be NAME=PATH, got {entry[:200]!r}")
    return check_name(name), path


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each target module of one layer."""
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q),
            "gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)}


def load_adapter(name: str, path: str | Path, model: ModelConfig, max_rank: int,
                 max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> LoraAdapter:
    """Read and check the adapter at ``path`` against the base model ``model``; a weights file
    over ``max_bytes`` or a rank over ``max_rank`` is refused before the weights are read."""
    check_name(name)
    directory = Path(path)
    if model.family not in LORA_FAMILIES:
        raise AdapterError(f"adapter {name!r}: LoRA adapters run on the {', '.join(LORA_FAMILIES)} families; "
                           f"the base model is {model.architecture}")
    if not directory.is_dir():
        raise AdapterError(f"adapter {name!r}: {directory} is not a directory")
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.is_file():
        raise AdapterError(f"adapter {name!r}: {config_path} is missing")
    if not weights_path.is_file():
        pickles = [p for p in PICKLE_FILES if (directory / p).is_file()]
        if pickles:
            raise AdapterError(f"adapter {name!r}: {directory / pickles[0]} is a pickle file, which tokenmill never "
                               f"loads (unpickling can execute code); save the adapter as {WEIGHTS_FILE} "
                               f"(PEFT's save_pretrained does by default)")
        raise AdapterError(f"adapter {name!r}: {weights_path} is missing")
    _check_sizes(name, config_path, weights_path, max_bytes)
    config_bytes = config_path.read_bytes()
    try:
        config = json.loads(config_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"adapter {name!r}: {config_path} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: {config_path} must hold a JSON object")
    rank, alpha, rslora, targets = _check_config(name, config_path, config, max_rank)
    weights_bytes = weights_path.read_bytes()  # only once its config passed: the rank bounds what it holds
    weights = _read_weights(name, weights_path, weights_bytes, model, rank, targets)
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    fingerprint = hashlib.sha256(hashlib.sha256(config_bytes).digest() + hashlib.sha256(weights_bytes).digest())
    return LoraAdapter(name, directory, rank, alpha, scale, tuple(sorted({m for _, m in weights})),
                       fingerprint.hexdigest()[:32], weights)


def _check_sizes(name: str, config_path: Path, weights_path: Path, max_bytes: int) -> None:
    """Refuse files too large to read, by their size on disk (a caller of LoadAdapter must not
    make the executor read gigabytes into memory)."""
    for path, limit, setting_name in ((config_path, MAX_CONFIG_BYTES, "MAX_CONFIG_BYTES"),
                                      (weights_path, max_bytes, "max_lora_file_bytes")):
        size = path.stat().st_size
        if size > limit:
            raise AdapterError(f"adapter {name!r}: {path} is {size} bytes, over {setting_name}={limit}")


def _check_config(name: str, path: Path, config: dict, max_rank: int) -> tuple[int, float, bool, set[str]]:
    def refuse(field_name: str, why: str) -> AdapterError:
        return AdapterError(f"adapter {name!r}: {path} field {field_name}: {why}")

    if config.get("peft_type", "LORA") != "LORA":
        raise refuse("peft_type", f"{config.get('peft_type')!r} is not LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise refuse("r", f"must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise refuse("r", f"rank {rank} exceeds max_lora_rank={max_rank}")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise refuse("lora_alpha", f"must be a number, got {alpha!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise refuse(key, "per-module ranks or alphas are not supported (one r and lora_alpha for every module)")
    if config.get("use_dora"):
        raise refuse("use_dora", "DoRA adapters are not supported")
    if config.get("bias", "none") != "none":
        raise refuse("bias", f"{config.get('bias')!r}: adapters with trained biases are not supported")
    if config.get("modules_to_save"):
        raise refuse("modules_to_save", "adapters that replace whole modules are not supported")
    if config.get("fan_in_fan_out"):
        raise refuse("fan_in_fan_out", "transposed (Conv1D) weights are not supported")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise refuse("target_modules", f"must be a list of module names, got {targets!r}")
    unknown = [t for t in targets if t not in TARGET_MODULES]
    if unknown:
        raise refuse("target_modules", f"unknown target module {unknown[0]!r} (supported: {', '.join(TARGET_MODULES)})")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise refuse("use_rslora", f"must be true or false, got {rslora!r}")
    return rank, float(alpha), rslora, set(targets)


def _read_weights(name: str, path: Path, data: bytes, model: ModelConfig, rank: int, targets: set[str]
                  ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from safetensors.torch import load as load_bytes

    def refuse(tensor: str, why: str) -> AdapterError:
        return AdapterError(f"adapter {name!r}: {path} tensor {tensor}: {why}")

    try:
        tensors = load_bytes(data)
    except Exception as exc:  # safetensors raises its own error types for a corrupt header
        raise AdapterError(f"adapter {name!r}: {path} is not a readable safetensors file: {exc}") from None
    shapes = module_shapes(model)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR_NAME.match(key)
        if match is None:
            raise refuse(key, "not a lora_A/lora_B weight of a decoder layer's projection")
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in TARGET_MODULES:
            raise refuse(key, f"unknown target module {module!r} (supported: {', '.join(TARGET_MODULES)})")
        if module not in targets:
            raise refuse(key, f"module {module!r} is not in adapter_config.json's target_modules")
        if layer >= model.num_layers:
            raise refuse(key, f"layer {layer} is past the base model's {model.num_layers} layers")
        out_features, in_features = shapes[module]
        expected = (rank, in_features) if which == "A" else (out_features, rank)
        if tuple(tensor.shape) != expected:
            raise refuse(key, f"shape {list(tensor.shape)} does not match {list(expected)} (r={rank} and the base "
                              f"model's {module})")
        if not tensor.is_floating_point():
            raise refuse(key, f"dtype {tensor.dtype} is not a floating-point type")
        parts.setdefault((layer, module), {})[which] = tensor.float()
    weights = {}
    for (layer, module), pair in sorted(parts.items()):
        if len(pair) != 2:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise refuse(f"base_model.model.model.layers.{layer}.*.{module}.{missing}.weight", "missing")
        weights[(layer, module)] = (pair["A"], pair["B"])
    if not weights:
        raise AdapterError(f"adapter {name!r}: {path} holds no lora_A/lora_B weights")
    return weights

"""Model directories of the runs: a directory as given, or a random-weight preset built into the cache.

"random:PRESET" names a services.tools.random_model preset; it is built on first use into
benchmarks/.cache/PRESET (git-ignored), deterministic from the preset and its seed, and
built again when the preset's spec changed since.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from benchmarks.harness.paths import CACHE_DIR

RANDOM = "random:"


def random_model_dir(name: str) -> Path:
    """The random-weight preset ``name`` in the cache, built when missing or stale."""
    from services.tools.random_model import PRESETS, build_random_model

    if name not in PRESETS:
        raise ValueError(f"unknown random model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    spec = PRESETS[name]
    out = CACHE_DIR / name
    spec_file = out / "random_model_spec.json"
    fresh = spec_file.is_file() and json.loads(spec_file.read_text()) == json.loads(json.dumps(asdict(spec)))
    if not (fresh and (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()):
        print(f"writing {name} ({spec.num_parameters() / 1e6:.1f}M parameters) to {out} ...", flush=True)
        build_random_model(spec, out)
    if not (out / "tokenizer.json").is_file():
        raise ValueError(f"{out} has no tokenizer.json: the services and the in-process engine need one "
                         "(build_random_model writes a synthetic one when the vocabulary allows)")
    return out


def resolve_model(model: str) -> str:
    """A model directory for ``model``: a directory with a config.json, or "random:PRESET"."""
    if model.startswith(RANDOM):
        return str(random_model_dir(model.removeprefix(RANDOM)))
    if not (Path(model) / "config.json").is_file():
        raise ValueError(f"model {model!r} is not a model directory (no config.json)")
    return model


def require(model_dir: Path, how: str = "`make install` converts it") -> Path:
    """``model_dir`` when it holds a model, else a SystemExit saying how to get it."""
    if not (Path(model_dir) / "config.json").is_file():
        raise SystemExit(f"{model_dir} is missing: {how}")
    return Path(model_dir)

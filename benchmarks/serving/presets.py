"""Named benchmark configurations (``tokenmill bench --preset NAME``) and the models they use.

The random models are built on first use into benchmarks/.cache/ (git-ignored) by
services.tools.random_model, deterministic from their preset and seed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from services.common.service_config import REPO_ROOT

STORIES = str(REPO_ROOT / "models" / "stories260K")
CACHE_DIR = REPO_ROOT / "benchmarks" / ".cache"
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


@dataclass(frozen=True, slots=True)
class Preset:
    description: str
    model: str
    """A model directory, or "random:PRESET" for a random_model preset built into the cache."""
    num_requests: int
    concurrency: int
    prompt_len: str
    output_len: str
    shared_prefix_fraction: float = 0.0
    request_rate: float | None = None
    hf_sequential_requests: int | None = None
    """Run HF sequential on the first N requests only (None = all)."""
    kv_cache_bytes: int = 2 * 1024**3
    """KV pool of both tokenmill systems; small models get a small pool so its usage is legible."""
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    systems: tuple[str, ...] = field(default=("services", "inprocess", "hf-static", "hf-sequential"))


PRESETS: dict[str, Preset] = {
    "headline": Preset(
        "~100M random Llama, 256 requests, 32 concurrent, prompts U[32,256], outputs U[16,256]",
        "random:llama-100m", 256, 32, "32:256", "16:256", hf_sequential_requests=24,
        slo_ttft_ms=5000.0, slo_tpot_ms=250.0),
    "stories": Preset(
        "stories260K (overhead-dominated: the model is tiny, the Python around it is not)",
        STORIES, 256, 32, "32:192", "16:256", kv_cache_bytes=32 * 1024**2, slo_ttft_ms=500.0, slo_tpot_ms=50.0),
    "quick": Preset(
        "smoke run on stories260K: 12 requests, 4 concurrent, short lengths, all four systems",
        STORIES, 12, 4, "8:32", "8:24", kv_cache_bytes=2 * 1024**2, slo_ttft_ms=1000.0, slo_tpot_ms=100.0),
    "shared-prefix": Preset(
        "~100M random Llama, 96 requests sharing 75% of a 128..256-token prompt, 16 concurrent",
        "random:llama-100m", 96, 16, "128:256", "16:64", shared_prefix_fraction=0.75, hf_sequential_requests=8,
        slo_ttft_ms=5000.0, slo_tpot_ms=250.0),
    "long-context": Preset(
        "~100M random Llama, 24 requests with 768..1024-token prompts, 8 concurrent",
        "random:llama-100m", 24, 8, "768:1024", "32:64", hf_sequential_requests=4,
        slo_ttft_ms=20000.0, slo_tpot_ms=500.0),
}


def resolve_model(model: str) -> str:
    """A model directory for ``model``; builds "random:PRESET" into the cache when missing or stale."""
    if not model.startswith("random:"):
        if not (Path(model) / "config.json").is_file():
            raise ValueError(f"model {model!r} is not a model directory (no config.json)")
        return model
    from services.tools.random_model import PRESETS as RANDOM_PRESETS, build_random_model

    name = model.removeprefix("random:")
    if name not in RANDOM_PRESETS:
        raise ValueError(f"unknown random model preset {name!r}; known: {', '.join(sorted(RANDOM_PRESETS))}")
    spec = RANDOM_PRESETS[name]
    out = CACHE_DIR / name
    spec_file = out / "random_model_spec.json"
    fresh = spec_file.is_file() and json.loads(spec_file.read_text()) == json.loads(json.dumps(asdict(spec)))
    if not (fresh and (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()):
        build_random_model(spec, out)
    if not (out / "tokenizer.json").is_file():
        raise ValueError(f"{out} has no tokenizer.json: the services and the in-process engine need one "
                         "(build_random_model writes a synthetic one when the vocabulary allows)")
    return str(out)

"""Named configurations of the serving benchmark (``python -m benchmarks serving --preset NAME``).

A preset's model is a directory or "random:PRESET", a random-weight model built into the
cache on first use (benchmarks/harness/models.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.harness.paths import STORIES as _STORIES

STORIES = str(_STORIES)


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


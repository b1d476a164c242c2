"""The serving benchmark against Hugging Face baselines (``python -m benchmarks serving``; driver.py)."""

"""The serving benchmark: ``python -m benchmarks.serving`` or ``tokenmill bench`` (driver.py)."""

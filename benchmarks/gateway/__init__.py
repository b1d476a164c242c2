"""The gateway's run (``python -m benchmarks gateway``, make bench-gateway): driver.py and its parts."""

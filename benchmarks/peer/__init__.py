"""tokenmill against llama.cpp on stories260K (``make bench-peer``, ``python -m benchmarks peer``).

driver.py: settings, the interleaved runs, the table, the JSON; tokenmill.py and llamacpp.py: the
systems; figures.py: medians, ratios, greedy agreement; gguf.py: the GGUF's checksum check.
"""

"""The serving benchmark behind `tokenmill bench` (see services/cli/bench.py)."""

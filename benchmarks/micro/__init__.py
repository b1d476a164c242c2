"""Micro-benchmarks: each answered one question (``python -m benchmarks NAME``; the answers are in docs/benchmarks.md)."""

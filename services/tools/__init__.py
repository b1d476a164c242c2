"""Model conversion and building tools: llama2.c import, random-weight models for tests and benchmarks."""

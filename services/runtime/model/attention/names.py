"""The attention backend names, importable without torch (command-line parsers list them)."""

BACKEND_NAMES = ("auto", "torch", "triton", "cpu")

"""The attention backend names, importable without torch (command-line parsers list them)."""

BACKEND_NAMES = ("auto", "torch", "triton", "cpu")

KV_CACHE_DTYPE_NAMES = ("auto", "int8", "fp8_e4m3")
"""--kv-cache-dtype values: auto stores K/V in the model's dtype; int8 and fp8_e4m3 quantize them
with one fp16 scale per token per kv head (services/runtime/kernels/kv_quant.py)."""

"""Executor configuration: which model, where, in what precision, and how much KV memory.

ExecutorConfig is the engine's (ModelRunner, in-process engine); ExecutorServiceConfig is the
executor process's: the same fields as flags and TOKENMILL_EXECUTOR_* variables, plus where
to listen.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from services.common.service_config import model_field, service_process_fields
from services.runtime.model.attention.names import KV_CACHE_DTYPE_NAMES

CPU_DECODE_MODES = ("auto", "fused", "eager")


@dataclass(slots=True)
class ExecutorConfig:
    model: str
    """Path of a Hugging Face-style model directory (config.json, *.safetensors, tokenizer.json)."""
    dtype: str = "auto"
    """fp32, bf16, fp16, or auto (the checkpoint's dtype; fp32 on CPU when it is half precision)."""
    device: str = "auto"
    """cpu, cuda, cuda:N, or auto (cuda when available)."""
    attention_backend: str = "auto"
    """torch, triton, cpu, or auto (triton on CUDA; on a CPU, cpu when its C++ kernel builds, else torch)."""
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_bytes: int = 2 * 1024**3
    """KV pool budget on CPU, in bytes (all layers, K and V)."""
    kv_cache_dtype: str = "auto"
    """auto (the model's dtype), int8 or fp8_e4m3: K/V stored quantized with one fp16 scale per
    token per kv head; the same byte budget then holds ~1.9x the tokens of a bf16 pool."""
    gpu_memory_utilization: float = 0.90
    """On CUDA, the fraction of total device memory the process may use: weights, activations and the KV pool."""
    num_blocks: int = 0
    """Force an exact number of KV blocks (0 = size from the memory budget). Tests use it."""
    max_model_len: int = 0
    """Cap on context length (0 = the model's own limit)."""
    seed: int = 0
    """Seed of the shared generator used for unseeded sampling."""
    compile: bool = False
    """CPU only: run decode-only steps through a torch.compile'd forward (inductor). Start-up pays
    the compilation; outputs may differ from the eager path's in the last bits of the logits."""
    cpu_decode: str = "auto"
    """CPU steps: auto (a small fp32 model's whole step in one C++ call,
    services/runtime/model/fused_decode.py, when the model qualifies; else eager), fused (the
    same, and an error when the model does not qualify) or eager (the PyTorch forward). Decode
    steps always take the call; steps with prompt tokens up to cpu_fused_max_tokens."""
    cpu_fused_max_tokens: int = 64
    """With the fused CPU step in use, steps that carry prompt, chunk or draft tokens run fused
    too while they hold at most this many new tokens (each token a row reading the paged cache
    up to its own position); larger ones run eagerly. 64: past it the largest model the fused
    step takes runs faster eagerly (docs/benchmarks.md); stories260K runs 2-9x faster fused up
    to there. 0 = decode-only steps alone."""
    enforce_eager: bool = False
    """On CUDA, run every step eagerly instead of replaying decode steps from CUDA graphs."""
    cuda_graph_max_batch_size: int = 128
    """Largest decode batch captured as a CUDA graph (buckets 1, 2, 4, 8, then steps of 8 up to it);
    larger decode batches run eagerly."""
    padded_decode_on_cpu: bool = False
    """Testing aid: on a CPU, run decode steps through the CUDA-graph path's bucket-padded
    persistent buffers (eagerly; there is nothing to capture), so that path is tested without a GPU."""

    def validate(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_NAMES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.compile and self.kv_cache_dtype != "auto":
            raise ValueError(f"compile runs the C++ decode ops over a plain KV pool; kv_cache_dtype "
                             f"{self.kv_cache_dtype!r} needs compile off")
        if self.cpu_decode not in CPU_DECODE_MODES:
            raise ValueError(f"cpu_decode must be one of {', '.join(CPU_DECODE_MODES)}, got {self.cpu_decode!r}")
        if self.cpu_decode == "fused" and (self.device not in ("auto", "cpu") or self.compile):
            raise ValueError(f"cpu_decode 'fused' runs on the CPU without compile; got device {self.device!r}"
                             f"{', compile on' if self.compile else ''}")
        if self.cpu_fused_max_tokens < 0:
            raise ValueError(f"cpu_fused_max_tokens must be >= 0 (0 = decode-only steps alone), "
                             f"got {self.cpu_fused_max_tokens}")
        if self.num_blocks < 0 or self.max_model_len < 0:
            raise ValueError("num_blocks and max_model_len must be >= 0")
        if self.cuda_graph_max_batch_size < 1:
            raise ValueError(f"cuda_graph_max_batch_size must be >= 1, got {self.cuda_graph_max_batch_size}")
        if self.compile and (self.device not in ("auto", "cpu") or self.attention_backend not in ("auto", "cpu")):
            raise ValueError(f"compile runs on the CPU with the cpu attention backend; got device {self.device!r}, "
                             f"attention_backend {self.attention_backend!r}")


# --- the executor service's process configuration ------------------------------------------

DEFAULT_PORT = 50053

_ENGINE_DEFAULTS = ExecutorConfig(model="")


def _engine_field(name: str, help_text: str) -> Any:
    """A flag for one ExecutorConfig field, with ExecutorConfig's default (one source of truth)."""
    return field(
        default=getattr(_ENGINE_DEFAULTS, name),
        metadata={"help": help_text, "env": f"TOKENMILL_EXECUTOR_{name.upper()}"},
    )


@dataclass(slots=True)
class ExecutorServiceConfig(service_process_fields("executor", DEFAULT_PORT)):
    """tokenmill executor: runs the model over the step batches the scheduler plans."""

    model: str = model_field("model directory (config.json, *.safetensors)")
    dtype: str = _engine_field("dtype", "fp32, bf16, fp16, or auto (the checkpoint's; fp32 on CPU)")
    device: str = _engine_field("device", "cpu, cuda, cuda:N, or auto (cuda when available)")
    attention_backend: str = _engine_field("attention_backend", "torch, triton, cpu, or auto (triton on CUDA; cpu on a CPU, torch if its C++ kernel cannot be built)")
    block_size: int = _engine_field("block_size", "tokens per KV-cache block (a power of two)")
    kv_cache_bytes: int = _engine_field("kv_cache_bytes", "KV-cache budget on CPU, in bytes")
    kv_cache_dtype: str = _engine_field(
        "kv_cache_dtype", "auto (the model's dtype), int8 or fp8_e4m3 (quantized, fp16 scale per token per kv head)")
    gpu_memory_utilization: float = _engine_field(
        "gpu_memory_utilization", "on CUDA, the share of device memory for weights, activations and KV cache"
    )
    num_blocks: int = _engine_field("num_blocks", "exact number of KV blocks (0 = size from the memory budget)")
    max_model_len: int = _engine_field("max_model_len", "cap on context length (0 = the model's own limit)")
    seed: int = _engine_field("seed", "seed of the generator used for unseeded sampling")
    compile: bool = _engine_field("compile", "CPU: compile the decode step with torch.compile (slower start-up)")
    cpu_decode: str = _engine_field(
        "cpu_decode", "CPU decode steps: auto (small fp32 models in one C++ call, else eager), fused or eager")
    cpu_fused_max_tokens: int = _engine_field(
        "cpu_fused_max_tokens", "CPU, fused step in use: steps with prompt or draft tokens run fused up to this many "
                                "new tokens (0 = decode-only steps alone)")
    enforce_eager: bool = _engine_field("enforce_eager", "CUDA: run every step eagerly (no CUDA graphs for decode)")
    cuda_graph_max_batch_size: int = _engine_field(
        "cuda_graph_max_batch_size", "CUDA: largest decode batch captured as a graph; larger batches run eagerly")
    padded_decode_on_cpu: bool = _engine_field(
        "padded_decode_on_cpu", "testing aid: run CPU decode steps through the CUDA-graph path's padded buffers")
    skip_warmup: bool = field(default=False, metadata={
        "help": "report SERVING without first running the shapes it will serve (first requests pay compilation)",
        "env": "TOKENMILL_EXECUTOR_SKIP_WARMUP"})

    def validate(self) -> None:
        self.executor_config().validate()

    def executor_config(self) -> ExecutorConfig:
        """The engine's config: the fields ExecutorConfig has, taken from this one."""
        return ExecutorConfig(**{f.name: getattr(self, f.name) for f in fields(ExecutorConfig)})

"""Executor configuration: which model, where, in what precision, how much KV memory, and
the settings of each forward path.

ExecutorConfig is the engine's (ModelRunner, the in-process engine), declared once: the
executor service's ExecutorServiceConfig embeds it whole, so its fields are the service's
flags (``--block-size``) and TOKENMILL_EXECUTOR_* variables, with the help text given here.
Each forward path's settings are a plain dataclass of the path's module, composed here as a
field of their own named for the path (``config.fused_decode.cpu_decode``;
services/executor/forward_paths/), whose fields are flags of their own names too
(``--cpu-decode``). ``validate`` runs each path's checks of its own settings, then what one
path's flags require of the device or of another path, then the executor's own. A path is
handed only its settings (``path_settings``), so the paths never import this module.

Importable without torch: command lines are built from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.service_config import DEFAULT_MODEL_DIR, service_process_fields
from services.common.settings import embedded, setting
from services.executor.forward_paths.compiled_decode import CompiledDecodeSettings
from services.executor.forward_paths.decode_graphs import DecodeGraphSettings
from services.executor.forward_paths.fused_decode import FusedDecodeSettings
from services.runtime.model.attention.names import KV_CACHE_DTYPE_NAMES

ENV_PREFIX = "TOKENMILL_EXECUTOR_"
QUANT_ACTIVATIONS = ("auto", "int8", "none")
TENSOR_PARALLEL_ALL_REDUCE = ("auto", "shm", "gloo")
"""The same names as services/runtime/parallel/collectives.py ALL_REDUCE_BACKENDS (torch-free here)."""
TENSOR_PARALLEL_LM_HEADS = ("vocab", "replicated")
"""The same names as services/runtime/parallel/vocab_head.py LM_HEADS."""
TENSOR_PARALLEL_EXPERTS = ("all_to_all", "all_reduce", "replicated")
"""all_to_all and all_reduce: services/runtime/parallel/expert_parallel.py EXCHANGES."""


@dataclass(slots=True)
class ExecutorConfig:
    # Each forward path's settings, whole (forward_paths/; one field per path that has settings,
    # named for it, as FORWARD_PATHS lists them).
    compiled_decode: CompiledDecodeSettings = embedded(CompiledDecodeSettings, env_prefix=ENV_PREFIX)
    decode_graphs: DecodeGraphSettings = embedded(DecodeGraphSettings, env_prefix=ENV_PREFIX)
    fused_decode: FusedDecodeSettings = embedded(FusedDecodeSettings, env_prefix=ENV_PREFIX)

    model: str = setting(str(DEFAULT_MODEL_DIR), env="TOKENMILL_MODEL", path=True)
    """A Hugging Face-style model directory (config.json, *.safetensors, tokenizer.json)."""
    dtype: str = setting("auto")
    """fp32, bf16, fp16, or auto (the checkpoint's; fp32 on CPU).

    auto: the checkpoint's dtype (bf16 for an fp32 one) off the CPU, fp32 on it."""
    device: str = setting("auto")
    """cpu, cuda, cuda:N, or auto (cuda when available)."""
    attention_backend: str = setting("auto")
    """torch, triton, cpu, or auto (triton on CUDA; cpu on a CPU, torch if its C++ kernel cannot be built)."""
    block_size: int = setting(16)
    """Tokens per KV-cache block (a power of two)."""
    kv_cache_bytes: int = setting(2 * 1024**3)
    """KV-cache budget on CPU, in bytes.

    All layers, K and V."""
    kv_cache_dtype: str = setting("auto")
    """auto (the model's dtype), int8 or fp8_e4m3 (quantized, fp16 scale per token per kv head).

    The same byte budget then holds ~1.9x the tokens of a bf16 pool."""
    gpu_memory_utilization: float = setting(0.90)
    """On CUDA, the share of device memory for weights, activations and KV cache."""
    num_blocks: int = setting(0)
    """Exact number of KV blocks (0 = size from the memory budget).

    Tests use it."""
    max_model_len: int = setting(0)
    """Cap on context length (0 = the model's own limit)."""
    seed: int = setting(0)
    """Seed of the generator used for unseeded sampling."""
    tensor_parallel_size: int = setting(1)
    """Ranks (processes, one device each on CUDA) the model is split over: shared memory on a CPU, NCCL on CUDA.

    Rank 0 is this process and serves the Step stream; it starts the others. Each holds its
    share of the heads and MLP columns and of the KV pool (kv_cache_bytes is per rank). Steps
    run eagerly or, on a CPU, through the fused CPU step; the compiled step and the decode
    graphs take no all-reduce yet."""
    tensor_parallel_all_reduce: str = setting("auto")
    """tensor-parallel CPU ranks sum over: shm (a shared memory segment), gloo (loopback sockets), or auto (shm,
    gloo where the segment cannot be made; NCCL on CUDA).

    shm: a few microseconds an all-reduce where gloo's loopback round trips take hundreds
    (docs/benchmarks.md, "Tensor parallelism on a CPU"); gloo stays for measurement and as the
    fallback."""
    tensor_parallel_lm_head: str = setting("vocab")
    """tensor-parallel LM head: vocab (each rank its share of the vocabulary, gathered onto rank 0) or replicated
    (rank 0 alone runs the whole head).

    vocab: the head's weights read once over the ranks instead of all on rank 0, for a gather
    of the logits (docs/benchmarks.md, "Tensor parallelism on a CPU", measures both)."""
    tensor_parallel_experts: str = setting("all_reduce")
    """A mixture-of-experts model's experts under tensor parallelism: all_reduce (split over the ranks, each
    rank's experts over all tokens, the outputs summed), all_to_all (split, tokens sent to their experts'
    ranks and back) or replicated (every rank runs every expert).

    The split ones read 1/N of the expert bytes a rank per step. all_reduce is the default:
    the tokens are already whole on every rank, and on a quiet CPU it ran 1.4-1.8x one rank
    where the all-to-all's three exchanges a layer ran 0.5-0.8x (docs/benchmarks.md, "Expert
    parallelism on a CPU")."""
    quant_activations: str = setting("auto")
    """CPU, quantized weights: auto (exact fp32 activations for a model whose every weight type an exact kernel
    runs; int8 for every weight of a model with types only the int8 kernels keep, e.g. K-quants), none (exact
    everywhere: types with no exact kernel are dequantized to fp32 at load) or int8 (activations rounded to
    int8 per block, integer dot products: llama.cpp's arithmetic, faster, not exact).

    auto, the default, is faithful first: a model of q4_0/q4_1/q8_0 and tokenmill's own int4/int8
    weights takes fp32 activations (the dequantized model's numbers up to the order of sums, so a
    kept GGUF answers as its fp32 twin does). A model with types that have no exact kernel
    (K-quants, q5_0/q5_1, GGUF experts) takes int8 activations for those rather than a dequantized
    fp32 copy 4-8x their size, and then for all its weights, LM head included, as llama.cpp does:
    its int8 layers move the logits already, and an exact Q8_0 head was 77-85% of Gemma 3 270M
    Q4_K_M's step. auto is none on CUDA and on a tensor-parallel executor's ranks. none: fp32
    activations for every type (those without an exact kernel dequantized at load). int8: activations rounded to int8 per block of
    32 (K-quants too) and multiplied by integer dot products, llama.cpp's arithmetic,
    for every GGUF block type. int8 everywhere was the default until it was found to flip
    SmolLM2's greedy answer to make run's demo question into a loop; the exact path still decodes
    one stream faster than llama.cpp on the same file (speed and quality of both in
    docs/benchmarks.md, "The default served path is the exact one")."""

    lora: tuple[str, ...] = setting((), repeat=True)
    """A PEFT LoRA adapter to serve beside the base model, NAME=PATH (a directory with adapter_config.json and
    adapter_model.safetensors); repeat the flag for more. Requests choose one by NAME (GenerateRequest.adapter; the gateway's OpenAI ``model``). More
    can be loaded and unloaded while serving (the engine's LoadAdapter / UnloadAdapter)."""
    max_loras: int = setting(4)
    """LoRA adapters resident at once (the most one step may mix); others are read again from their directory
    when a request needs them (LRU).

    Each slot holds a max_lora_rank copy of every adapted projection, in fp32."""
    lora_dir: str = setting("", env="TOKENMILL_LORA_DIR", path=True)
    """The directory adapters loaded while serving (LoadAdapter) must lie in, symlinks and .. resolved first; a
    relative path is taken inside it. Empty = LoadAdapter is refused (FAILED_PRECONDITION); --lora at start needs
    none."""
    max_lora_file_bytes: int = setting(1 << 30)
    """Largest adapter_model.safetensors read (bytes); a larger file is refused before it is read."""
    max_lora_rank: int = setting(16)
    """Largest LoRA rank served; an adapter of a higher rank is refused.

    Smaller ranks are padded with zeros to it, so it sizes the slots and each low-rank product."""

    def path_settings(self) -> dict[str, object]:
        """Each forward path's settings by the path's name: all a path is handed of this config."""
        return {"compiled_decode": self.compiled_decode, "decode_graphs": self.decode_graphs,
                "fused_decode": self.fused_decode}

    def validate(self) -> None:
        self._validate_own()
        self.decode_graphs.validate()
        self.fused_decode.validate()
        self._validate_across_paths()

    def _validate_across_paths(self) -> None:
        if self.compiled_decode.compile and self.kv_cache_dtype != "auto":
            raise ValueError(f"compile runs the C++ decode ops over a plain KV pool; kv_cache_dtype "
                             f"{self.kv_cache_dtype!r} needs compile off")
        if self.compiled_decode.compile and (self.device not in ("auto", "cpu")
                                             or self.attention_backend not in ("auto", "cpu")):
            raise ValueError(f"compile runs on the CPU with the cpu attention backend; got device {self.device!r}, "
                             f"attention_backend {self.attention_backend!r}")
        compile_on = self.compiled_decode.compile
        if self.fused_decode.cpu_decode == "fused" and (self.device not in ("auto", "cpu") or compile_on):
            raise ValueError(f"cpu_decode 'fused' runs on the CPU without compile; got device {self.device!r}"
                             f"{', compile on' if compile_on else ''}")

    def _validate_own(self) -> None:
        if self.max_lora_file_bytes < 1:
            raise ValueError(f"max_lora_file_bytes must be >= 1, got {self.max_lora_file_bytes}")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras must be >= 0 and max_lora_rank >= 1, got {self.max_loras} and "
                             f"{self.max_lora_rank}")
        for entry in self.lora:
            name, sep, path = entry.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora entries must be NAME=PATH, got {entry[:200]!r}")
        if self.lora and self.max_loras == 0:
            raise ValueError(f"lora names {len(self.lora)} adapter(s) but max_loras is 0")
        if self.lora and self.tensor_parallel_size > 1:
            raise ValueError(f"lora adapters run on one rank; tensor_parallel_size is {self.tensor_parallel_size}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_NAMES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.quant_activations not in QUANT_ACTIVATIONS:
            raise ValueError(f"quant_activations must be one of {', '.join(QUANT_ACTIVATIONS)}, "
                             f"got {self.quant_activations!r}")
        if self.quant_activations == "int8" and self.device not in ("auto", "cpu"):
            raise ValueError(f"quant_activations 'int8' runs on the CPU; got device {self.device!r}")
        if self.quant_activations == "int8" and self.tensor_parallel_size > 1:
            raise ValueError(f"quant_activations 'int8' runs on one rank; got tensor_parallel_size "
                             f"{self.tensor_parallel_size} (its ranks keep fp32 activations)")
        if self.num_blocks < 0 or self.max_model_len < 0:
            raise ValueError("num_blocks and max_model_len must be >= 0")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_lm_head not in TENSOR_PARALLEL_LM_HEADS:
            raise ValueError(f"tensor_parallel_lm_head must be one of {', '.join(TENSOR_PARALLEL_LM_HEADS)}, "
                             f"got {self.tensor_parallel_lm_head!r}")
        if self.tensor_parallel_experts not in TENSOR_PARALLEL_EXPERTS:
            raise ValueError(f"tensor_parallel_experts must be one of {', '.join(TENSOR_PARALLEL_EXPERTS)}, "
                             f"got {self.tensor_parallel_experts!r}")
        if self.tensor_parallel_all_reduce not in TENSOR_PARALLEL_ALL_REDUCE:
            raise ValueError(f"tensor_parallel_all_reduce must be one of {', '.join(TENSOR_PARALLEL_ALL_REDUCE)}, "
                             f"got {self.tensor_parallel_all_reduce!r}")


# --- the executor service's process configuration ------------------------------------------

DEFAULT_PORT = 50053


EXECUTOR_ROLES = ("mixed", "prefill", "decode")


MIN_STEP_IDLE_TIMEOUT_S = 30.0
"""Three of the scheduler's idle heartbeats (links/step_stream.py): a live session never times out."""


@dataclass(slots=True)
class ExecutorServiceConfig(service_process_fields("executor", DEFAULT_PORT, backend_tls=True,
                                                 internal_secret="require")):
    """tokenmill executor: runs the model over the step batches the scheduler plans."""

    executor: ExecutorConfig = embedded(ExecutorConfig, env_prefix=ENV_PREFIX)
    role: str = setting("mixed", env="TOKENMILL_EXECUTOR_ROLE")
    """What the scheduler runs here: mixed (prompts and decoding), prefill (prompts, whose KV then moves to a decode
    executor) or decode (requests whose prompt a prefill executor computed; it pulls their KV from there, over the
    --backend-tls-* credentials when set)."""
    step_idle_timeout_s: float = setting(60.0, env="TOKENMILL_EXECUTOR_STEP_IDLE_TIMEOUT_S")
    """End a Step session that sends nothing for this long, so a silent client cannot hold the only session (the
    scheduler sends an empty step every 10 s while idle); 0 = never."""
    tls_peer_clients: tuple[str, ...] = setting((), env="TOKENMILL_EXECUTOR_TLS_PEER_CLIENTS")
    """With --tls-allowed-clients: client certificate identities (comma-separated) that may also call ReadKVBlocks,
    and nothing else here: the other executors, which pull a prompt's KV from this one."""
    kv_peers: tuple[str, ...] = setting((), env="TOKENMILL_EXECUTOR_KV_PEERS")
    """Executors (host:port, comma-separated, as the scheduler names them in --executor-addresses) this one may pull a
    prompt's KV blocks from; PullKVBlocks naming any other is refused before anything connects (empty = none: a
    decode executor then recomputes every prompt)."""
    skip_warmup: bool = setting(False, env="TOKENMILL_EXECUTOR_SKIP_WARMUP")
    """Report SERVING without first running the shapes it will serve (first requests pay compilation)."""

    def validate(self) -> None:
        self.executor.validate()
        if self.role not in EXECUTOR_ROLES:
            raise ValueError(f"role must be one of {', '.join(EXECUTOR_ROLES)}, got {self.role!r}")
        if not self.step_idle_timeout_s >= 0:
            raise ValueError(f"step_idle_timeout_s must be >= 0 (0 = never), got {self.step_idle_timeout_s}")
        if 0 < self.step_idle_timeout_s < MIN_STEP_IDLE_TIMEOUT_S:
            raise ValueError(f"step_idle_timeout_s must be 0 or >= {MIN_STEP_IDLE_TIMEOUT_S:g} (three of the "
                             f"scheduler's idle heartbeats), got {self.step_idle_timeout_s}")
        for peer in self.kv_peers:
            if not 0 < len(peer) <= 256 or not peer.isprintable() or " " in peer:
                raise ValueError(f"kv_peers entries must be host:port addresses, got {peer[:100]!r}")
        if self.tls_peer_clients and not self.tls_allowed_clients:
            raise ValueError("tls_peer_clients widens --tls-allowed-clients for ReadKVBlocks: set that too "
                             "(without it every certificate the CA signed may call everything)")
        if self.role != "mixed" and self.executor.tensor_parallel_size > 1:
            # Moving KV blocks reads one pool; a tensor-parallel executor's is spread over its ranks.
            raise ValueError(f"role {self.role!r} moves KV blocks between executors, which a tensor-parallel "
                             f"one cannot yet; tensor_parallel_size {self.executor.tensor_parallel_size} needs "
                             "role 'mixed'")

"""Pieces shared by the kernel launchers: input checks for paged attention, the dot helper.

Imports only torch and triton (see the package docstring).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.runtime.kernels.kv_quant import QMAX, SCALE_DTYPE, ScaledCache

LOG2E = 1.44269504  # log2(e) = 1/ln(2): softmax runs in base 2 so kernels can use exp2

# Triton compiles one variant per specialization of a launch: every tl.constexpr value, and for
# plain int arguments whether they equal 1 or divide by 16, and for pointers whether they are
# 16-byte aligned. Arguments that follow a step's lengths (a block table's row stride is its
# width, the partition buffers' strides follow the partition count) and the step's metadata
# pointers (views at offsets that follow the batch size into the model runner's two uploads)
# are not specialized (``NOT_SPECIALIZED``, given to every kernel that takes them), so a new
# prompt length or batch size never compiles a kernel while serving. The constexprs that do
# depend on lengths are bucketed (powers of two, a bool), and the executor's warm-up compiles
# them before it reports SERVING.
STEP_LENGTH_INTS = ("stride_bt", "partition_tokens", "stride_pob", "stride_poh", "stride_pmb", "stride_pmh")
STEP_METADATA_POINTERS = ("block_tables_ptr", "context_lens_ptr", "query_start_loc_ptr", "slot_mapping_ptr",
                          "positions_ptr")
NOT_SPECIALIZED = {"do_not_specialize": STEP_LENGTH_INTS, "do_not_specialize_on_alignment": STEP_METADATA_POINTERS}
"""``@triton.jit(**NOT_SPECIALIZED)``: names a kernel does not have are ignored."""


def check_devices(anchor: str, device: torch.device, **tensors: torch.Tensor) -> None:
    """ValueError naming the first of ``tensors`` not on ``device`` (the ``anchor`` argument's)."""
    for name, tensor in tensors.items():
        if tensor.device != device:
            raise ValueError(f"{name} must be on {device} with {anchor}, got {tensor.device}")


def check_unit_last_stride(**tensors: torch.Tensor) -> None:
    """ValueError naming the first of ``tensors`` whose last dimension is not contiguous (a kernel's row loads)."""
    for name, tensor in tensors.items():
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit last stride, got strides {tensor.stride()}")

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_interpreted(kernel: object) -> bool:
    """True when ``kernel`` was decorated under TRITON_INTERPRET=1 (it runs on the CPU in numpy)."""
    return not isinstance(kernel, triton.runtime.JITFunction)


def dot_flags(dtype: torch.dtype, kernel: object) -> dict[str, object]:
    """Constexprs for ``dot``: fp32 inputs get true fp32 products (tf32 would cost ~1e-3
    relative error). The interpreter multiplies bfloat16 as raw uint16 bits (triton 3.9), so
    there bf16 operands are widened to fp32 first: exact products, fp32 sums, as on the GPU."""
    upcast = dtype == torch.bfloat16 and is_interpreted(kernel)
    precision = "ieee" if dtype == torch.float32 or upcast else "tf32"
    return {"DOT_PRECISION": precision, "DOT_UPCAST": upcast}


@triton.jit
def dot(a, b, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """tl.dot with an fp32 result; see ``dot_flags``."""
    if DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=DOT_PRECISION)
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


def split_pool(cache: "torch.Tensor | ScaledCache") -> tuple[torch.Tensor, torch.Tensor | None]:
    """(values, scales) of a quantized pool after checking the pair; (cache, None) for a plain one."""
    if not isinstance(cache, ScaledCache):
        return cache, None
    data, scale = cache.data, cache.scale
    if data.dtype not in QMAX:
        raise ValueError(f"a quantized pool holds int8 or float8_e4m3fn values, got {data.dtype}")
    if (scale.dtype != SCALE_DTYPE or scale.shape != data.shape[:-1] or not scale.is_contiguous()
            or scale.device != data.device):
        raise ValueError(f"a quantized pool's scales must be contiguous {SCALE_DTYPE} {tuple(data.shape[:-1])} on "
                         f"{data.device}, got {scale.dtype} {tuple(scale.shape)} on {scale.device}")
    return data, scale


def kv_quant_args(k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """The launch's pools and scales: (k values, v values, k scales, v scales, quantized). For a
    plain pool the scale pointers are the values themselves, never read (KV_QUANT=False)."""
    k_data, k_scale = split_pool(k_cache)
    v_data, v_scale = split_pool(v_cache)
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_cache and v_cache must both be quantized or both plain")
    if k_scale is None:
        return k_data, v_data, k_data, v_data, False
    return k_data, v_data, k_scale, v_scale, True


def check_paged_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_seqs: int,
    max_context_len: int,
) -> None:
    """q [T, H, D], caches [NB, BS, KH, D] (or kv_quant.ScaledCache), block_tables [B, W] int32,
    context_lens [B] int32."""
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q must be [tokens, heads, head_dim] with unit last stride, got "
                         f"{tuple(q.shape)} strides {q.stride()}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q dtype must be float16, bfloat16 or float32, got {q.dtype}")
    for name, pool in (("k_cache", k_cache), ("v_cache", v_cache)):
        cache, scale = split_pool(pool)
        if cache.dim() != 4 or cache.stride(-1) != 1:
            raise ValueError(f"{name} must be [num_blocks, block_size, kv_heads, head_dim] with unit last "
                             f"stride, got {tuple(cache.shape)} strides {cache.stride()}")
        if (scale is None and cache.dtype != q.dtype) or cache.device != q.device:
            raise ValueError(f"{name} must match q ({q.dtype} on {q.device}), got {cache.dtype} on {cache.device}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} != q head_dim {head_dim}")
    if head_dim > 256:
        raise ValueError(f"head_dim must be <= 256, got {head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be int32 [{num_seqs}, max_blocks], got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")
    if block_tables.stride(1) != 1:
        raise ValueError(f"block_tables rows must be contiguous, got strides {block_tables.stride()}")
    if (context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (num_seqs,)
            or not context_lens.is_contiguous()):
        raise ValueError(f"context_lens must be contiguous int32 [{num_seqs}], got {context_lens.dtype} "
                         f"{tuple(context_lens.shape)}")
    check_devices("q", q.device, block_tables=block_tables, context_lens=context_lens)
    capacity = block_tables.shape[1] * k_cache.shape[1]
    if not 1 <= max_context_len <= capacity:
        raise ValueError(f"max_context_len must be in [1, {capacity}] (block table width x block size), "
                         f"got {max_context_len}")


def check_out(out: torch.Tensor, like: torch.Tensor) -> None:
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(like.shape)} {like.dtype} on {like.device} with unit last stride, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device} strides {out.stride()}")


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple

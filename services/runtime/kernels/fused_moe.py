"""Mixture-of-experts FFN over routed tokens: each token's top-k experts, weighted and summed.

  out[t] = sum_j topk_weights[t, j] * down_e(act(gate_e x[t]) * up_e x[t]),  e = topk_ids[t, j]

Shapes (the layout of Hugging Face's ``MixtralExperts``): x [T, H], w_gate_up [E, 2I, H] (the
I gate rows first, then the I up rows), w_down [E, H, I], topk_weights [T, k] float,
topk_ids [T, k] int64. A negative id is a slot with no expert here (an expert another rank
holds under expert parallelism): it contributes nothing.

``fused_moe_reference`` is the PyTorch reference: the (token, slot) pairs are sorted by expert,
so each expert's weights are read once for all its tokens, and rounded where Hugging Face's
expert loop rounds (the expert's output times its weight cast to x's dtype, then summed per
token in x's dtype in ascending expert order).

``fused_moe_triton`` is the GPU kernel (vLLM's and SGLang's fused MoE): the (token, slot)
pairs are sorted by expert and each expert's run padded to the row tile (``align_pairs``), so a
row tile holds one expert's pairs and one launch multiplies every expert's tiles (a grouped
GEMM). Three launches a layer, none depending on how many pairs an expert got (no host sync):
  1. gate_up: [pairs, H] x w_gate_up[e]^T, activation fused -> act(gate) * up   [pairs, I]
  2. down:    [pairs, I] x w_down[e]^T times the pair's routing weight          [pairs, H]
  3. sum:     each token's k rows added in ascending expert order              [T, H]
The k contributions are summed by a third small kernel rather than by atomic adds in the down
kernel: atomics would add them in whatever order the programs finish, so a token's output would
depend on the rest of the batch and on timing; here it is a fixed order (the reference's).
It rounds where the reference does (gate and up to x's dtype, the activation to x's dtype, the
product, the down projection, the weighted contribution, each partial sum).

``fused_moe`` picks the kernel for x's device: Triton on CUDA, the reference elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from services.runtime.kernels._common import (FLOAT_DTYPES, check_devices, check_unit_last_stride, dot, dot_flags,
                                              round_up)

ACTIVATIONS = ("silu", "gelu_tanh")


def _check_inputs(x, w_gate_up, w_down, topk_weights, topk_ids, activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if w_gate_up.dim() != 3 or w_gate_up.shape[2] != hidden or w_gate_up.shape[1] % 2:
        raise ValueError(f"w_gate_up must be [experts, 2 * intermediate, {hidden}], got {tuple(w_gate_up.shape)}")
    num_experts, intermediate = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    if tuple(w_down.shape) != (num_experts, hidden, intermediate):
        raise ValueError(f"w_down must be [{num_experts}, {hidden}, {intermediate}], got {tuple(w_down.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_ids.dtype != torch.int64:
        raise ValueError(f"topk_ids must be int64 [{num_tokens}, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be float {tuple(topk_ids.shape)}, got {topk_weights.dtype} "
                         f"{tuple(topk_weights.shape)}")
    check_devices("x", x.device, w_gate_up=w_gate_up, w_down=w_down, topk_weights=topk_weights, topk_ids=topk_ids)


def _activate(gate: torch.Tensor, activation: str) -> torch.Tensor:
    return F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")


def fused_moe_reference(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """[T, H]: the routed experts' outputs, weighted and summed per token (see the module docstring)."""
    _check_inputs(x, w_gate_up, w_down, topk_weights, topk_ids, activation)
    num_experts, top_k = w_gate_up.shape[0], topk_ids.shape[1]
    out = torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1)
    # Stable: a token's slots stay in slot order within one expert, and experts come in
    # ascending order, so each token's sum runs in the order Hugging Face's loop adds.
    order = torch.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids[order]
    counts = torch.bincount(sorted_ids[sorted_ids >= 0], minlength=num_experts).tolist()
    start = int((sorted_ids < 0).sum())  # skipped slots sort first
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]  # flat (token, slot) indices routed to this expert
        start += count
        tokens = pairs // top_k
        gate, up = F.linear(x[tokens], w_gate_up[expert]).chunk(2, dim=-1)
        expert_out = F.linear(_activate(gate, activation) * up, w_down[expert])
        weighted = (expert_out * topk_weights.reshape(-1)[pairs, None]).to(x.dtype)
        out.index_add_(0, tokens, weighted)
    return out


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Sort the (token, slot) pairs by expert, each expert's run padded to a multiple of block_m.

    topk_ids [T, k] -> (sorted_pairs [capacity] int32: flat pair index t * k + j, padding holds
    T * k; block_expert [capacity // block_m] int32: the expert of each row tile;
    num_padded [1] int32: the tiles in use times block_m). Pairs with a negative id are left
    out. ``capacity`` bounds num_padded from the shapes alone (each expert that has a pair pads
    at most block_m - 1 rows), so nothing here waits for the device.
    """
    flat = topk_ids.reshape(-1)
    num_pairs, device = flat.numel(), flat.device
    bucket = torch.where(flat < 0, num_experts, flat)  # skipped pairs: one more bucket, last
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    start = counts.cumsum(0) - counts  # where each bucket begins in the stably sorted pairs
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    capacity = round_up(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    in_expert = sorted_bucket < num_experts
    expert = sorted_bucket.clamp(max=num_experts - 1)
    dest = padded_end[expert] - padded[expert] + torch.arange(num_pairs, device=device) - start[sorted_bucket]
    dest = torch.where(in_expert, dest, capacity)  # skipped pairs land in a slot cut off below
    sorted_pairs = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    tile_starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, tile_starts, right=True).to(torch.int32)
    num_padded = padded_end[-1:].to(torch.int32)
    return sorted_pairs[:capacity], block_expert, num_padded


@triton.jit
def _activate_tile(gate, ACTIVATION: tl.constexpr):
    if ACTIVATION == "silu":
        return gate / (1.0 + tl.exp(-gate))
    else:  # gelu, tanh approximation; tanh(u) = 1 - 2 / (exp(2u) + 1) saturates cleanly at +-inf
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2/pi)
        return 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))


@triton.jit(do_not_specialize=("num_pairs",))
def _moe_gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr,
                        num_pairs, hidden, intermediate, stride_xt, stride_we, stride_wn, stride_ot,
                        TOP_K: tl.constexpr, ACTIVATION: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        DOT_UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # One tile: BM pairs of one expert x BN columns of the gate half and the same columns of the up half.
    tl.static_assert(BK >= 16 and BM >= 16 and BN >= 16, "tl.dot needs tiles of at least 16")
    tile = tl.program_id(0)
    if tile * BM >= tl.load(num_padded_ptr):
        return  # past the last expert's tiles (the grid is sized for the worst routing)
    pairs = tl.load(sorted_pairs_ptr + tile * BM + tl.arange(0, BM)).to(tl.int64)
    row_ok = pairs < num_pairs
    tokens = pairs // TOP_K
    expert = tl.load(block_expert_ptr + tile).to(tl.int64)
    cols = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    col_ok = cols < intermediate
    ks = tl.arange(0, BK)
    # W^T tiles [BK, BN]: w[e, n, k] at n * stride_wn + k (rows contiguous, checked by the launcher)
    gate_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None]
    up_ptrs = gate_ptrs + intermediate * stride_wn
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + ks[None, :]
    gate = tl.zeros((BM, BN), dtype=tl.float32)
    up = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, hidden, BK):
        k_ok = k0 + ks < hidden
        a = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        gate += dot(a, tl.load(gate_ptrs + k0, mask=w_mask, other=0.0), DOT_PRECISION, DOT_UPCAST)
        up += dot(a, tl.load(up_ptrs + k0, mask=w_mask, other=0.0), DOT_PRECISION, DOT_UPCAST)
    dtype = out_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    activated = _activate_tile(gate, ACTIVATION).to(dtype).to(tl.float32)
    tl.store(out_ptr + pairs[:, None] * stride_ot + cols[None, :], (activated * up).to(dtype),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=("num_pairs",))
def _moe_down_kernel(a_ptr, w_ptr, weights_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr,
                     num_pairs, hidden, intermediate, stride_at, stride_we, stride_wn, stride_ot,
                     DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # One tile: BM pairs of one expert x BN hidden columns, each row times its pair's routing weight.
    tl.static_assert(BK >= 16 and BM >= 16 and BN >= 16, "tl.dot needs tiles of at least 16")
    tile = tl.program_id(0)
    if tile * BM >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_pairs_ptr + tile * BM + tl.arange(0, BM)).to(tl.int64)
    row_ok = pairs < num_pairs
    expert = tl.load(block_expert_ptr + tile).to(tl.int64)
    cols = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    col_ok = cols < hidden
    ks = tl.arange(0, BK)
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None]
    a_ptrs = a_ptr + pairs[:, None] * stride_at + ks[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, intermediate, BK):
        k_ok = k0 + ks < intermediate
        a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += dot(a, tl.load(w_ptrs + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0),
                   DOT_PRECISION, DOT_UPCAST)
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
    weighted = acc.to(dtype).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_ot + cols[None, :], weighted.to(dtype),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_sum_kernel(contrib_ptr, slot_order_ptr, ids_ptr, out_ptr, hidden, stride_ct, stride_ot,
                    TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    # out[t] = the token's k weighted rows, added in ascending expert order, rounded after each add.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < hidden
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = tl.load(slot_order_ptr + token * TOP_K + j)
        row = tl.load(contrib_ptr + (token * TOP_K + slot) * stride_ct + cols, mask=col_ok, other=0.0)
        # a skipped slot's row was never written: select, not multiply, so its garbage (NaN) drops
        routed = tl.load(ids_ptr + token * TOP_K + slot) >= 0
        acc = (acc + tl.where(routed, row.to(tl.float32), 0.0)).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + cols, acc.to(dtype), mask=col_ok)


def _tiles(num_pairs: int, num_experts: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BM, BN, BK). Decode routes a few pairs to each expert: a 16-row tile wastes less on
    padding; 64 rows once experts average more. The choice is a bool of the batch, so serving
    compiles two variants at most."""
    block_m = 16 if num_pairs <= 8 * num_experts else 64
    return block_m, 64, 32 if dtype == torch.float32 else 64


def fused_moe_triton(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    tiles: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """``fused_moe_reference``'s result from the Triton kernels; ``tiles`` = (BM, BN, BK) overrides
    the heuristic (tests)."""
    _check_inputs(x, w_gate_up, w_down, topk_weights, topk_ids, activation)
    if x.dtype not in FLOAT_DTYPES or w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(f"x, w_gate_up and w_down must share one of float16, bfloat16, float32, got "
                         f"{x.dtype}, {w_gate_up.dtype}, {w_down.dtype}")
    check_unit_last_stride(x=x, w_gate_up=w_gate_up, w_down=w_down)
    num_tokens, hidden = x.shape
    num_experts, intermediate = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    out = torch.empty_like(x)
    if num_pairs == 0:
        return out
    block_m, block_n, block_k = tiles or _tiles(num_pairs, num_experts, x.dtype)
    sorted_pairs, block_expert, num_padded = align_pairs(topk_ids, num_experts, block_m)
    flags = dot_flags(x.dtype, _moe_gate_up_kernel)
    activated = torch.empty((num_pairs, intermediate), dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(block_expert.numel(), triton.cdiv(intermediate, block_n))](
        x, w_gate_up, activated, sorted_pairs, block_expert, num_padded,
        num_pairs, hidden, intermediate, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), activated.stride(0),
        TOP_K=top_k, ACTIVATION=activation, **flags, BM=block_m, BN=block_n, BK=block_k, num_warps=4,
    )
    contrib = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    _moe_down_kernel[(block_expert.numel(), triton.cdiv(hidden, block_n))](
        activated, w_down, weights, contrib, sorted_pairs, block_expert, num_padded,
        num_pairs, hidden, intermediate, activated.stride(0), w_down.stride(0), w_down.stride(1), contrib.stride(0),
        **flags, BM=block_m, BN=block_n, BK=block_k, num_warps=4,
    )
    ids = topk_ids.contiguous()
    slot_order = torch.argsort(ids, dim=1, stable=True).contiguous()
    sum_block = min(1024, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, sum_block))](
        contrib, slot_order, ids, out, hidden, contrib.stride(0), out.stride(0), TOP_K=top_k, BLOCK=sum_block,
    )
    return out


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """The layer's one entry point: [T, H] as ``fused_moe_reference`` defines it, computed by the
    best kernel for x's device."""
    if x.is_cuda:
        return fused_moe_triton(x, w_gate_up, w_down, topk_weights, topk_ids, activation)
    return fused_moe_reference(x, w_gate_up, w_down, topk_weights, topk_ids, activation)

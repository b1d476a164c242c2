"""The model's pointwise ops, chosen with the attention backend.

``TorchOps`` is plain PyTorch (CPU, and the reference on GPU). ``TritonOps`` runs the fused
Triton kernels of services/runtime/kernels: residual add + RMSNorm in one pass, rotary in
place on the q/k views of the fused projection, SiLU-and-mul, the fused mixture-of-experts
(``moe_experts``: a sparse layer's routed experts, kernels/fused_moe.py). Both compute the same math
with the same rounding points as Hugging Face's Llama.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.runtime.model.layers import RotaryEmbedding, rms_norm


class TorchOps:
    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        """(rms_norm(residual + x), residual + x)"""
        hidden = residual + x
        return rms_norm(hidden, weight, eps), hidden

    @staticmethod
    def rotary_tables(positions: torch.Tensor, rotary: RotaryEmbedding, dtype: torch.dtype):
        """What ``rotary`` needs for this step's positions, gathered once for all layers."""
        return rotary.tables(positions, dtype)

    @staticmethod
    def rotary(qk: torch.Tensor, num_heads: int, tables) -> tuple[torch.Tensor, torch.Tensor]:
        # qk: [T, H + KH, D], the q|k columns of the fused projection -> q [T, H, D], k [T, KH, D]
        out = RotaryEmbedding.rotate(qk, tables)  # q and k in one pass
        return out[:, :num_heads], out[:, num_heads:]

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        # x: [T, 2F] = gate | up -> [T, F]
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


    @staticmethod
    def moe_experts(x, w_gate_up, w_down, topk_weights, topk_ids, activation: str = "silu") -> torch.Tensor:
        # x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], routing [T, k] -> [T, H]
        from services.runtime.kernels.fused_moe import fused_moe_reference  # here: its module imports triton

        return fused_moe_reference(x, w_gate_up, w_down, topk_weights, topk_ids, activation)


class TritonOps:
    name = "triton"

    def __init__(self) -> None:
        # Imported here: triton is only needed when this backend is chosen.
        from services.runtime.kernels.rms_norm import rms_norm as fused_rms_norm
        from services.runtime.kernels.rotary import apply_rotary
        from services.runtime.kernels.silu_and_mul import silu_and_mul

        self._rms_norm = fused_rms_norm
        self._rotary = apply_rotary
        self._silu_and_mul = silu_and_mul

    def rms_norm(self, x, weight, eps):
        return self._rms_norm(x, weight, eps)[0]

    def add_rms_norm(self, x, residual, weight, eps):
        return self._rms_norm(x, weight, eps, residual=residual)

    @staticmethod
    def rotary_tables(positions, rotary: RotaryEmbedding, dtype):
        return positions, rotary  # the kernel reads the tables at the positions itself

    def rotary(self, qk, num_heads, tables):
        positions, rotary = tables
        return self._rotary(qk[:, :num_heads], qk[:, num_heads:], positions, rotary.cos, rotary.sin)

    def silu_and_mul(self, x):
        return self._silu_and_mul(x)

    @staticmethod
    def moe_experts(x, w_gate_up, w_down, topk_weights, topk_ids, activation: str = "silu"):
        from services.runtime.kernels.fused_moe import fused_moe_triton

        return fused_moe_triton(x, w_gate_up, w_down, topk_weights, topk_ids, activation)


def get_model_ops(backend_name: str):
    return TritonOps() if backend_name == "triton" else TorchOps()

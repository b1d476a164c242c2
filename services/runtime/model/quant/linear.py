"""QuantLinear: y = x W^T with W held quantized (formats.py), one path per device.

CPU: the C++ kernels in services/runtime/kernels/cpu/quant_matmul.cpp read the stored values and
per-group scales and zeros, with fp32 activations and outputs: the dequantized model's numbers up
to the order of the fp32 sums. Below ``PANEL_MIN_ROWS`` input rows (decode of a few sequences)
``quant_matmul`` multiplies straight from the packed values, 1-8 rows per pass in registers:
the product is memory-bound and reads 0.6-1.1 bytes a weight instead of 4. From
``PANEL_MIN_ROWS`` on it is compute-bound, and unpacking every block again for each 8 rows costs
more than the bytes save: ``quant_matmul_panels`` dequantizes ``panel_columns(K)`` output
columns at a time into an fp32 buffer that stays in L2 (``quant_dequantize``'s numbers, bitwise
the reference dequantization) and multiplies all rows by it with BLAS, so each weight is
unpacked once per call and the fp32 weight never goes to memory.
Without a C++ compiler, or for a weight whose input size is not a multiple of 32, the weight is
dequantized once at load to fp32 and runs through the plain Linear (exact, as slow as fp32).

Measured on one core of the 2-core benchmark machine (shared: medians of 7 interleaved rounds),
a 3072x576 q4_1 weight, 20 distinct copies so the weights stream from memory as a model's do,
microseconds per product (two runs, the second under more load):

    rows                                   1          8         16         32         64
    the kernel (quant_matmul)        153 / 299  628 / 751  1157/1785  2541/2756  5179/5969
    panels (quant_matmul_panels)     410 / 562  813 /1090   979/1400  1543/1835  2745/3060
    whole weight dequantized + BLAS  315 / 545  829 /1134  1020/1477  1605/1733  3003/4392
    fp32, oneDNN prepacked           621 / 907  706 / 850   812/ 985  1301/1355  2520/2582

(panels of 112 columns in the first run, 224 in the second.) So the kernel below 16 rows, panels
from 16. At 32 rows fp32 runs at this core's FMA peak (113 MFLOP in 1.3 ms: ~85 GFLOP/s, one
512-bit FMA a cycle): an exact fp32 product cannot be faster, and panels stay 1.1-1.35x above it
(unpacking, and BLAS packing each panel again, which the prepacked fp32 weight skips). Other
SmolLM2 shapes at 32 rows, panels / fp32: 960x576 1.10-1.14, 576x576 1.08-1.13, 576x1536
1.08-1.14, the 49152x576 q8_0 head 1.34-1.47 (the kernel: 1.6-2.0x at all of them).

(q4_0, q8_0 and int8 alike: the kernel 155-195 us at one row.) PyTorch's own packed operators
were measured first and are not used: ``_weight_int4pack_mm_for_cpu`` and ``_weight_int8pack_mm``
are vectorized only for bf16 activations (fp32 ones 10-100x slower) and return bf16. A bf16
logit is too coarse to sample from: on SmolLM2's "What is the capital of France?" the two best
first tokens are 0.08 apart at a logit of 25, where bf16's step is 0.125; they tied and the
greedy answer changed.

With ``activations="int8"`` (the executor's ``--quant-activations``) a GGUF block weight
(q4_0, q4_1, q8_0 in blocks of 32) runs llama.cpp's arithmetic instead: each input row is
rounded to int8 per block of 32 and multiplied by integer dot products
(services/runtime/kernels/cpu/quant_dot.cpp; reference and rule in kernels/quant_act.py). The
weight is repacked once at load into the kernel's tiles of 16 outputs (the same bytes per block
as the file), the stored parts dropped. The result is no longer the dequantized model's: how far
it moves is measured in docs/benchmarks.md. int8 (per channel) weights and other group sizes
keep the exact path.

GGUF's larger blocks (q4_k, q5_k, q6_k, q5_0, q5_1; quant/gguf_blocks.py) run with int8
activations the same way, per block of 32 values (not llama.cpp's 256 for K-quants: measured in
kernels/kquant_act.py) (services/runtime/kernels/cpu/kquant_dot.cpp; rule and reference in kernels/kquant_act.py), the
weight repacked once at load into tiles of 16 outputs within 3% of the file's bytes. With
``activations="none"`` they are dequantized once at load to fp32 (the exact path).

CUDA: the Triton dequantize-and-multiply kernel (kernels/quant_matmul.py) reads the stored
parts as they are, in the activations' dtype; GGUF's whole blocks go through its sibling
kernels/kquant_matmul.py, which decodes them where they lie.
"""

from __future__ import annotations

import functools

import structlog
import torch
from torch import nn

from services.runtime.kernels.kquant_act import KQUANT_FORMAT_CODES, pack_tiles
from services.runtime.model.linear import Linear
from services.runtime.model.quant.formats import QuantizedWeight, bits, cat_rows, dequantize
from services.runtime.model.quant.gguf_blocks import BLOCK_FORMATS

ACTIVATIONS = ("none", "int8", "auto")
"""How a CPU quantized linear takes its input: exact fp32 (none) or rounded to int8 per block of 32."""
INT8_FORMAT_CODES = {"q4_0": 0, "q4_1": 1, "q8_0": 2}
"""The formats of the int8-activation kernels (quant_dot.cpp's QuantFormat)."""

PANEL_MIN_ROWS = 16
"""From this many input rows the CPU path multiplies by dequantized panels (module docstring)."""

PANEL_BYTES = 512 * 1024
"""fp32 bytes of one dequantized panel: half of this machine's 1 MiB L2 per core, so the panel
stays there while BLAS packs it and every input row passes over it. Measured at 32 rows: 224
columns of K=576 1-7% faster than 112 (fewer BLAS calls), 256 columns of K=1536 (1.5 MiB) 15%
slower than 80-112."""


def panel_columns(in_features: int) -> int:
    """Output columns per panel: ``PANEL_BYTES`` of fp32 rows, a multiple of 16, 16 to 256."""
    return max(16, min(256, PANEL_BYTES // (4 * in_features) // 16 * 16))


_log = structlog.get_logger("tokenmill.model")


def model_activations(requested: str, modules) -> str:
    """``requested`` (``ACTIVATIONS``) for one model whose quantized linears and experts are
    ``modules``: ``auto`` becomes ``int8`` for all of them where any takes int8 activations under
    auto (``int8_under_auto``), so a model runs one arithmetic, llama.cpp's where it already runs
    it at some weights. Mixing bought no faithfulness (the int8 layers move the logits already)
    and cost most of the step: Gemma 3 270M Q4_K_M's tied Q8_0 head (262,144 x 640) on the exact
    kernel took 77% of a one-row fused step and 85% of a 32-row one (docs/benchmarks.md). A model
    every weight of which has an exact kernel keeps ``auto`` (exact: SmolLM2's Q4_1)."""
    if requested == "auto" and any(m.int8_under_auto() for m in modules):
        return "int8"
    return requested


def cpu_kernel_fits(w: QuantizedWeight) -> bool:
    return w.fmt not in BLOCK_FORMATS and w.in_features % 32 == 0 and (w.fmt == "int8" or w.group_size % 32 == 0)


def int8_kernel_fits(w: QuantizedWeight) -> bool:
    return w.fmt in INT8_FORMAT_CODES and w.group_size == 32 and w.in_features % 32 == 0


def cpu_kernel_operands(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(scales [N, G] fp32, zeros [N, G] fp32 or empty, group) for the C++ kernel: w = d * q + z."""
    d = w.scales.float().reshape(w.out_features, -1).contiguous()
    if w.fmt == "q4_1":
        zeros = w.mins.float().contiguous()
    elif w.fmt == "q4_0":
        zeros = (-8 * d).contiguous()  # d (q - 8) = d q - 8 d, exact in fp32 for fp16 d
    else:
        zeros = torch.empty(0)
    return d, zeros, w.in_features if w.fmt == "int8" else w.group_size


class QuantLinear(nn.Module):
    """A projection whose weight stays quantized; ``prepare()`` (after moving) readies the device's path."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.quantized = weight
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.path = "unprepared"
        self._scales: torch.Tensor | None = None
        self._zeros: torch.Tensor | None = None
        self._group = 0
        self._fallback: Linear | None = None
        self.packed: torch.Tensor | None = None
        """The weight repacked for the int8-activation kernel (path ``cpu_int8``), uint8."""

    def _apply(self, fn, recurse: bool = True):
        # nn.Module.to() moves Parameters and buffers; the quantized parts move with it.
        super()._apply(fn, recurse)
        probe = fn(torch.empty(0, device=self.quantized.device))
        if probe.device != self.quantized.device:
            self.quantized = self.quantized.to(probe.device)
            self.path = "unprepared"
        return self

    def int8_under_auto(self) -> bool:
        """Whether ``prepare("auto")`` on a CPU gives this weight int8 activations: a type no
        exact kernel runs (K-quants, q5_0/q5_1) that an int8 kernel keeps."""
        w = self.quantized
        return (_cpu_kernel_available() and not cpu_kernel_fits(w)
                and (w.fmt in KQUANT_FORMAT_CODES or int8_kernel_fits(w)))

    def prepare(self, activations: str = "none") -> str:
        """Choose and build this device's path (see the module docstring); returns its name.

        ``activations``: on a CPU, ``int8`` runs GGUF block weights with int8-quantized inputs;
        ``auto`` fp32 inputs where the exact kernel runs this weight, else int8 ones (K-quants,
        q5_0/q5_1: no exact kernel, and int8 keeps their blocks where none dequantizes them). A
        model settles auto for all its weights first (``model_activations``)."""
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        w = self.quantized
        if activations == "auto":
            activations = "none" if cpu_kernel_fits(w) and _cpu_kernel_available() else "int8"
        if w.device.type == "cuda":
            self.path = "triton"
        elif activations == "int8" and w.fmt in KQUANT_FORMAT_CODES and _cpu_kernel_available():
            self.packed = pack_tiles(w)
            self.path = "cpu_kquant"
            self.quantized = _emptied(w)
        elif activations == "int8" and int8_kernel_fits(w) and _cpu_kernel_available():
            mins = w.mins if w.mins is not None else torch.empty(0, dtype=torch.float16)
            self.packed = torch.ops.tokenmill_quant.repack_int8(w.qweight, w.scales, mins, INT8_FORMAT_CODES[w.fmt])
            self.path = "cpu_int8"
            # The tiles hold every byte the kernel reads; the stored parts are no longer read.
            self.quantized = _emptied(w)
        elif cpu_kernel_fits(w) and _cpu_kernel_available():
            self._scales, self._zeros, self._group = cpu_kernel_operands(w)
            self.path = "cpu_kernel"
        else:
            self._fallback = Linear(dequantize(w, torch.float32))
            self._fallback.prepack()
            self.path = "dequantized"
            # The fallback keeps its own copy; the stored parts are no longer read.
            self.quantized = _emptied(w)
        return self.path

    def cpu_operands(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(scales, zeros, group) of the ``cpu_kernel`` path (``cpu_kernel_operands``), as prepared."""
        if self.path != "cpu_kernel":
            raise ValueError(f"the exact CPU kernel's operands exist on the cpu_kernel path, not {self.path!r}")
        return self._scales, self._zeros, self._group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K] -> [T, N] in x's dtype
        if self.path == "unprepared":
            self.prepare()
        if self.path == "triton" and self.quantized.fmt in BLOCK_FORMATS:
            from services.runtime.kernels.kquant_matmul import kquant_matmul

            out = kquant_matmul(x, self.quantized)
        elif self.path == "triton":
            from services.runtime.kernels.quant_matmul import quant_matmul

            out = quant_matmul(x, self.quantized)
        elif self.path == "cpu_kquant":
            if x.dim() != 2 or x.shape[1] != self.in_features:
                raise ValueError(f"x must be [tokens, {self.in_features}], got {tuple(x.shape)}")
            out = torch.ops.tokenmill_quant.kquant_matmul(
                x.float().contiguous(), self.packed, KQUANT_FORMAT_CODES[self.quantized.fmt], self.out_features,
                self.in_features).to(x.dtype)
        elif self.path == "cpu_int8":
            if x.dim() != 2 or x.shape[1] != self.in_features:
                raise ValueError(f"x must be [tokens, {self.in_features}], got {tuple(x.shape)}")
            out = torch.ops.tokenmill_quant.quant_matmul_int8(
                x.float().contiguous(), self.packed, INT8_FORMAT_CODES[self.quantized.fmt], self.out_features,
                self.in_features).to(x.dtype)
        elif self.path == "cpu_kernel":
            if x.dim() != 2 or x.shape[1] != self.in_features:
                raise ValueError(f"x must be [tokens, {self.in_features}], got {tuple(x.shape)}")
            operands = (self.quantized.qweight, self._scales, self._zeros, bits(self.quantized.fmt), self._group)
            if x.shape[0] >= PANEL_MIN_ROWS:  # compute-bound: fp32 panels in L2, then BLAS
                out = torch.ops.tokenmill_quant.quant_matmul_panels(
                    x.float().contiguous(), *operands, panel_columns(self.in_features)).to(x.dtype)
            else:
                out = torch.ops.tokenmill_quant.quant_matmul(x.float().contiguous(), *operands).to(x.dtype)
        else:
            out = self._fallback(x.float()).to(x.dtype)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        w = self.quantized
        return f"in={self.in_features}, out={self.out_features}, format={w.fmt}, group={w.group_size}, " \
               f"path={self.path}, bias={self.bias is not None}"


def _emptied(w: QuantizedWeight) -> QuantizedWeight:
    """``w``'s description with its parts cut to nothing (another copy serves the products)."""
    return QuantizedWeight(w.fmt, w.out_features, w.in_features, w.group_size, w.qweight[:0],
                           None if w.scales is None else w.scales[:0], None if w.mins is None else w.mins[:0])


def cpu_kernels_ready() -> bool:
    """Whether the C++ CPU kernels are built and loaded here (a warning says why not, once)."""
    return _cpu_kernel_available()


@functools.cache
def _cpu_kernel_available() -> bool:
    from services.runtime.kernels import cpu

    try:
        cpu.load()
    except cpu.CpuKernelsUnavailable as exc:
        _log.warning("quantized linears run dequantized in fp32", reason=str(exc))
        return False

    # Shape-only version for torch.compile (--compile traces the decode step through this op).
    @torch.library.register_fake("tokenmill_quant::quant_matmul")
    def _(x, qweight, scales, zeros, bits, group):
        return x.new_empty((x.shape[0], qweight.shape[0]))

    @torch.library.register_fake("tokenmill_quant::quant_matmul_panels")
    def _(x, qweight, scales, zeros, bits, group, panel):
        return x.new_empty((x.shape[0], qweight.shape[0]))

    @torch.library.register_fake("tokenmill_quant::quant_matmul_int8")
    def _(x, packed, fmt, n, k):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("tokenmill_quant::kquant_matmul")
    def _(x, packed, fmt, n, k):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("tokenmill_quant::moe_experts_int8")
    def _(x, w13, fmt13, w2, fmt2, topk_weights, topk_ids, inter):
        return x.new_empty(x.shape)

    @torch.library.register_fake("tokenmill_quant::quant_dequantize")
    def _(qweight, scales, zeros, bits, group):
        return scales.new_empty((qweight.shape[0], qweight.shape[1] * (2 if bits == 4 else 1)))

    return True


class StackedLinear(nn.Module):
    """Quantized linears of different formats stacked along the output axis: y = [x W_1^T, x W_2^T, ...]."""

    def __init__(self, parts: list[QuantLinear], bias: torch.Tensor | None = None):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([part(x) for part in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias


def build_linear(weights: list[torch.Tensor | QuantizedWeight], bias: torch.Tensor | None = None
                 ) -> Linear | QuantLinear | StackedLinear:
    """One projection from weights stacked along the output axis (q|k|v, gate|up), quantized or not.

    A group mixing float and quantized weights (a ``modules`` exception inside a fused
    projection) runs in float: the quantized members are dequantized to the float one's dtype.
    """
    quantized = [w for w in weights if isinstance(w, QuantizedWeight)]
    if not quantized:
        # A single weight is kept as it is (a tied LM head shares the embedding's Parameter).
        return Linear(weights[0] if len(weights) == 1 else torch.cat(weights), bias)
    if len(quantized) == len(weights):
        # Runs of one format fuse; a file mixing formats in q|k|v (Q4_K_M: Q5_0 q and k, a Q6_K
        # v) gets one quantized linear per run, their outputs side by side.
        runs: list[list[QuantizedWeight]] = []
        for w in quantized:
            if runs and (runs[-1][0].fmt, runs[-1][0].group_size) == (w.fmt, w.group_size):
                runs[-1].append(w)
            else:
                runs.append([w])
        if len(runs) == 1:
            return QuantLinear(cat_rows(quantized), bias)
        return StackedLinear([QuantLinear(cat_rows(run)) for run in runs], bias)
    dtype = next(w.dtype for w in weights if not isinstance(w, QuantizedWeight))
    return Linear(torch.cat([dequantize(w, dtype) if isinstance(w, QuantizedWeight) else w for w in weights]), bias)

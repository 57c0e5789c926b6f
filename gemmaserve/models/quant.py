"""Quantised weights on the CPU: a GGUF file's weights stay quantised instead of being expanded to fp32.

Three weight formats (the rest of the model runs in fp32):

    INT8   per output row: w = q * s,               q int8 [N, K],     s [N]
    INT4   per 32 inputs:  w = s * q - m,            q 0..15 packed,    s, m fp32 [N, K/32]  (cpu_products.py)
    INT8 blocks, tables:   w = q * s per 32 inputs,  q int8 [N, K],     s fp16 [N, K/32] (Q8_0 exactly; lookups only)

Each GGUF tensor goes to the format nearest to it. Q4_K, Q4_0 and Q4_1 are exactly INT4: Q4_K's sub-blocks
of 32 are w = d*sc*q - dmin*m, so s = d*sc and m = dmin*m; Q4_0's blocks (Google's QAT files) are
w = d*(q - 8), so s = d and m = 8d; Q4_1's w = d*q + m, so s = d and m = -m; all read from the blocks (exact in
fp32, not re-fitted). Every other type (Q8_0, Q5_0, Q6_K, F16, ...) has more than 4 bits of precision, so INT8
per row is nearer: its rounding step is max|w| / 127 of the row, a fraction of the source's own step. A fused
weight (q/k/v, gate/up) is INT4 only when all its parts are 4-bit. INT8 picks scales that are bf16 values, so q * s is
exact in fp32.

Kernels. Weight-only kernels (fp32 activations times dequantised weights) are made for one row: at
8 rows PyTorch's ran up to 3x slower than fbgemm's int8 x int8 linear, which
quantises its input per call. Gemma's hidden states carry a few channels hundreds of times larger
than the rest; quantised as they are, those set the step and the other channels drown (argmax
agreement with fp32 over bench quality's text: 84% in 8-row chunks, against 95% rotated). So fbgemm's
inputs are rotated first: x W^T = (x R)(W R)^T for an orthogonal R (`Rotation`), W R is what is
quantised and packed, and R spreads an outlier over every channel.

Every row's result is its own, whatever else is in the batch and however many rows it has (a greedy
token must not change with the batch). fbgemm quantises its input with one scale and zero point
per call, so each rotated row is first mapped onto [0, 1] (xn = (x - lo) / span, cpu_kernels.py's
`row_affine`): a call whose rows all span exactly [0, 1] gets scale 1/255 and zero point 0 whoever
shares it, and x W^T = span * (xn W^T) + lo * (the rows' sums of W). Every other kernel here
computes each row by itself, with no choice that depends on the row count:

    MLP and attention (INT8)      rotated fbgemm at every row count, one pass
    INT4 (Q4_K: o_proj, down)     the int4 kernel of cpu_products.py (fp32 activations, its own order)
    tied output head              a per-row INT8 copy of the table on fbgemm (unrotated) ranks each
                                  row's logits; its 32 highest are recomputed exactly from the
                                  table's blocks

Earlier versions chose kernels by row count (two passes and fp32 expansions in prefill chunks, a
4-bit head copy for one row only) and quantised a batch with one range: the same prompt gave other
greedy tokens alone and in a batch. (The 4-bit head copy, for every row, with its 1,024 highest
recomputed: 6.9 vs 6.7 ms at one row, but 30 vs 13 ms at 8 rows, so it went, and its 84 MB.) (`bench quality` has the quality of this scheme against the
fp32 path and llama.cpp: BENCHMARKS.md.) Without VNNI fbgemm's AVX2 kernel can saturate 8-bit x
8-bit pairs, so activations use 7 bits there: each call gets a guard row spanning [0, 2], so the
call's step is 2/255 and a row on [0, 1] quantises to 0..127 (`FbgemmTensors.guard`), whoever shares
the call. Which class of CPU the kernels are for: cpu_isa.py (`GEMMASERVE_CPU_ISA` forces one).

fbgemm is entered through plain tensors (`FbgemmTensors`), which an exported graph holds like any other
input; `quantized::linear_dynamic`'s quantized tensors (`PackedInt8`, 7-bit activations by `reduce_range`
without VNNI) serve only where `fbgemm_tensors=False` or PyTorch lacks the tensor op.
In a compiled decode step (engine/compile/compiled_decode.py) the same kernels run, through custom ops
(`gemmaserve::row_affine`, `gemmaserve::fbgemm_int8_linear` with tensor inputs, or
`gemmaserve::fbgemm_linear` with the packed object as an opaque reference): the same bits as eager.
"""

from __future__ import annotations

import enum
import functools
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .. import opaque
from . import cpu_kernels  # noqa: F401  (defines gemmaserve::row_affine)
from . import cpu_head, cpu_products
from .cpu_isa import CpuClass, cpu_class
from ..hostmem import release_freed_memory
from ..quantization.schemes import Int8Weight
from ..rowops import row_topk_indices

GROUP = 32


class WeightFormat(enum.Enum):
    INT8 = "int8"
    INT4 = "int4"


@dataclass(frozen=True)
class Int4Groups:
    """Exact 4-bit groups of one weight [N, K]: w = s * q - m per group of 32 inputs."""
    q: torch.Tensor       # uint8 [N, K], 0..15
    scale: torch.Tensor   # fp32 [N, K / 32]
    minus: torch.Tensor   # fp32 [N, K / 32] (the m subtracted)

    @staticmethod
    def cat(parts: list["Int4Groups"]) -> "Int4Groups":
        return Int4Groups(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.minus for p in parts]))

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight the int4 kernel multiplies by (s * q - m rounded once)."""
        return cpu_products.int4_weight(self.q, self.scale, self.minus)


def q4_k_groups(raw: np.ndarray, shape: tuple[int, int]) -> Int4Groups:
    """Q4_K blocks (256 values: fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of
    nibbles) -> exact 4-bit groups of 32."""
    from gguf.quants import Q4_K

    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, 144)
    n_blocks = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    # 128 bytes = 4 chunks of 32; chunk c holds sub-block 2c in its low nibbles, 2c+1 in its high ones.
    qs = blocks[:, 16:].reshape(n_blocks, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(0x0F)).reshape(n_blocks, 8, 32)
    n, k = shape
    return Int4Groups(torch.from_numpy(q.reshape(n, k).copy()),
                      torch.from_numpy((d * sc.astype(np.float32)).reshape(n, k // GROUP)),
                      torch.from_numpy((dmin * m.astype(np.float32)).reshape(n, k // GROUP)))


def q4_0_groups(raw: np.ndarray, shape: tuple[int, int]) -> Int4Groups:
    """Q4_0 blocks (32 values: fp16 d, 16 bytes of nibbles; w = d * (q - 8)) -> exact 4-bit groups: s = d,
    m = 8 d (both exact in fp32). Google's QAT GGUFs are Q4_0."""
    return _q4_blocks(raw, shape, with_min=False)


def q4_1_groups(raw: np.ndarray, shape: tuple[int, int]) -> Int4Groups:
    """Q4_1 blocks (32 values: fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m) -> s = d, minus = -m."""
    return _q4_blocks(raw, shape, with_min=True)


def _q4_blocks(raw: np.ndarray, shape: tuple[int, int], with_min: bool) -> Int4Groups:
    head = 4 if with_min else 2
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, head + 16)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    # Byte j holds value j in its low nibble and value j + 16 in its high one.
    nib = blocks[:, head:]
    q = np.concatenate([nib & np.uint8(0x0F), nib >> np.uint8(4)], axis=1)
    minus = -blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0] if with_min else 8.0 * d
    n, k = shape
    return Int4Groups(torch.from_numpy(q.reshape(n, k).copy()), torch.from_numpy(d.reshape(n, k // GROUP).copy()),
                      torch.from_numpy(np.asarray(minus, dtype=np.float32).reshape(n, k // GROUP).copy()))


def q8_0_int8(raw: np.ndarray, shape: tuple[int, int]) -> Int8Weight:
    """Q8_0 blocks (34 bytes: fp16 d, then 32 int8 q; w = d * q) -> exact int8 groups of 32, d kept in fp16 (for
    CUDA's int8 kernel: models/gguf_packed.py)."""
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, 34)
    n, k = shape
    d = blocks[:, 0:2].copy().view(np.float16).reshape(n, k // 32)
    q = blocks[:, 2:].copy().view(np.int8).reshape(n, k)
    return Int8Weight(torch.from_numpy(q), torch.from_numpy(d), 32)


def q6_k_int8(raw: np.ndarray, shape: tuple[int, int]) -> Int8Weight:
    """Q6_K blocks (256 values in 210 bytes: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales sc,
    fp16 d; w = d * sc * (q - 32) per 16 values) -> exact int8 groups of 16: q - 32 (-32..31) and d * sc in fp32
    (an fp16 times an int8: exact).

    Value e = 128 h + 32 j + c of a block (half h, quarter j, column c < 32) takes its low 4 bits from nibble
    j // 2 of low byte 64 h + 32 (j % 2) + c and its high 2 bits from bits 2j, 2j + 1 of high byte 32 h + c."""
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, 210)
    nb = blocks.shape[0]
    low = blocks[:, :128].reshape(nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    high = blocks[:, 128:192].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = ((low & np.uint8(0x0F)).reshape(nb, 256) | ((high & np.uint8(0x03)).reshape(nb, 256) << np.uint8(4)))
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    n, k = shape
    return Int8Weight(torch.from_numpy((q.astype(np.int8) - np.int8(32)).reshape(n, k)),
                      torch.from_numpy((d * sc).reshape(n, k // 16)), 16)


def q4_0_int8(raw: np.ndarray, shape: tuple[int, int]) -> Int8Weight:
    """Q4_0 blocks as int8 groups of 32: q - 8 (-8..7) and d (fp16, as saved), exactly w = d * (q - 8). For a
    fused module that mixes Q4_0 with 8-bit parts (models/gguf_packed.py); alone, Q4_0 stays 4-bit."""
    g = q4_0_groups(raw, shape)
    return Int8Weight((g.q.to(torch.int8) - 8).contiguous(), g.scale.to(torch.float16), GROUP)


def _int8_scale(amax: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """INT8 scales as `dtype` values no smaller than amax / 127 (so |q| <= 127)."""
    s = (amax / 127).clamp(min=1e-30)
    b = s.to(dtype)
    return torch.where(b.float() < s, torch.nextafter(b, torch.tensor(float("inf"), dtype=dtype)), b)


def int8_rows(w: torch.Tensor, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (int8 q [N, K], bf16 scales [N]) with w ~ q * s. In row chunks, so quantising the
    262k-row embedding adds no fp32-sized temporaries to the peak memory of loading."""
    n = w.shape[0]
    q = torch.empty(w.shape, dtype=torch.int8)
    s = torch.empty(n, dtype=torch.bfloat16)
    for i in range(0, n, chunk):
        rows = w[i:i + chunk].float()
        s[i:i + chunk] = _int8_scale(rows.abs().amax(1))
        q[i:i + chunk] = torch.round(rows / s[i:i + chunk].float()[:, None]).clamp_(-127, 127)
    return q, s


def int8_blocks(w: torch.Tensor, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (int8 q [N, K], fp16 scales [N, K / 32]): w ~ q * s per block of 32 inputs (of the
    whole row where K is not a multiple of 32). A Q8_0 source comes back exactly: its block scales
    are fp16 values of amax / 127, which this computes exactly again."""
    n, k = w.shape
    block = GROUP if k % GROUP == 0 else k
    q = torch.empty(w.shape, dtype=torch.int8)
    s = torch.empty(n, k // block, dtype=torch.float16)
    for i in range(0, n, chunk):
        rows = w[i:i + chunk].float().view(-1, k // block, block)
        s[i:i + chunk] = _int8_scale(rows.abs().amax(-1), torch.float16)
        q[i:i + chunk] = torch.round(rows / s[i:i + chunk].float()[..., None]).clamp_(-127, 127).view(-1, k)
    return q, s


class Int8Kernel(enum.Enum):
    FBGEMM_DYNAMIC = "fbgemm"        # fbgemm's int8 x int8 linear: uint8 activations, quantised per call
    WEIGHT_ONLY = "weight-only"      # cpu_products.py's int8_mm: fp32 activations (where fbgemm is missing)


def default_int8_kernel() -> Int8Kernel:
    return Int8Kernel.FBGEMM_DYNAMIC if cpu_class().fbgemm else Int8Kernel.WEIGHT_ONLY


def _cpu_has_vnni() -> bool:
    """Whether fbgemm's 8-bit activations are exact here (the VNNI class, cpu_isa.py)."""
    return cpu_class() is CpuClass.VNNI


def _hadamard(n: int) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix of order n (a power of two)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@dataclass(frozen=True)
class Rotation:
    """An orthogonal R = A (x) H of order K = n * b, applied to the last dim: x R = vec(A^T X H) for
    X = x seen as [n, b]. H is the Hadamard matrix of the largest power-of-two b <= 128 dividing K;
    A a Hadamard matrix too when n is a power of two, else a fixed (seeded) random orthogonal matrix.
    Either way one outlier channel of x lands on all K channels of x R with 1/sqrt(K) of its size.
    Weights are rotated once with `apply`; activations in `row_affine` (H as butterflies)."""

    a_t: torch.Tensor   # [n, n] = A^T
    h: torch.Tensor     # [b, b]

    MAX_BLOCK = 128

    @classmethod
    def for_width(cls, k: int) -> "Rotation":
        b = 1
        while k % (2 * b) == 0 and 2 * b <= cls.MAX_BLOCK:
            b *= 2
        n = k // b
        if n & (n - 1) == 0:
            a = _hadamard(n)
        else:
            a, r = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(n), dtype=torch.float64))
            a = a * torch.sign(torch.diagonal(r))[None, :]   # the unique QR with a positive diagonal
        return cls(a.t().float().contiguous(), _hadamard(b).float())

    @property
    def block(self) -> int:
        return self.h.shape[0]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> x R (two matmuls: for weights, once; activations go through `row_affine`)."""
        n, b = self.a_t.shape[0], self.h.shape[0]
        y = torch.matmul(x.reshape(-1, b), self.h).view(-1, n, b)
        return torch.matmul(self.a_t, y).view(x.shape) if n > 1 else y.view(x.shape)

    def undo(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> x R^T (R^-1)."""
        n, b = self.a_t.shape[0], self.h.shape[0]
        y = torch.matmul(x.reshape(-1, b), self.h.t()).view(-1, n, b)
        return torch.matmul(self.a_t.t(), y).view(x.shape) if n > 1 else y.view(x.shape)


def row_affine(x: torch.Tensor, rotation: Rotation | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (xn, lo, span): x rotated, then each row mapped onto [0, 1]
    (cpu_kernels.py: one C++ call where it is built, the same bits where not)."""
    if rotation is None:
        return torch.ops.gemmaserve.row_affine(x, x.new_empty(0, 0), 0)
    return torch.ops.gemmaserve.row_affine(x, rotation.a_t, rotation.block)


@opaque.opaque_reference
class PackedInt8(opaque.OpaqueRef):
    """fbgemm's packed weight, as compiled graphs pass it to `gemmaserve::fbgemm_linear`."""

    def __init__(self, packed, out_features: int):
        self.packed, self.out_features = packed, out_features

    def cache_key(self) -> tuple:
        return ("fbgemm", self.out_features)


if opaque.SUPPORTED:
    @torch.library.custom_op("gemmaserve::fbgemm_linear", mutates_args=())
    def _fbgemm_linear(x: torch.Tensor, w: PackedInt8, out_features: int, reduce_range: bool) -> torch.Tensor:
        return _linear_dynamic(x, w, reduce_range)

    @_fbgemm_linear.register_fake
    def _(x: torch.Tensor, w: PackedInt8, out_features: int, reduce_range: bool) -> torch.Tensor:
        return x.new_empty(x.shape[0], out_features)


def _linear_dynamic(x: torch.Tensor, w: PackedInt8, reduce_range: bool) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic(x, w.packed, reduce_range)


@dataclass(frozen=True)
class FbgemmTensors:
    """fbgemm's int8 x int8 linear as `torch.fbgemm_linear_int8_weight_fp32_activation` takes it: the
    packed weight is a plain (uint8) tensor, so a compiled graph takes it as an input like any other
    (no opaque object), and a call skips `quantized::linear_dynamic`'s quantized-tensor machinery:
    25 vs 48 us for a 640 x 4096 matrix at one row, 14 vs 27 us for 2048 x 640 (same results to 5e-7).
    The kernel's weight scale is 1; the per-row scales apply to its output. It quantises its input
    on the call's range with 8 bits: without VNNI (AVX2 or AVX-512 alone) its int16 pair sums would
    saturate, so there every call carries `guard`, one more row spanning [0, 2] whose output is
    dropped: rows on [0, 1] then quantise to 0..127 (7 bits, as `reduce_range`), whatever the batch.
    PyTorch marks the op deprecated, like the quantized tensors `linear_dynamic` takes: whichever
    exists is used."""

    shape: torch.Tensor         # int8 [N, K] with zero strides: the op reads only the weight's shape
    packed: torch.Tensor        # fbgemm's packed matrix, held by a uint8 tensor
    col_offsets: torch.Tensor   # int32 [N]: the rows' sums
    scales: torch.Tensor        # fp32 [N]
    bias: torch.Tensor          # fp32 [N] zeros (the op requires one)
    guard: torch.Tensor         # fp32 [0, K] (VNNI: 8-bit activations) or [1, K] (7 bits: `_guard_row`)

    @staticmethod
    def available() -> bool:
        return hasattr(torch, "fbgemm_linear_int8_weight_fp32_activation") and cpu_class().fbgemm

    @classmethod
    def pack(cls, q: torch.Tensor, s: torch.Tensor) -> "FbgemmTensors":
        n, k = q.shape
        with warnings.catch_warnings():   # deprecation notes, once per process (see the docstring)
            warnings.simplefilter("ignore")
            sums = _int_row_sums(q)
            t = cls(_zero_weight(n, k), torch.fbgemm_pack_quantized_matrix(q), sums, s.float(), _zero_bias(n),
                    _guard_row(k, seven_bits=cpu_class() is not CpuClass.VNNI))
            t(torch.zeros(1, k))
        return t

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] fp32, contiguous -> [M, N]."""
        rows = len(x)
        if len(self.guard):
            x = torch.cat([x, self.guard])
        if torch.compiler.is_compiling():
            y = torch.ops.gemmaserve.fbgemm_int8_linear(x, self.shape, self.packed, self.col_offsets, self.bias)
            return y[:rows] * self.scales
        return _fbgemm_int8_product(x, self.shape, self.packed, self.col_offsets, self.bias)[:rows].mul_(self.scales)

    def dequantize(self) -> torch.Tensor:
        """The weight [N, K] read back through the kernel (the packed form has no unpack): each row of
        the identity quantises exactly (scale 1/255), so the products are the stored integers (with one
        nonzero input per row no pair sum saturates: no guard needed)."""
        eye = torch.eye(self.shape.shape[1])
        y = _fbgemm_int8_product(eye, self.shape, self.packed, self.col_offsets, self.bias).mul_(self.scales)
        return y.t().contiguous()


@functools.cache   # one per shape, shared by every matrix of it: a compiled graph takes it as one input
def _zero_weight(n: int, k: int) -> torch.Tensor:
    """`FbgemmTensors.shape`: an int8 [n, k] of zero strides (one byte)."""
    return torch.zeros(1, dtype=torch.int8).expand(n, k)


@functools.cache   # as `_zero_weight`: read-only zeros
def _zero_bias(n: int) -> torch.Tensor:
    return torch.zeros(n)


@functools.cache   # as `_zero_weight`: read-only, one per width
def _guard_row(k: int, seven_bits: bool) -> torch.Tensor:
    """`FbgemmTensors.guard`: no row (8-bit activations), or a row of zeros and one 2, which makes every
    call's input range [0, 2]: step 2/255, so a row on [0, 1] quantises to at most 127."""
    if not seven_bits:
        return torch.zeros(0, k)
    row = torch.zeros(1, k)
    row[0, 0] = 2.0
    return row


def _fbgemm_int8_product(x: torch.Tensor, shape: torch.Tensor, packed: torch.Tensor, col_offsets: torch.Tensor,
                         bias: torch.Tensor) -> torch.Tensor:
    """x times the packed integers (weight scale 1; `bias` is zeros)."""
    return torch.fbgemm_linear_int8_weight_fp32_activation(x, shape, packed, col_offsets, 1.0, 0, bias)


if hasattr(torch, "fbgemm_linear_int8_weight_fp32_activation"):   # (cpu_kernels.py registers its C++ kernel)
    @torch.library.custom_op("gemmaserve::fbgemm_int8_linear", mutates_args=())
    def _fbgemm_int8_linear(x: torch.Tensor, shape: torch.Tensor, packed: torch.Tensor, col_offsets: torch.Tensor,
                            bias: torch.Tensor) -> torch.Tensor:
        return _fbgemm_int8_product(x, shape, packed, col_offsets, bias)

    @_fbgemm_int8_linear.register_fake
    def _(x: torch.Tensor, shape: torch.Tensor, packed: torch.Tensor, col_offsets: torch.Tensor,
          bias: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], shape.shape[0])


class Int8Matmul:
    """x [M, K] @ (q * s)^T for int8 rows q [N, K], bf16 scales s [N], on `kernel`. With a
    `rotation` (fbgemm only), q * s is the rotated weight W R and each call rotates its input the same
    way. fbgemm quantises its input per call: each row is first mapped onto [0, 1] (`row_affine`)
    and the product mapped back, so every row gets its own 8-bit step whatever shares the call."""

    def __init__(self, q: torch.Tensor, s: torch.Tensor, kernel: Int8Kernel, rotation: Rotation | None = None,
                 keep_rows: bool = True, fbgemm_tensors: bool = True):
        """`keep_rows=False`: hold fbgemm's packed copy only (`dequantize` then unpacks it, slowly).
        `fbgemm_tensors=False`: `quantized::linear_dynamic` even where `FbgemmTensors` would serve."""
        if rotation is not None and kernel is not Int8Kernel.FBGEMM_DYNAMIC:
            raise ValueError("rotated weights need activations quantised per call (fbgemm)")
        self.kernel, self.out_features, self.rotation = kernel, q.shape[0], rotation
        self._q, self._s = (q, s) if keep_rows or kernel is Int8Kernel.WEIGHT_ONLY else (None, None)
        self._tensors: FbgemmTensors | None = None
        self._packed: PackedInt8 | None = None
        if kernel is Int8Kernel.FBGEMM_DYNAMIC:
            self._reduce_range = not _cpu_has_vnni()
            # x W^T = span * (xn W^T) + lo * (W's row sums): the sums of the stored integers, scaled
            self.row_sums = _int_row_sums(q).float() * s.float()
            self._no_a_t = torch.empty(0, 0)   # row_affine's "no rotation" (a tensor of this matrix's own)
            if fbgemm_tensors and FbgemmTensors.available():   # VNNI: no reduce_range
                self._tensors = FbgemmTensors.pack(q, s)
            else:
                with warnings.catch_warnings():   # PyTorch flags quantized tensors as legacy; fbgemm's kernels are current
                    warnings.simplefilter("ignore")
                    wq = torch._make_per_channel_quantized_tensor(q, s.double(), torch.zeros(len(s), dtype=torch.long),
                                                                  0)
                    # one owner of the packed weight: the handle that compiled graphs pass around too
                    self._packed = PackedInt8(torch.ops.quantized.linear_prepack(wq, None), self.out_features)
                    self._fbgemm(torch.zeros(1, q.shape[1]))   # its deprecation note, once per process, here

    @classmethod
    def for_layer(cls, w: torch.Tensor, rotations: dict[int, Rotation] | None = None,
                  parts: dict | None = None) -> "Int8Matmul":
        """A layer's fp32 weight [N, K]: rotated on fbgemm where PyTorch has it, else weight-only.
        `rotations`: the ones made so far, by width (every matrix of one width can share one).
        `parts`: gets the quantised rows it was built from (`from_parts` rebuilds it from them)."""
        if default_int8_kernel() is Int8Kernel.WEIGHT_ONLY:
            q, s = int8_rows(w)
        else:
            rotations = {} if rotations is None else rotations
            k = w.shape[1]
            rotation = rotations[k] = rotations.get(k) or Rotation.for_width(k)
            q, s = int8_rows(rotation.apply(w.float()))
        if parts is not None:
            parts.update(q=q, s=s)
        return cls.from_parts(q, s, rotations)

    @classmethod
    def from_parts(cls, q: torch.Tensor, s: torch.Tensor, rotations: dict[int, Rotation] | None = None) -> "Int8Matmul":
        """A layer's matrix from its quantised rows (rotated where fbgemm serves: `for_layer`)."""
        if default_int8_kernel() is Int8Kernel.WEIGHT_ONLY:
            return cls(q, s, Int8Kernel.WEIGHT_ONLY)
        rotations = {} if rotations is None else rotations
        k = q.shape[1]
        rotation = rotations[k] = rotations.get(k) or Rotation.for_width(k)
        return cls(q, s, Int8Kernel.FBGEMM_DYNAMIC, rotation, keep_rows=False)

    def dequantize(self) -> torch.Tensor:
        """The weight [N, K] in the inputs' own basis."""
        if self._q is None and self._tensors is not None:
            w = self._tensors.dequantize()
        elif self._q is None:
            qw = torch.ops.quantized.linear_unpack(self._packed.packed)[0]
            w = qw.int_repr().float() * qw.q_per_channel_scales().float()[:, None]
        else:
            w = self._q.float() * self._s.float()[:, None]
        return w if self.rotation is None else self.rotation.undo(w)

    def _fbgemm(self, x: torch.Tensor) -> torch.Tensor:
        if self._tensors is not None:
            return self._tensors(x)
        if torch.compiler.is_compiling():   # the packed weight is opaque to the compiler
            return torch.ops.gemmaserve.fbgemm_linear(x, self._packed, self.out_features, self._reduce_range)
        return _linear_dynamic(x, self._packed, self._reduce_range)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self._tensors is not None:   # one op: rotate and map each row, fbgemm, map back
            t = self._tensors
            a_t, block = (self.rotation.a_t, self.rotation.block) if self.rotation is not None else (self._no_a_t, 0)
            y = torch.ops.gemmaserve.int8_linear(x2.float(), a_t, block, t.shape, t.packed, t.col_offsets, t.bias,
                                                 t.scales, self.row_sums, t.guard)
        elif self.kernel is Int8Kernel.FBGEMM_DYNAMIC:
            xn, lo, span = row_affine(x2.float(), self.rotation)
            y = self._fbgemm(xn) * span + lo * self.row_sums
        else:
            y = torch.ops.gemmaserve.int8_mm(x2.float().contiguous(), self._q, self._s)
        return y.to(x.dtype).view(*shape[:-1], self.out_features)


def _int_row_sums(q: torch.Tensor) -> torch.Tensor:
    """int32 [N]: each row's sum of an int8 [N, K], in slices (q.sum(1, dtype=int32) converts the whole
    matrix first: +660 MB for the head)."""
    return torch.cat([q[i:i + 8192].sum(1, dtype=torch.int32) for i in range(0, q.shape[0], 8192)])


class QuantLinear(nn.Module):
    """y = x W^T with W in INT8 or INT4 (see the module docstring); x fp32 or bf16, y in x's dtype.
    Each row through the same kernel whatever the row count, so each row's result is its own."""

    def __init__(self, in_features: int, out_features: int, fmt: WeightFormat):
        super().__init__()
        self.in_features, self.out_features, self.format = in_features, out_features, fmt

    @classmethod
    def from_float(cls, w: torch.Tensor, kernel: Int8Kernel | None = None,
                   rotations: dict[int, Rotation] | None = None, parts: dict | None = None) -> "QuantLinear":
        """INT8 rows of an fp32 weight; `kernel` None: the layers' default (`Int8Matmul.for_layer`).
        `rotations`, `parts`: see `for_layer`."""
        mod = cls(w.shape[1], w.shape[0], WeightFormat.INT8)
        mod.int8 = Int8Matmul.for_layer(w, rotations, parts) if kernel is None else Int8Matmul(*int8_rows(w), kernel)
        return mod

    @classmethod
    def from_int4(cls, g: Int4Groups, parts: dict | None = None) -> "QuantLinear":
        """`parts`: gets what `from_parts` rebuilds it from."""
        packed = cpu_products.pack_int4(g.q)
        if parts is not None:
            parts.update(qweight=packed, scale=g.scale, minus=g.minus)
        return cls._int4(packed, g.scale.contiguous(), g.minus.contiguous())

    @classmethod
    def _int4(cls, packed: torch.Tensor, scale: torch.Tensor, minus: torch.Tensor) -> "QuantLinear":
        """The int4 kernel's layout (cpu_products.py): nibbles [N, K / 2], fp32 scale and minus [N, K / 32]
        (exactly Q4_K's d * sc and dmin * m)."""
        n, k = packed.shape[0], packed.shape[1] * 2
        mod = cls(k, n, WeightFormat.INT4)
        mod.register_buffer("qweight", packed)
        mod.register_buffer("scale", scale)
        mod.register_buffer("minus", minus)
        return mod

    @classmethod
    def from_parts(cls, fmt: WeightFormat, parts: dict[str, torch.Tensor],
                   rotations: dict[int, Rotation] | None = None) -> "QuantLinear":
        """The module `from_float` (default kernel) or `from_int4` built, from what they recorded."""
        if fmt is WeightFormat.INT4:
            return cls._int4(parts["qweight"], parts["scale"], parts["minus"])
        mod = cls(parts["q"].shape[1], parts["q"].shape[0], WeightFormat.INT8)
        mod.int8 = Int8Matmul.from_parts(parts["q"], parts["s"], rotations)
        return mod

    def dequantize(self) -> torch.Tensor:
        if self.format is WeightFormat.INT8:
            return self.int8.dequantize()
        return cpu_products.int4_weight(cpu_products.unpack_int4(self.qweight), self.scale, self.minus)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.format is WeightFormat.INT8:
            return self.int8(x)
        shape = x.shape
        y = torch.ops.gemmaserve.int4_mm(x.reshape(-1, shape[-1]).float().contiguous(), self.qweight, self.scale,
                                         self.minus)
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kernel = f", kernel={self.int8.kernel.value}" if self.format is WeightFormat.INT8 else ""
        return f"in={self.in_features}, out={self.out_features}, format={self.format.value}{kernel}"


class QuantEmbedding(nn.Module):
    """An embedding table in INT8 blocks of 32 (`int8_blocks`: a Q8_0 table, GGUF's usual choice for
    Gemma's, is kept exactly); lookups dequantise the rows they read (fp32). `as_head` is the tied
    output projection: a 4-bit scan of the vocabulary, then every token that can matter recomputed exactly
    against the blocks (cpu_head.py: half the bytes of an int8 scan, and closer to the exact head). A table
    whose width is not a multiple of 32 (tiny test models) scans an INT8-per-row copy (`Int8Matmul`) and
    recomputes each row's `REFINE` highest logits exactly instead. (Per-row INT8 alone, table included,
    doubled the KL divergence from the fp32 path over bench quality's text: 0.0046 vs 0.0023.)"""

    REFINE = 32

    def __init__(self, weight: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kernel: Int8Kernel | None = None,
                 head: bool = True, parts: dict | None = None):
        """`weight`: the fp32 table, or its (q, s) from `int8_blocks` (so the caller can free the table
        before the kernel packs its copy). `head=False`: a lookup-only table (Gemma 4's per-layer
        embeddings), no matmul copy. `parts`: gets what `from_parts` rebuilds it from."""
        super().__init__()
        q, s = weight if isinstance(weight, tuple) else int8_blocks(weight)
        self.num_embeddings, self.embedding_dim = q.shape
        self.register_buffer("qweight", q)
        self.register_buffer("scales", s)
        self.head = None
        self.head4: tuple[torch.Tensor, torch.Tensor] | None = None
        if head and self._scans_4bit():
            self.head4 = cpu_head.pack(q, s)
            if parts is not None:
                parts.update(head4_packed=self.head4[0], head4_scales=self.head4[1])
        elif head:
            kernel = kernel or default_int8_kernel()
            rows = int8_rows(_BlockRows(self))
            # fbgemm keeps only its packed copy; the weight-only kernel reads the rows themselves
            self.head = Int8Matmul(*rows, kernel, keep_rows=kernel is Int8Kernel.WEIGHT_ONLY)
            if parts is not None:
                parts.update(head_q=rows[0], head_s=rows[1])
        if parts is not None:
            parts.update(qweight=q, scales=s)

    def _scans_4bit(self) -> bool:
        return cpu_head.supports(self.embedding_dim) and self.scales.shape[1] == self.embedding_dim // GROUP

    @classmethod
    def from_parts(cls, parts: dict[str, torch.Tensor]) -> "QuantEmbedding":
        """The table `__init__` built (with the default kernel), from what it recorded."""
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        mod.num_embeddings, mod.embedding_dim = parts["qweight"].shape
        mod.register_buffer("qweight", parts["qweight"])
        mod.register_buffer("scales", parts["scales"])
        mod.head, mod.head4 = None, None
        if "head4_packed" in parts:
            mod.head4 = (parts["head4_packed"], parts["head4_scales"])
        elif "head_q" in parts:
            kernel = default_int8_kernel()
            mod.head = Int8Matmul(parts["head_q"], parts["head_s"], kernel, keep_rows=kernel is Int8Kernel.WEIGHT_ONLY)
        return mod

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = self.qweight[ids].float()
        blocks = self.scales.shape[-1]
        return (q.view(*q.shape[:-1], blocks, -1) * self.scales[ids].float()[..., None]).view(q.shape)

    def as_head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head4 is not None:   # (every row on its own: the same bits alone or in any batch)
            flat = hidden.reshape(-1, self.embedding_dim)
            logits = torch.ops.gemmaserve.head_logits(flat, *self.head4, self.qweight, self.scales,
                                                      cpu_head.REFINE_MARGIN)
            return logits.view(*hidden.shape[:-1], self.num_embeddings)
        if self.head is None:
            raise RuntimeError("this embedding table was quantised for lookups only")
        logits = self.head(hidden)   # (the same kernel for every row: a row's logits are its own)
        if logits.numel():
            flat, h = logits.view(-1, self.num_embeddings), hidden.reshape(-1, self.embedding_dim).float()
            top = row_topk_indices(flat, min(self.REFINE, self.num_embeddings))           # [M, k]
            exact = torch.ops.gemmaserve.rows_dot(h, self(top))
            flat.scatter_(-1, top, exact.to(flat.dtype))
        return logits


def _int8_linear_ref(x: torch.Tensor, a_t: torch.Tensor, block: int, shape: torch.Tensor, packed: torch.Tensor,
                     col_offsets: torch.Tensor, bias: torch.Tensor, scales: torch.Tensor,
                     row_sums: torch.Tensor, guard: torch.Tensor) -> torch.Tensor:
    xn, lo, span = torch.ops.gemmaserve.row_affine(x, a_t, block)
    rows = len(xn)
    if len(guard):
        xn = torch.cat([xn, guard])
    y = _fbgemm_int8_product(xn, shape, packed, col_offsets, bias)[:rows].mul_(scales)
    return y * span + lo * row_sums


if hasattr(torch, "fbgemm_linear_int8_weight_fp32_activation"):
    @torch.library.custom_op("gemmaserve::int8_linear", mutates_args=())
    def _int8_linear(x: torch.Tensor, a_t: torch.Tensor, block: int, shape: torch.Tensor, packed: torch.Tensor,
                     col_offsets: torch.Tensor, bias: torch.Tensor, scales: torch.Tensor,
                     row_sums: torch.Tensor, guard: torch.Tensor) -> torch.Tensor:
        """`Int8Matmul` on fbgemm's tensor-packed weight as one op (row_affine, the product with
        `FbgemmTensors.guard`'s rows beside the input's, the per-row scales, the map back): one call
        from a compiled graph instead of three (~10 us each)."""
        return _int8_linear_ref(x, a_t, block, shape, packed, col_offsets, bias, scales, row_sums, guard)

    @_int8_linear.register_fake
    def _(x: torch.Tensor, a_t: torch.Tensor, block: int, shape: torch.Tensor, packed: torch.Tensor,
          col_offsets: torch.Tensor, bias: torch.Tensor, scales: torch.Tensor, row_sums: torch.Tensor,
          guard: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], shape.shape[0])


@torch.library.custom_op("gemmaserve::int4_mm", mutates_args=())
def _int4_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minus: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 times the int4 weight (cpu_products.py, whose C++ kernel serves it). This Python
    kernel, the fallback, dequantises and takes the BLAS's product."""
    from .layers import _padded_linear

    return _padded_linear(x, cpu_products.int4_weight(cpu_products.unpack_int4(packed), scale, minus))


@_int4_mm.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minus: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


@torch.library.custom_op("gemmaserve::int8_mm", mutates_args=())
def _int8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 times int8 rows with one scale each (the weight-only kernel: cpu_products.py). The
    fallback: PyTorch's weight-only kernel (bf16 activations)."""
    return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), q, scale).float()


@_int8_mm.register_fake
def _(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[0])


@torch.library.custom_op("gemmaserve::rows_dot", mutates_args=())
def _rows_dot(h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """h [M, H] . rows [M, k, H] -> [M, k] (the head's exact recomputation). An op, with a C++ kernel
    making the same ATen call (cpu_kernels.py): a compiled graph would rewrite these one-row products
    into its own multiply-and-sum, which rounds differently."""
    return torch.einsum("mh,mkh->mk", h, rows)


@_rows_dot.register_fake
def _(h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return h.new_empty(rows.shape[0], rows.shape[1])


@dataclass(frozen=True)
class _BlockRows:
    """A `QuantEmbedding`'s table as fp32 rows, dequantised per slice (`int8_rows` reads it in chunks:
    the 262k-row table never exists in fp32 at once)."""

    table: QuantEmbedding

    @property
    def shape(self) -> tuple[int, int]:
        return (self.table.num_embeddings, self.table.embedding_dim)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        return self.table(torch.arange(self.table.num_embeddings)[rows])


def quantize_model(model: nn.Module, int4: dict[str, Int4Groups],
                   head_kernel: Int8Kernel | None = None, record: dict | None = None,
                   tables: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> dict[str, int]:
    """Replace every `Linear` and `Embedding` of a loaded fp32 `CausalLM` by its quantised form, in
    place. `int4`: exact groups of the checkpoint's 4-bit weights by our tensor name (before fusing
    q/k/v and gate/up: a fused weight is INT4 only if all its parts are). Returns a count per format.
    `record`: gets, per module name, its format and the tensors it was built from (quant_cache.py
    keeps them so that a later start skips the quantising). `tables`: embedding tables already in `int8_blocks`'
    form (a GGUF's Q8_0 blocks, exactly), by parameter name: their fp32 weights were never filled."""
    from .layers import Embedding, Linear

    parts_of: dict[str, dict[int, Int4Groups]] = {}
    for name, groups in int4.items():
        prefix, part, leaf = name.rsplit(".", 2)
        if part in model.stacked:
            fused, idx = model.stacked[part]
            parts_of.setdefault(f"{prefix}.{fused}.{leaf}", {})[idx] = groups
    counts = {f.value: 0 for f in WeightFormat} | {"embedding_int8": 0, "float32": 0}
    rotations: dict[int, Rotation] = {}   # one per input width, shared by its matrices
    # By name, one module at a time, holding no reference to the replaced one: each fp32 weight is
    # freed as soon as its quantised form exists. Tables go last, freed before fbgemm packs its copy,
    # so loading peaks at the fp32 model's size (the 262k-row table alone is 671 MB in fp32).
    # A matrix whose input width is not a multiple of 32 stays fp32: `_weight_int8pack_mm` crashes on
    # widths like 8 or 24 (seen in torch 2.13), and int4 groups need 32. Real Gemma widths are multiples
    # of 256; only tiny test configs have such matrices.
    names = []
    for n, m in model.named_modules():
        if isinstance(m, Linear):
            if m.in_features % GROUP:
                counts["float32"] += 1
            else:
                names.append(n)
    names += [n for n, m in model.named_modules() if isinstance(m, Embedding)]
    for mod_name in names:
        parent, _, attr = mod_name.rpartition(".")
        weight = model.get_submodule(mod_name).weight.data
        if isinstance(model.get_submodule(mod_name), Embedding):
            blocks = (tables or {}).get(f"{mod_name}.weight") or int8_blocks(weight)
            del weight
            setattr(model.get_submodule(parent), attr, nn.Identity())   # drop the fp32 table now
            release_freed_memory()   # and the fp32 matrices before it, before the table's copies are made
            parts = {} if record is not None else None
            new = QuantEmbedding(blocks, head_kernel, head=mod_name == model.output_embedding_name(), parts=parts)
            if record is not None:
                record[mod_name] = ("embedding", parts)
            counts["embedding_int8"] += 1
        else:
            wname = f"{mod_name}.weight"
            groups = int4.get(wname)
            parts = parts_of.get(wname, {})
            if groups is None and parts and len(parts) == len(model.shard_sizes(wname)):
                groups = Int4Groups.cat([parts[i] for i in range(len(parts))])
            parts = {} if record is not None else None
            if groups is not None:
                new = QuantLinear.from_int4(groups, parts)   # exact at every row count (see the module docstring)
            else:
                new = QuantLinear.from_float(weight, rotations=rotations, parts=parts)
            if record is not None:
                record[mod_name] = (new.format.value, parts)
            counts[new.format.value] += 1
            del weight
        setattr(model.get_submodule(parent), attr, new)
    return counts

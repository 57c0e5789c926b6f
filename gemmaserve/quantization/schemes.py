"""The quantised weights we run, each defined by its dequantisation (the contract between loaders and kernels).

    INT4 groups   w[n, k] = scale[n, k // g] * (q[n, k] - zero[n, k // g])
                  q 0..15 (uint8 [N, K] here; packed by the kernels), scale [N, K/g] (the checkpoint's float
                  dtype, kept as saved), zero 0..15 [N, K/g] uint8, or None for symmetric weights (zero = 8:
                  compressed-tensors stores a symmetric int4 value v in -8..7 as v + 8). g = 32 or 128.
    INT4 offset   w[n, k] = scale[n, k // g] * q[n, k] - offset[n, k // g]
                  the same q and scale, a float offset [N, K/g] instead of a zero point (never both): GGUF's
                  Q4_K (s = d * sc, offset = dmin * m, fp32) and Q4_1 (s = d, offset = -m, fp16). g = 32.
    INT8 groups   w[n, k] = scale[n, k // g] * q[n, k]
                  q int8 [N, K] (-128..127), scale [N, K/g] float (fp16 or fp32, as the source gives), g a
                  power of two >= 16. GGUF's Q8_0 (q, d fp16 per 32) and Q6_K (q - 32, d * sc fp32 per 16:
                  an fp16 times an int8, exact) are exactly this; so is Q4_0 (q - 8, d fp16 per 32).
    FP8 (e4m3)    w[n, k] = float(q[n, k]) * scale[n]                       per output channel, scale [N]
                  w[n, k] = float(q[n, k]) * scale[n // bn, k // bk]        blocks, scale [ceil(N/bn), ceil(K/bk)]
                  activations quantised per token at run time (dynamic): x = float(xq[m, k]) * xs[m]

The reference dequantisation computes in fp32 (each product above is exact there: a bf16/fp16 scale times a
4-bit integer or an int8 (at most 11 + 7 significant bits), Q6_K's fp32 d * sc times q - 32 (at most
11 + 7 + 5 bits), or an fp8 value times an fp32 scale rounded once) and then casts: the same bits a format's own
dequantisation gives when it computes in the target dtype, since both round the exact value once. The offset
form's scale * q is exact in fp32 too (Q4_K's d * sc has at most 17 significant bits, times 4 bits) and its
subtraction rounds once, as gguf's own fp32 dequantisation does: the same fp32 bits; a cast to bf16/fp16 then
rounds that value a second time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn


class Scheme(enum.Enum):
    W4A16 = "w4a16"   # int4 weight groups, activations in the model's dtype
    FP8 = "fp8"       # fp8 e4m3 weights, per channel or in blocks; activations fp8 per token at run time
    W8A16 = "w8a16"   # int8 weight groups (GGUF Q8_0 / Q6_K), activations in the model's dtype


@dataclass(frozen=True)
class Int4Weight:
    q: torch.Tensor                      # uint8 [N, K], values 0..15
    scale: torch.Tensor                  # [N, K // group], float
    zero: torch.Tensor | None            # uint8 [N, K // group], 0..15; None: symmetric (8), or the offset form
    group: int
    offset: torch.Tensor | None = None   # float [N, K // group]: w = scale * q - offset (then zero is None)

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if k % self.group:
            raise ValueError(f"group size {self.group} does not divide the input width {k}")
        if tuple(self.scale.shape) != (n, k // self.group):
            raise ValueError(f"scale shape {tuple(self.scale.shape)}, expected {(n, k // self.group)}")
        if self.zero is not None and tuple(self.zero.shape) != (n, k // self.group):
            raise ValueError(f"zero point shape {tuple(self.zero.shape)}, expected {(n, k // self.group)}")
        if self.offset is not None:
            if self.zero is not None:
                raise ValueError("an int4 weight has a zero point or an offset, not both")
            if tuple(self.offset.shape) != (n, k // self.group) or not self.offset.is_floating_point():
                raise ValueError(f"offset {self.offset.dtype} {tuple(self.offset.shape)}, expected a float "
                                 f"{(n, k // self.group)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def to(self, device: torch.device | str) -> "Int4Weight":
        """The same weight on `device` (every tensor copied as it is)."""
        moved = [None if t is None else t.to(device) for t in (self.q, self.scale, self.zero, self.offset)]
        return Int4Weight(moved[0], moved[1], moved[2], self.group, moved[3])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scale = self.scale.float().repeat_interleave(self.group, dim=1)
        if self.offset is not None:
            return (scale * self.q.float() - self.offset.float().repeat_interleave(self.group, dim=1)).to(dtype)
        zero = 8.0 if self.zero is None else self.zero.float().repeat_interleave(self.group, dim=1)
        return (scale * (self.q.float() - zero)).to(dtype)


def check_group(group: int, k: int, what: str) -> None:
    """A kernel group: a power of two >= 16 (a tl.dot step) that divides the input width K."""
    if group < 16 or group & (group - 1):
        raise ValueError(f"{what} group size {group} is not a power of two >= 16")
    if k <= 0 or k % group:
        raise ValueError(f"{what} group size {group} does not divide the input width K = {k}")


@dataclass(frozen=True)
class Int8Weight:
    q: torch.Tensor       # int8 [N, K]
    scale: torch.Tensor   # [N, K // group], float (fp16 or fp32, as the source gives)
    group: int            # a power of two >= 16

    def __post_init__(self) -> None:
        if self.q.dtype != torch.int8 or self.q.dim() != 2:
            raise ValueError(f"int8 weight values {self.q.dtype} {tuple(self.q.shape)}, expected torch.int8 [N, K]")
        n, k = self.q.shape
        check_group(self.group, k, "int8")
        if tuple(self.scale.shape) != (n, k // self.group) or not self.scale.is_floating_point():
            raise ValueError(f"int8 scale {self.scale.dtype} {tuple(self.scale.shape)}, expected a float "
                             f"{(n, k // self.group)} (one per {self.group} inputs)")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def to(self, device: torch.device | str) -> "Int8Weight":
        """The same weight on `device` (every tensor copied as it is)."""
        return Int8Weight(self.q.to(device), self.scale.to(device), self.group)

    def regroup(self, group: int, scale_dtype: torch.dtype | None = None) -> "Int8Weight":
        """The same weight in groups of `group` (dividing this one's: each scale repeated) with scales cast to
        `scale_dtype` (default: kept); exact where the cast is (fp16 -> fp32)."""
        if group > self.group or self.group % group:
            raise ValueError(f"int8 groups of {self.group} cannot be split into groups of {group}")
        scale = self.scale.repeat_interleave(self.group // group, dim=1)
        return Int8Weight(self.q, scale.to(scale_dtype or scale.dtype), group)

    @staticmethod
    def cat(parts: list["Int8Weight"]) -> "Int8Weight":
        """Parts stacked along the output rows (fused q/k/v, gate/up): the smallest group of any part, scales
        fp16 where every part's are, else fp32 (exact: a float of <= 24 significant bits)."""
        group = min(p.group for p in parts)
        dtype = torch.float16 if all(p.scale.dtype == torch.float16 for p in parts) else torch.float32
        parts = [p.regroup(group, dtype) for p in parts]
        return Int8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), group)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """fp32 scale * q (exact for the formats above), cast to `dtype`: the format's reference."""
        return (self.scale.float().repeat_interleave(self.group, dim=1) * self.q.float()).to(dtype)


@dataclass(frozen=True)
class Fp8Weight:
    q: torch.Tensor                        # float8_e4m3fn [N, K]
    scale: torch.Tensor                    # float32 [N] (per channel) or [ceil(N/bn), ceil(K/bk)] (blocks)
    block: tuple[int, int] | None = None   # (bn, bk), e.g. (128, 128); None: per channel

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.q.dtype != FP8_DTYPE:
            raise ValueError(f"fp8 weights must be {FP8_DTYPE}, got {self.q.dtype}")
        want = (n,) if self.block is None else (-(-n // self.block[0]), -(-k // self.block[1]))
        if tuple(self.scale.shape) != want:
            raise ValueError(f"fp8 scale shape {tuple(self.scale.shape)}, expected {want}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.q.shape
        if self.block is None:
            scale = self.scale.float()[:, None]
        else:
            bn, bk = self.block
            scale = self.scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        return (self.q.float() * scale).to(dtype)


def quantize_fp8_per_channel(w: torch.Tensor, amax: torch.Tensor | None = None) -> Fp8Weight:
    """A float weight [N, K] to fp8 with one fp32 scale per output row (amax / 448), as `--quantization fp8`
    does at load; a zero row gets scale 1. `amax` [N]: the rows' amax where `w` holds only some of each row's
    columns (a tensor-parallel rank's slice, scaled as the whole row is); default: w's own."""
    amax = w.float().abs().amax(dim=1) if amax is None else amax.float()
    scale = torch.where(amax > 0, amax / torch.finfo(FP8_DTYPE).max, torch.ones_like(amax))
    q = (w.float() / scale[:, None]).clamp(-torch.finfo(FP8_DTYPE).max, torch.finfo(FP8_DTYPE).max).to(FP8_DTYPE)
    return Fp8Weight(q, scale)


def quantize_int4_groups(w: torch.Tensor, group: int, scale_dtype: torch.dtype = torch.bfloat16) -> Int4Weight:
    """A float weight [N, K] to symmetric int4 groups by rounding to nearest (no calibration): scale = amax / 7.5
    per group as compressed-tensors computes it, stored in `scale_dtype`, q = clamp(round(w / scale), -8, 7) + 8.
    For benchmarks at real shapes; checkpoints quantised with calibration (GPTQ, QAT) are read as saved."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"group size {group} does not divide the input width {k}")
    wg = w.float().view(n, k // group, group)
    amax = wg.abs().amax(-1)
    scale = torch.where(amax > 0, amax / 7.5, torch.ones_like(amax)).to(scale_dtype)
    q = (wg / scale.float()[..., None]).round().clamp(-8, 7).add(8).to(torch.uint8).view(n, k)
    return Int4Weight(q, scale, None, group)

"""The int8 group product (quantization/int8_kernels.py) against the fp32 dequantisation of schemes.Int8Weight:
the Triton kernels in Triton's interpreter (conftest sets TRITON_INTERPRET=1 without a GPU), each regime forced
(GEMV with a real K split, the tiled kernel split and unsplit), fp32 activations so that only fp32 summation order
differs; the packed layout's round trip; the weight's own contract (regrouping, fused parts); shape errors."""

import os

import pytest
import torch

from helpers import fresh_seed

triton = pytest.importorskip("triton")
from gemmaserve.quantization import int8_kernels as I8  # noqa: E402
from gemmaserve.quantization.schemes import Int8Weight  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def _int8(gen, n, k, group, scale_dtype=torch.float32) -> Int8Weight:
    """Every int8 value (-128 and 127 included), scales as Q8_0's (fp16) or Q6_K's (fp32)."""
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    q[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)
    scale = (torch.rand(n, k // group, generator=gen) * 2e-3 + 1e-4).to(scale_dtype)
    return Int8Weight(q, scale, group)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


# (M, N, K, group): each regime's row tiles partly filled, N not a multiple of the column tile.
CASES = [(1, 48, 256, 16), (3, 40, 256, 32), (4, 72, 128, 64), (17, 40, 128, 16), (33, 80, 256, 32)]


def _regimes(m, k, group):
    """The GEMV with a real K split (a step crossing groups, a slice ending inside a step), the tiled kernel split
    along K (decode tiles) and unsplit (prefill tiles)."""
    bk = min(group, 32)
    regimes = {"split_k": I8.Int8Config(16, 32, bk, max(bk, k // 4), 4, 2),
               "gemm": I8.Int8Config(64, 64, min(group, 64), k, 4, 2)}
    if m <= 4:   # the GEMV takes up to 4 rows (int8_gemv_config: one)
        regimes["gemv"] = I8.Int8Config(triton.next_power_of_2(m), 32, 32, k // 4, 4, 1, gemv=True)
        regimes["gemv_ragged"] = I8.Int8Config(4, 32, 64, 96, 4, 1, gemv=True)
    return regimes


@interpreted
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("m, n, k, group", CASES)
def test_int8_kernel_matches_the_fp32_dequantisation(m, n, k, group, scale_dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    w = _int8(gen, n, k, group, scale_dtype)
    packed = I8.pack_int8(w)
    x = torch.randn(m, k, generator=gen)
    ref = x.double() @ w.dequantize(torch.float32).double().t()
    for name, cfg in _regimes(m, k, group).items():
        assert name not in ("split_k", "gemv", "gemv_ragged") or cfg.splits(k) > 1
        y = I8.int8_linear(x, packed, cfg)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        assert _rel(y, ref) < 1e-6, f"seed={seed} {name}: {_rel(y, ref)}"
    assert _rel(I8.int8_linear(x, packed), ref) < 1e-6   # the heuristic's own choice
    assert _rel(I8.int8_linear_reference(x, packed), ref) < 1e-6


@interpreted
def test_int8_leading_dims_and_half_activations():
    """x [2, 3, K] keeps its leading dims; half-precision x (the integers are exact there, the output rounded
    once): bf16 through the GEMV, fp16 through the tiled kernel (the interpreter's tl.dot gives garbage for bf16
    operands, the int4 kernel's as well; benchmarks/gpu_quant checks bf16 on the GPU)."""
    gen = torch.Generator().manual_seed(fresh_seed())
    w = _int8(gen, 24, 64, 16, torch.float16)
    packed = I8.pack_int8(w)
    x = torch.randn(2, 3, 64, generator=gen)
    y = I8.int8_linear(x, packed)
    ref = x.reshape(6, 64).double() @ w.dequantize().double().t()
    assert y.shape == (2, 3, 24) and _rel(y.reshape(6, 24), ref) < 1e-6
    gemv = I8.int8_gemv_config(24, 64, 8)
    for rows, cfg in ((x[:1, :1].to(torch.bfloat16), gemv), (x.to(torch.float16), None)):   # GEMV, tiled kernel
        yh = I8.int8_linear(rows, packed, cfg)
        assert yh.dtype == rows.dtype and yh.shape == rows.shape[:-1] + (24,)
        refh = rows.reshape(-1, 64).double() @ w.dequantize().double().t()
        assert _rel(yh.reshape(-1, 24), refh) < 1e-2, rows.dtype


def test_pack_int8_round_trip_is_exact():
    gen = torch.Generator().manual_seed(fresh_seed())
    w = _int8(gen, 40, 128, 16, torch.float16)
    w.q[0, :4] = torch.tensor([-128, 127, -1, 5], dtype=torch.int8)   # word (0, 0): sign bit set
    p = I8.pack_int8(w)
    assert p.qweight.dtype == torch.int32 and p.qweight.shape == (32, 40) and p.qweight.is_contiguous()
    assert p.scale.dtype == torch.float16 and p.scale.shape == (8, 40)
    # The documented layout: word (r, n), bits 8i..8i+7, is q[n, 4r + i] in two's complement.
    word = int(p.qweight[0, 0]) & 0xFFFFFFFF
    assert [(word >> (8 * i)) & 0xFF for i in range(4)] == [0x80, 0x7F, 0xFF, 0x05]
    r, n = 5, 7
    assert [((int(p.qweight[r, n]) >> (8 * i)) & 0xFF) for i in range(4)] == \
        [int(v) & 0xFF for v in w.q[n, 4 * r:4 * r + 4]]
    u = I8.unpack_int8(p)
    assert torch.equal(u.q, w.q) and torch.equal(u.scale, w.scale) and u.group == w.group
    assert torch.equal(u.dequantize(), w.dequantize())
    assert p.nbytes == 32 * 40 * 4 + 8 * 40 * 2


def test_int8_weight_dequantizes_regroups_and_stacks_exactly():
    gen = torch.Generator().manual_seed(fresh_seed())
    w = _int8(gen, 8, 64, 32, torch.float16)
    s = w.scale.float().repeat_interleave(32, 1)
    assert torch.equal(w.dequantize(), s * w.q.float())
    assert torch.equal(w.dequantize(torch.bfloat16), (s * w.q.float()).to(torch.bfloat16))
    r = w.regroup(16, torch.float32)   # a group of 32 as two groups of 16 with its scale: the same weight
    assert r.group == 16 and r.scale.dtype == torch.float32 and r.scale.shape == (8, 4)
    assert torch.equal(r.dequantize(), w.dequantize())
    v = _int8(gen, 4, 64, 16, torch.float32)
    both = Int8Weight.cat([w, v])
    assert both.group == 16 and both.scale.dtype == torch.float32 and both.shape == (12, 64)
    assert torch.equal(both.dequantize(), torch.cat([w.dequantize(), v.dequantize()]))
    same = Int8Weight.cat([w, w])   # fp16 parts of one group: kept as they are
    assert same.group == 32 and same.scale.dtype == torch.float16


def test_int8_bad_shapes_name_them():
    gen = torch.Generator().manual_seed(fresh_seed())
    p = I8.pack_int8(_int8(gen, 16, 64, 32))
    q = torch.zeros(16, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"\(3, 48\).*K = 64"):
        I8.int8_linear(torch.randn(3, 48), p)
    with pytest.raises(ValueError, match="int8 group size 48 is not a power of two >= 16"):
        Int8Weight(q, torch.ones(16, 1), 48)
    with pytest.raises(ValueError, match="int8 group size 8 is not a power of two >= 16"):
        Int8Weight(q, torch.ones(16, 8), 8)
    with pytest.raises(ValueError, match="int8 group size 32 does not divide the input width K = 48"):
        Int8Weight(torch.zeros(16, 48, dtype=torch.int8), torch.ones(16, 1), 32)
    with pytest.raises(ValueError, match=r"int8 scale torch.float32 \(16, 3\), expected a float \(16, 2\)"):
        Int8Weight(q, torch.ones(16, 3), 32)
    with pytest.raises(ValueError, match=r"int8 scale torch.int32 \(16, 2\), expected a float"):
        Int8Weight(q, torch.ones(16, 2, dtype=torch.int32), 32)
    with pytest.raises(ValueError, match=r"int8 weight values torch.uint8 \(16, 64\), expected torch.int8"):
        Int8Weight(q.to(torch.uint8), torch.ones(16, 2), 32)
    with pytest.raises(ValueError, match=r"packed int8 scale torch.float32 \(3, 16\).*\(2, 16\)"):
        I8.Int8Packed(p.qweight, torch.ones(3, 16), 16, 64, 32)
    with pytest.raises(ValueError, match=r"packed int8 weight torch.int32 \(16, 17\).*\(16, 16\)"):
        I8.Int8Packed(torch.zeros(16, 17, dtype=torch.int32), p.scale, 16, 64, 32)
    with pytest.raises(ValueError, match="cannot be split into groups of 64"):
        Int8Weight(q, torch.ones(16, 2), 32).regroup(64)
    with pytest.raises(ValueError, match="block_k must divide the group 32"):
        I8.int8_linear(torch.randn(5, 64), p, I8.Int8Config(16, 32, 64, 64, 4, 2))
    with pytest.raises(ValueError, match="at most block_m = 1 rows, got 3"):
        I8.int8_linear(torch.randn(3, 64), p, I8.Int8Config(1, 32, 32, 64, 4, 1, gemv=True))


def test_int8_reference_without_the_interpreter(monkeypatch):
    """Off CUDA and outside the interpreter, int8_linear is the fp32 reference (the CPU's fallback)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen = torch.Generator().manual_seed(fresh_seed())
    w = _int8(gen, 24, 64, 16)
    x = torch.randn(5, 64, generator=gen)
    ref = (x.double() @ w.dequantize().double().t()).float()
    assert torch.allclose(I8.int8_linear(x, I8.pack_int8(w)), ref, rtol=1e-6, atol=1e-6)
    assert I8.int8_linear(x.to(torch.bfloat16), I8.pack_int8(w)).dtype == torch.bfloat16


def test_quantized_linear_holds_int8_groups():
    """QuantizedLinear over an Int8Weight: on the CPU the fp32 reference with the module's `matmul` (the loader's
    row-invariant product); packed (as on CUDA) the kernel, here in the interpreter; the label; no checkpoint form."""
    from gemmaserve.quantization.compressed_tensors import ModuleQuant
    from gemmaserve.quantization.linear import QuantizedLinear
    from gemmaserve.quantization.schemes import Scheme

    gen = torch.Generator().manual_seed(fresh_seed())
    w = _int8(gen, 40, 128, 16)
    quant = ModuleQuant(Scheme.W8A16, 16)
    mod = QuantizedLinear.from_weight("proj", w, quant)
    assert mod.kernel_weight is w and (mod.in_features, mod.out_features) == (128, 40)
    assert torch.equal(mod.dequantize(), w.dequantize()) and quant.label == "w8a16 g16"
    calls = []
    mod.matmul = lambda a, b: calls.append(a.shape) or torch.nn.functional.linear(a, b)
    x = torch.randn(2, 3, 128, generator=gen)
    ref = (x.reshape(6, 128).double() @ w.dequantize().double().t()).reshape(2, 3, 40)
    y = mod(x)
    assert calls == [(6, 128)] and y.shape == (2, 3, 40) and _rel(y, ref) < 1e-6
    mod.kernel_weight = I8.pack_int8(w)   # the layout a CUDA module holds
    assert torch.equal(mod.dequantize(), w.dequantize())
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert _rel(mod(x), ref) < 1e-6 and len(calls) == 1
    with pytest.raises(ValueError, match="W8A16 has no checkpoint tensors"):
        QuantizedLinear("proj", 128, 40, quant, torch.float32)

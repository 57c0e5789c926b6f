"""The quantised products (quantization/int4_kernels.py, fp8_kernels.py) against the fp32 dequantisation of
schemes.py: the Triton kernels in Triton's interpreter (conftest sets TRITON_INTERPRET=1 without a GPU), each
regime forced (decode split-K, tiled GEMM), fp32 activations so that only fp32 summation order differs; the
packed layout's round trip; fp8 activation quantisation; and the shape errors."""

import os

import pytest
import torch

from helpers import fresh_seed

triton = pytest.importorskip("triton")
from gemmaserve.quantization import fp8_kernels as F8  # noqa: E402
from gemmaserve.quantization import int4_kernels as I4  # noqa: E402
from gemmaserve.quantization.schemes import FP8_DTYPE, Fp8Weight, Int4Weight, quantize_fp8_per_channel  # noqa: E402

# The kernel tests need the interpreter (conftest's default without a GPU); elsewhere CPU tensors take the
# reference path and these would compare it with itself. benchmarks/gpu_quant checks the kernels on CUDA.
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def _int4(gen, n, k, group, asym, scale_dtype=torch.bfloat16) -> Int4Weight:
    """`asym`: False (symmetric), True (zero points) or "offset" (w = s q - o, fp32 scales and offsets as Q4_K's)."""
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    if asym == "offset":
        scale = torch.rand(n, k // group, generator=gen) * 0.02 + 0.001
        return Int4Weight(q, scale, None, group, scale * torch.rand(n, k // group, generator=gen) * 15)
    scale = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).to(scale_dtype)
    zero = torch.randint(0, 16, (n, k // group), generator=gen, dtype=torch.uint8) if asym else None
    return Int4Weight(q, scale, zero, group)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


# (M, N, K, group): each regime's row tiles partly filled, N not a multiple of the column tile.
INT4_CASES = [(1, 48, 128, 32), (3, 96, 256, 128), (17, 16, 64, 32), (33, 80, 256, 32), (1, 40, 256, 128)]


def _regimes(m, n, k, group):
    """The decode regime with a real K split (several slices, their partials summed), and the tiled regime unsplit."""
    bk = min(group, 32)
    regimes = {"split_k": I4.Int4Config(16, 32, bk, max(bk, k // 4), 4, 2),
               "gemm": I4.Int4Config(64, 64, min(group, 64), k, 4, 2),
               "gemm_nibble_major": I4.Int4Config(64, 64, min(group, 64), k, 4, 2, nibble_major=True),
               # steps spanning groups, weights dequantised in the tile (exact in fp32 for fp32 x)
               "gemm_scaled": I4.Int4Config(16, 32, 64, k, 4, 2, nibble_major=True, scaled=True),
               "split_k_scaled": I4.Int4Config(16, 32, 64, max(64, k // 2 // 64 * 64), 4, 2, scaled=True)}
    if m <= 4:   # the GEMV takes up to 4 rows (int4_gemv_config: one); a step of 64 K values crossing
                 # groups of 32, a slice ending inside a step
        regimes["gemv"] = I4.Int4Config(triton.next_power_of_2(m), 32, 64, max(64, k // 4), 4, 1, gemv=True)
        regimes["gemv_ragged"] = I4.Int4Config(4, 32, 128, 192 if k > 192 else k, 4, 1, gemv=True)
        regimes["gemv_prefetch"] = I4.Int4Config(triton.next_power_of_2(m), 32, 64, max(64, k // 4) + 32, 4, 1,
                                                 gemv=True, prefetch=True)
    return regimes


FORMS = pytest.mark.parametrize("asym", [False, True, "offset"], ids=["sym", "asym", "offset"])


@interpreted
@FORMS
@pytest.mark.parametrize("m, n, k, group", INT4_CASES)
def test_int4_kernel_matches_the_fp32_dequantisation(m, n, k, group, asym):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    w = _int4(gen, n, k, group, asym)
    packed = I4.pack_int4(w)
    x = torch.randn(m, k, generator=gen)
    ref = x.double() @ w.dequantize(torch.float32).double().t()
    for name, cfg in _regimes(m, n, k, group).items():
        assert name != "split_k" or cfg.splits(k) > 1
        y = I4.int4_linear(x, packed, cfg)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        assert _rel(y, ref) < 1e-6, f"seed={seed} {name}: {_rel(y, ref)}"
    assert _rel(I4.int4_linear(x, packed), ref) < 1e-6   # the heuristic's own choice
    assert _rel(I4.int4_linear_reference(x, packed), ref) < 1e-6


@interpreted
@FORMS
def test_a_rows_bits_do_not_depend_on_its_batch_up_to_small_m(asym):
    """The heuristic gives every M up to SMALL_M the same tiles and split: a token decoded alone, beside others or
    in a speculative verification gets the same bits (fails if one row took another kernel or split)."""
    gen = torch.Generator().manual_seed(fresh_seed())
    packed = I4.pack_int4(_int4(gen, 40, 512, 32, asym))
    x = torch.randn(I4.SMALL_M, 512, generator=gen)
    full = I4.int4_linear(x, packed)
    for m in (1, 2, 5):
        assert torch.equal(I4.int4_linear(x[:m], packed), full[:m]), m


@interpreted
def test_int4_leading_dims_and_fp16_scales():
    gen = torch.Generator().manual_seed(fresh_seed())
    w = _int4(gen, 24, 64, 32, True, torch.float16)
    x = torch.randn(2, 3, 64, generator=gen)
    y = I4.int4_linear(x, I4.pack_int4(w))
    ref = x.reshape(6, 64).double() @ w.dequantize().double().t()
    assert y.shape == (2, 3, 24) and _rel(y.reshape(6, 24), ref) < 1e-6


@FORMS
def test_pack_int4_round_trip_is_exact(asym):
    gen = torch.Generator().manual_seed(fresh_seed())
    w = _int4(gen, 40, 256, 32, asym)
    w.q[0, :8] = torch.tensor([15, 0, 7, 8, 15, 15, 15, 15], dtype=torch.uint8)   # sign bit set in word 0
    p = I4.pack_int4(w)
    assert p.qweight.dtype == torch.int32 and p.qweight.shape == (32, 40)
    assert p.has_zero == (asym is True) and p.has_offset == (asym == "offset")
    assert p.scale.dtype == w.scale.dtype and p.scale.shape == (8, 40)
    # The documented layout: word (r, n), bits 4i..4i+3, is q[n, 8r + i].
    assert int(p.qweight[0, 0]) & 0xF == 15 and (int(p.qweight[0, 0]) >> 8) & 0xF == 7
    u = I4.unpack_int4(p)
    assert torch.equal(u.q, w.q) and torch.equal(u.scale, w.scale) and u.group == w.group
    assert (u.zero is None) if asym is not True else torch.equal(u.zero, w.zero)
    assert (u.offset is None) if asym != "offset" else torch.equal(u.offset, w.offset)
    assert torch.equal(u.dequantize(), w.dequantize())
    assert p.nbytes == 32 * 40 * 4 + 8 * 40 * w.scale.element_size() + (8 * 40 * 4 if asym == "offset" else
                                                                         8 * 40 if asym else 0)


def test_int4_offset_form_dequantizes_as_s_q_minus_o():
    """w = s q - o with fp32 scale and offset: s q is exact in fp32 (Q4_K's d * sc times 4 bits), one rounding."""
    gen = torch.Generator().manual_seed(fresh_seed())
    w = _int4(gen, 8, 64, 32, "offset")
    s, o = w.scale.repeat_interleave(32, 1), w.offset.repeat_interleave(32, 1)
    assert torch.equal(w.dequantize(), s * w.q.float() - o)
    assert torch.equal(w.dequantize(torch.bfloat16), (s * w.q.float() - o).to(torch.bfloat16))


def test_int4_bad_shapes_name_them():
    gen = torch.Generator().manual_seed(fresh_seed())
    p = I4.pack_int4(_int4(gen, 16, 64, 32, False))
    with pytest.raises(ValueError, match=r"\(3, 48\).*K = 64"):
        I4.int4_linear(torch.randn(3, 48), p)
    with pytest.raises(ValueError, match="group size 48 does not divide the input width 64"):
        Int4Weight(torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 1), None, 48)
    with pytest.raises(ValueError, match=r"group size 24 is not a power of two"):
        I4.pack_int4(Int4Weight(torch.zeros(16, 48, dtype=torch.uint8), torch.ones(16, 2), None, 24))
    with pytest.raises(ValueError, match=r"scale shape \(16, 3\), expected \(16, 2\)"):
        Int4Weight(torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 3), None, 32)
    with pytest.raises(ValueError, match=r"packed int4 scale shape \(3, 16\).*\(2, 16\)"):
        I4.Int4Packed(p.qweight, torch.ones(3, 16), None, 16, 64, 32)
    with pytest.raises(ValueError, match=r"packed int4 weight .*\(8, 17\).*\(8, 16\)"):
        I4.Int4Packed(torch.zeros(8, 17, dtype=torch.int32), p.scale, None, 16, 64, 32)
    q, ones = torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 2)
    with pytest.raises(ValueError, match="a zero point or an offset, not both"):
        Int4Weight(q, ones, torch.zeros(16, 2, dtype=torch.uint8), 32, ones)
    with pytest.raises(ValueError, match=r"offset torch.float32 \(16, 1\), expected a float \(16, 2\)"):
        Int4Weight(q, ones, None, 32, torch.ones(16, 1))
    with pytest.raises(ValueError, match=r"packed int4 offset torch.int32 .*expected a float \(2, 16\)"):
        I4.Int4Packed(p.qweight, p.scale, None, 16, 64, 32, torch.ones(2, 16, dtype=torch.int32))


def test_quantize_activations_per_token():
    gen = torch.Generator().manual_seed(fresh_seed())
    x = torch.randn(5, 96, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 1e4])[:, None]
    xq, s = F8.quantize_activations_per_token(x)
    assert xq.dtype == FP8_DTYPE and xq.shape == (5, 96) and s.dtype == torch.float32 and s.shape == (5, 1)
    amax = x.abs().amax(1, keepdim=True)
    assert torch.equal(s[3], torch.ones(1)) and not xq[3].float().any()   # a zero row: scale 1, zeros
    live = [0, 1, 2, 4]
    assert torch.equal(s[live], amax[live] / 448)
    assert torch.equal(xq[live].float().abs().amax(1), torch.full((4,), 448.0))   # each row's peak hits 448
    # Exactly torch's round-to-nearest cast of x / scale: within half an e4m3 step (2^-4 relative, normals).
    assert torch.equal(xq, (x / s).to(FP8_DTYPE))
    err = (F8.dequantize_activations(xq, s) - x).abs()
    assert bool((err <= x.abs() * 2 ** -4 + s * 2 ** -10).all())
    # Values already on the fp8 grid (times the scale) come back exactly.
    on_grid = xq.float() * s
    xq2, s2 = F8.quantize_activations_per_token(on_grid)
    assert torch.equal(F8.dequantize_activations(xq2, s2), on_grid)


def test_quantize_activations_per_group_short_last_group():
    gen = torch.Generator().manual_seed(fresh_seed())
    x = torch.randn(3, 200, generator=gen)
    x[1, 64:128] = 0
    xq, s = F8.quantize_activations_per_group(x, 64)
    assert s.shape == (3, 4) and xq.shape == (3, 200) and s[1, 1] == 1
    for g in range(4):
        cols = slice(64 * g, min(200, 64 * g + 64))
        xq_g, s_g = F8.quantize_activations_per_token(x[:, cols])
        assert torch.equal(xq[:, cols], xq_g) and torch.equal(s[:, g:g + 1], s_g)


@interpreted
def test_activation_quant_kernel_rounds_like_torch():
    """The fused Triton quantisation gives torch's bits: every e4m3 binade, ties, subnormals, -0, the clamp."""
    gen = torch.Generator().manual_seed(fresh_seed())
    grid = torch.arange(-2000, 2001) * 2.0 ** -10                          # ties and subnormals (step 2^-9)
    v = torch.cat([torch.linspace(-448, 448, 30001), grid, torch.randn(20000, generator=gen) * 1e-2,
                   torch.tensor([-0.0, 0.0, 448.0, -448.0])])
    for x in (v[None], torch.stack([v, -v, v * 0]), v[None].to(torch.bfloat16)):
        for group in (x.shape[1], 16384):   # one program per row, or several with a short last group
            xq, s = F8.quantize_activations_per_group(x, group)
            m, k = x.shape
            pad = F8.F.pad(x.float(), (0, -(-k // group) * group - k)).reshape(m, -1, group)
            rq, rs = F8._quantize_rows(pad)
            assert torch.equal(s, rs.reshape(m, -1)), group
            assert torch.equal(xq.view(torch.uint8), rq.reshape(m, -1)[:, :k].contiguous().view(torch.uint8)), group


def _fp8_block(gen, n, k, block):
    q = (torch.randn(n, k, generator=gen) * 60).clamp(-448, 448).to(FP8_DTYPE)
    scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) * 1e-3 + 1e-4
    return Fp8Weight(q, scale, block)


# (M, N, K, block): a short last K group (200), N across scale blocks and tile edges.
FP8_CASES = [(1, 48, 256, (128, 128)), (3, 96, 256, (32, 64)), (17, 40, 200, (16, 32)), (33, 130, 256, (128, 128))]


@interpreted
@pytest.mark.parametrize("m, n, k, block", FP8_CASES)
def test_fp8_block_kernel_matches_its_reference(m, n, k, block):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    w = _fp8_block(gen, n, k, block)
    x = torch.randn(m, k, generator=gen)
    xq, xs = F8.quantize_activations_per_group(x, block[1])
    ref = F8.dequantize_activations(xq, xs, block[1]).double() @ w.dequantize().double().t()
    assert _rel(F8.fp8_linear_reference(x, w, torch.float32), ref) < 1e-6
    bk = block[1]
    configs = {"split_k": F8.BlockConfig(16, 32, bk, 4, 2), "gemm": F8.BlockConfig(64, 64, -(-k // bk) * bk, 4, 2),
               "default": None}
    for name, cfg in configs.items():
        assert name != "split_k" or -(-k // cfg.k_per_split) > 1
        y = F8.fp8_linear(x, w, torch.float32, cfg)
        assert y.shape == (m, n) and _rel(y, ref) < 1e-6, f"seed={seed} {name}: {_rel(y, ref)}"
    # The scheme quantises activations: a few percent from x @ w^T, which the reference keeps.
    assert _rel(F8.fp8_linear(x, w, torch.float32), x.double() @ w.dequantize().double().t()) > 1e-3


@interpreted
@pytest.mark.parametrize("m, n, k", [(1, 48, 384), (5, 40, 200), (33, 64, 256)])
def test_fp8_per_channel_kernel_matches_its_reference(m, n, k):
    """The Triton path small batches take on the GPU: raw fp8 sums, scales once at the end; K not a multiple
    of the step (masked), split into slices or not."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    w = quantize_fp8_per_channel(torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen)
    xq, xs = F8.quantize_activations_per_token(x)
    ref = F8.dequantize_activations(xq, xs).double() @ w.dequantize().double().t()
    for cfg in (F8.BlockConfig(16, 32, F8.CHANNEL_BK, 4, 2), F8.BlockConfig(64, 64, -(-k // 128) * 128, 4, 2)):
        y = F8.fp8_linear(x, w, torch.float32, cfg)
        assert y.shape == (m, n) and _rel(y, ref) < 1e-6, f"seed={seed} {cfg}: {_rel(y, ref)}"


def test_fp8_per_channel_reference_on_the_cpu():
    gen = torch.Generator().manual_seed(fresh_seed())
    w = quantize_fp8_per_channel(torch.randn(48, 96, generator=gen))
    x = torch.randn(2, 5, 96, generator=gen)
    y = F8.fp8_linear(x, w)
    xq, xs = F8.quantize_activations_per_token(x.reshape(10, 96))
    ref = (xq.double() * xs.double()) @ (w.q.double() * w.scale.double()[:, None]).t()
    assert y.shape == (2, 5, 48) and y.dtype == torch.float32 and _rel(y.reshape(10, 48), ref) < 1e-6
    assert F8.fp8_linear(x.to(torch.bfloat16), w).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"\(2, 5, 96\).*K = 96"):
        F8.fp8_linear(x, quantize_fp8_per_channel(torch.randn(48, 64, generator=gen)))
    with pytest.raises(ValueError, match=r"fp8 scale shape \(2, 2\), expected \(1, 1\)"):
        Fp8Weight(w.q[:16, :64].contiguous(), torch.ones(2, 2), (128, 128))

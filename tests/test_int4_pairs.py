"""The int4 pairs kernel (quantization/int4_pairs.py) in Triton's interpreter: the planes are the bf16-rounded
dequantised weights bit for bit, products match the fp32 product of those weights, a row's bits do not depend on
its batch, and what it does not take is refused. The PTX dequantisation itself runs only on CUDA
(benchmarks/gpu_quant `pairs` checks it there against the same references)."""

import os

import pytest
import torch

from helpers import fresh_seed

pytest.importorskip("triton")
from gemmaserve.quantization import int4_kernels as I4  # noqa: E402
from gemmaserve.quantization import int4_pairs as P  # noqa: E402
from gemmaserve.quantization.schemes import Int4Weight  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
FORMS = pytest.mark.parametrize("group, asym", [(32, False), (32, True), (128, True)], ids=["g32", "g32z", "g128z"])


def _weight(gen, n, k, group, asym) -> Int4Weight:
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    # scales of several binades, so that (q - zero) * scale needs rounding to bf16 (and ties occur)
    scale = (torch.rand(n, k // group, generator=gen) * 0.05 + 1e-3).to(torch.bfloat16)
    zero = torch.randint(0, 16, (n, k // group), generator=gen, dtype=torch.uint8) if asym else None
    return Int4Weight(q, scale, zero, group)


def _bf16_weight(w: Int4Weight) -> torch.Tensor:
    """The contract: the fp32 dequantisation rounded once to bf16 (what a bf16 checkpoint would hold)."""
    return w.dequantize(torch.float32).to(torch.bfloat16)


@interpreted
@FORMS
@pytest.mark.parametrize("swap", [False, True], ids=["x_left", "w_left"])
def test_planes_are_the_bf16_rounded_weights_bit_for_bit(group, asym, swap):
    """One-hot rows pick single weights: y[j, n] = w[n, k_j] exactly (one exact product, zeros elsewhere), for
    columns at every nibble position of a word and in several groups."""
    gen = torch.Generator().manual_seed(fresh_seed())
    n, k = 40, 256
    w = _weight(gen, n, k, group, asym)
    cols = torch.randperm(k, generator=gen)[:16]
    x = torch.zeros(16, k, dtype=torch.bfloat16)
    x[torch.arange(16), cols] = 1
    y = P.int4_pairs_linear(x, I4.pack_int4(w), P.PairsConfig(32, 16, 128, 4, 1, swap))
    assert torch.equal(y, _bf16_weight(w)[:, cols].t())


@interpreted
@FORMS
@pytest.mark.parametrize("swap", [False, True], ids=["x_left", "w_left"])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_pairs_product_matches_the_fp32_product_of_the_bf16_weights(m, group, asym, swap):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    n, k = 48, 384
    w = _weight(gen, n, k, group, asym)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    ref = x.double() @ _bf16_weight(w).double().t()
    # a K slice of 256 over K = 384: two slices, the second half a slice (masked steps)
    for cfg in (P.PairsConfig(16, 16, 256, 4, 1, swap), P.PairsConfig(64, 32, 256, 4, 1, swap)):
        y = P.int4_pairs_linear(x, I4.pack_int4(w), cfg)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        # bf16 output rounding (half an ulp) plus fp32 summation order
        assert ((y.double() - ref).abs() <= ref.abs() * 2.0 ** -8 + 1e-4 * ref.abs().max()).all(), (seed, cfg)


@interpreted
def test_a_rows_bits_do_not_depend_on_its_batch():
    gen = torch.Generator().manual_seed(fresh_seed())
    packed = I4.pack_int4(_weight(gen, 40, 512, 32, True))
    x = torch.randn(P.SMALL_M, 2, 512, generator=gen).to(torch.bfloat16).reshape(-1, 512)[:P.SMALL_M]
    full = P.int4_pairs_linear(x, packed)
    for m in (1, 2, 7):
        assert torch.equal(P.int4_pairs_linear(x[:m], packed), full[:m]), m


@interpreted
def test_what_the_pairs_kernel_does_not_take_is_refused():
    gen = torch.Generator().manual_seed(fresh_seed())
    w = _weight(gen, 16, 64, 32, False)
    packed = I4.pack_int4(w)
    with pytest.raises(ValueError, match="bf16 rows up to 16"):
        P.int4_pairs_linear(torch.randn(1, 64), packed)   # fp32 rows
    with pytest.raises(ValueError, match="bf16 rows up to 16"):
        P.int4_pairs_linear(torch.randn(17, 64).to(torch.bfloat16), packed)
    fp16 = I4.pack_int4(Int4Weight(w.q, w.scale.to(torch.float16), None, 32))
    with pytest.raises(ValueError, match="bf16 scales"):
        P.int4_pairs_linear(torch.randn(1, 64).to(torch.bfloat16), fp16)
    with pytest.raises(ValueError, match="block_kw"):
        P.int4_pairs_linear(torch.randn(1, 64).to(torch.bfloat16), packed, P.PairsConfig(16, 8, 64, 4, 1))

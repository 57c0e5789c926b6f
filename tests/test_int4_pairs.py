"""The int4 pairs kernel (quantization/int4_pairs.py) in Triton's interpreter: the planes are the bf16-rounded
dequantised weights bit for bit, products match the fp32 product of those weights, a row's bits do not depend on
its batch, and what it does not take is refused. The PTX dequantisation itself runs only on CUDA
(benchmarks/gpu_quant `pairs` checks it there against the same references)."""

import os

import pytest
import torch

from helpers import fresh_seed

triton = pytest.importorskip("triton")
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


def _bf16_bits(v: float) -> int:
    return int(torch.tensor([v], dtype=torch.float32).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF


def _bf16_value(bits: int) -> float:
    return torch.tensor([bits - (1 << 16) * (bits >> 15)], dtype=torch.int16).view(torch.bfloat16).float().item()


def _run_ptx(asm: str, regs: dict[str, int]) -> dict[str, int]:
    """The PTX instructions of the dequantising asm (`_DEQUANT_ASM`), 32-bit registers as Python ints; fma.rn.bf16x2
    on each half, exact then rounded once to bf16 (the operands here are small integers and bf16 scales, so the
    exact value fits fp32 and torch's fp32 -> bf16 conversion, to nearest even, is the single rounding)."""
    regs = dict(regs)

    def val(tok: str) -> int:
        return int(tok, 0) if tok[0].isdigit() else regs[tok]

    def fma_half(a: int, b: int, c: int) -> int:
        return _bf16_bits(_bf16_value(a) * _bf16_value(b) + _bf16_value(c))

    for line in asm.strip("{}\n").splitlines():
        if not line or line.startswith(".reg"):
            continue
        op, args = line.rstrip(";").split(" ", 1)
        dst, *src = [t.strip() for t in args.split(",")]
        v = [val(t) for t in src]
        if op == "mov.b32":
            regs[dst] = v[0]
        elif op == "prmt.b32":   # result byte j = byte (selector nibble j) of the eight bytes src1:src0
            pool = v[0] | v[1] << 32
            regs[dst] = sum(((pool >> 8 * ((v[2] >> 4 * j) & 7)) & 0xFF) << 8 * j for j in range(4))
        elif op == "shr.b32":
            regs[dst] = v[0] >> v[1]
        elif op == "and.b32":
            regs[dst] = v[0] & v[1]
        elif op == "or.b32":
            regs[dst] = v[0] | v[1]
        elif op == "fma.rn.bf16x2":
            regs[dst] = fma_half(v[0] & 0xFFFF, v[1] & 0xFFFF, v[2] & 0xFFFF) | \
                fma_half(v[0] >> 16, v[1] >> 16, v[2] >> 16) << 16
        else:
            raise AssertionError(f"unexpected instruction {op}")
    return regs


def test_the_dequantising_ptx_gives_the_bf16_rounded_weights():
    """What runs on CUDA, emulated instruction by instruction: for two packed words (a, b) with their zero points
    and bf16 scales, output plane i holds bf16((nibble i - zero) * scale) of word a in its low half and of word b
    in its high half, rounded once, the very bits the interpreter's planes and the contract give."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    asm = P._DEQUANT_ASM.value
    for _ in range(48):
        a, b = torch.randint(0, 2 ** 32, (2,), generator=gen, dtype=torch.int64).tolist()
        za, zb = torch.randint(0, 16, (2,), generator=gen).tolist()
        sa, sb = (torch.rand(2, generator=gen) * 0.05 + 1e-3).to(torch.bfloat16).float().tolist()
        regs = _run_ptx(asm, {"$8": a, "$9": b, "$10": _bf16_bits(-128.0 - za) | _bf16_bits(-128.0 - zb) << 16,
                              "$11": _bf16_bits(sa) | _bf16_bits(sb) << 16})
        for i in range(8):
            got = regs[f"${i}"]
            want = [_bf16_bits(((w >> 4 * i & 15) - z) * s) for w, z, s in ((a, za, sa), (b, zb, sb))]
            assert [got & 0xFFFF, got >> 16] == want, (seed, i, hex(a), hex(b))

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


def _run_ptx(asm: str, a: int, b: int) -> int:
    """The few PTX instructions of a one-plane asm (`_unary_asm`), on two packed words: the plane ($0)."""
    regs = {"$1": a, "$2": b}

    def val(tok: str) -> int:
        return int(tok, 0) if tok[0].isdigit() else regs[tok]

    for line in asm.strip("{}\n").splitlines():
        if not line or line.startswith(".reg"):
            continue
        op, args = line.rstrip(";").split(" ", 1)
        dst, *src = [t.strip() for t in args.split(",")]
        if op == "prmt.b32":   # result byte k = byte (selector nibble k) of the eight bytes b:a
            pool = val(src[0]) | val(src[1]) << 32
            regs[dst] = sum(((pool >> 8 * ((val(src[2]) >> 4 * k) & 7)) & 0xFF) << 8 * k for k in range(4))
        elif op == "shr.b32":
            regs[dst] = val(src[0]) >> val(src[1])
        elif op == "and.b32":
            regs[dst] = val(src[0]) & val(src[1])
        elif op == "or.b32":
            regs[dst] = val(src[0]) | val(src[1])
        else:
            raise AssertionError(f"unexpected instruction {op}")
    return regs["$0"]


def test_each_plane_asm_gives_its_nibble_of_both_words_as_bf16_128_plus_q():
    """The one-plane PTX (what runs on CUDA) emulated: plane i of words (a, b) holds bf16(128 + nibble i of a) in
    its low half and of b in its high half, and its byte selector is the eight-plane asm's for the same pair."""
    gen = torch.Generator().manual_seed(fresh_seed())
    words = torch.randint(0, 2 ** 32, (64, 2), generator=gen, dtype=torch.int64).tolist()
    for i in range(8):
        asm = P._unary_asm(i).value
        assert asm.split("prmt.b32 p, $1, $2, ")[1].split(";")[0] in P._DEQUANT_ASM.value
        for a, b in words:
            got = _run_ptx(asm, a, b)
            lo, hi = (torch.tensor([got & 0xFFFF, got >> 16], dtype=torch.int32).to(torch.int16)
                      .view(torch.bfloat16).float().tolist())
            assert (lo, hi) == (128 + (a >> 4 * i & 15), 128 + (b >> 4 * i & 15)), (i, hex(a), hex(b))


@interpreted
@FORMS
def test_the_unary_form_gives_the_same_bits(group, asym):
    """`unary` changes only how the GPU builds the planes: in the interpreter (and on CUDA, gpu_quant
    `pairs_unary`) the same tiles give the same bits, zero points included."""
    gen = torch.Generator().manual_seed(fresh_seed())
    packed = I4.pack_int4(_weight(gen, 48, 384, group, asym))
    x = torch.randn(5, 384, generator=gen).to(torch.bfloat16)
    cfg = P.PairsConfig(32, 16, 256, 4, 1, True)
    assert torch.equal(P.int4_pairs_linear(x, packed, cfg),
                       P.int4_pairs_linear(x, packed, P.PairsConfig(32, 16, 256, 4, 1, True, unary=True)))


_COMPILE_SM90 = """
import json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
from gemmaserve.quantization import int4_pairs as P

def ttgir(unary, stages):
    sig = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "y_ptr": "*fp32", "M": "i32",
           "N": "i32", "K": "i32", "k_per_split": "i32", "s_xm": "i32", "s_xk": "constexpr", "s_ym": "i32",
           "s_yn": "constexpr", **{c: "constexpr" for c in ("GROUP", "HAS_ZERO", "BM", "BN", "BKW", "SWAP", "ASM",
                                                              "UNARY")}}
    consts = {"s_xk": 1, "s_yn": 1, "GROUP": 32, "HAS_ZERO": False, "BM": 16, "BN": 64, "BKW": 16, "SWAP": True,
              "ASM": True, "UNARY": unary}
    k = triton.compile(ASTSource(fn=P._int4_pairs_kernel, signature=sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": stages})
    lines = k.asm["ttgir"].splitlines()
    return {"planes_in_shared": sum(".local_alloc" in ln and "(tensor<64x16xbf16" in ln for ln in lines),
            "words_to_dot": any(".local_load" in ln and "64x16xi32" in ln and "dot_op" in ln for ln in lines)}

print(json.dumps({"unary": ttgir(True, 1), "eight": ttgir(False, 3)}))
"""


def test_on_hopper_the_unary_form_converts_words_not_planes():
    """Compiled for sm_90 (no GPU needed; in a process of its own, outside the interpreter): with one asm per plane
    and no software pipelining, Triton moves the conversion to the dot's register layout onto the packed words and
    scales, so the one [BN, BKW] bf16 tile through shared memory is the scales'; the eight-output asm sends all eight
    planes there. This is what made the unary form pay."""
    import json
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_SM90], capture_output=True, text=True, env=env, timeout=300)
    if run.returncode and "ptxas" in run.stderr:
        pytest.skip(f"cannot compile for sm_90 on this host: {run.stderr[-300:]}")
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["eight"]["planes_in_shared"] == 8          # the eight planes
    assert got["unary"] == {"planes_in_shared": 1, "words_to_dot": True}   # the scales only

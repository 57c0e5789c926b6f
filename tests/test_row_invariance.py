"""A request's output does not depend on its batch: on the CPU every kernel computes each row by itself,
so a prompt's logits are the same bits alone, twice in one batch, at any place in a mixed batch, chunked
any way, with its prefix cached or not, on V1 or V2, eager or compiled.

Kernel level: the properties the model code relies on (the products' own summation order, exactly as
documented and the same for a row in any batch on 1 or 2 threads; the start-up check that names a kernel
where it is not; the C++ kernels against their Python kernels; attention the same for a query however it
is batched). Engine level: tiny random Gemma 3 (fp32 and quantised) and Gemma 4 variants, every generated
token's logprobs compared bit for bit (they are the logits' log-softmax: equal logits, equal logprobs). The
embedded 270M in batches of 1-16: test_embedded_batches.py."""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from gemmaserve import LLM, SamplingParams
from gemmaserve.attention.blockwise import KEY_BLOCK, attend, attend_reference, block_span
from gemmaserve.config.engine import EngineConfig
from gemmaserve.models import cpu_library, cpu_products, fused_ops, layers
from gemmaserve.models.fused_ops import NormKind
from gemmaserve.models.quant import Int8Kernel

from helpers import GEMMA4_VARIANTS, fresh_seed, save_checkpoint, tiny_gemma4_hf, tiny_hf_model


# -- kernels ------------------------------------------------------------------------------------------
def _fma32(a: float, b: float, c: float) -> float:
    """fp32 a * b + c rounded once (to nearest, ties to even), computed exactly with fractions."""
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    if exact == 0:
        return 0.0
    sign, mag = (-1 if exact < 0 else 1), abs(exact)
    e = math.floor(math.log2(mag.numerator) - math.log2(mag.denominator))
    while Fraction(2) ** e > mag:
        e -= 1
    while Fraction(2) ** (e + 1) <= mag:
        e += 1
    ulp = Fraction(2) ** (max(e, -126) - 23)   # normal numbers, and subnormals below 2^-126
    q, r = divmod(mag, ulp)
    if r > ulp / 2 or (r == ulp / 2 and q % 2):
        q += 1
    return sign * float(q * ulp)


def _documented_dot(x: list[float], w: list[float]) -> float:
    """cpu_products.py's order, step by step: 16 lanes of fused multiply-adds, the lanes' tree, the tail."""
    k16 = len(x) - len(x) % 16
    lanes = [0.0] * 16
    for i in range(k16):
        lanes[i % 16] = _fma32(x[i], w[i], lanes[i % 16])
    h = 8
    while h:
        lanes[:h] = [float(torch.tensor(lanes[i], dtype=torch.float32) + torch.tensor(lanes[i + h], dtype=torch.float32))
                     for i in range(h)]
        h //= 2
    s = lanes[0]
    for i in range(k16, len(x)):
        s = _fma32(x[i], w[i], s)
    return s


def test_products_sum_in_their_documented_order():
    """cpu_products.py's promise, checked exactly (fused multiply-adds emulated with fractions): each output
    is the documented sum, so it depends on its row and column only, on every host class (AVX-512, AVX2,
    NEON and scalar code all round a fused multiply-add once). linear, int4 and int8 weights, rows_dot."""
    assert cpu_library.load() is None
    gen = torch.Generator().manual_seed(fresh_seed())
    for k in (37, 64):   # a tail past the lanes, and none
        x, w = torch.randn(3, k, generator=gen), torch.randn(5, k, generator=gen)
        got = torch.ops.gemmaserve.linear(x, w)
        want = torch.tensor([[_documented_dot(xr.tolist(), wr.tolist()) for wr in w] for xr in x])
        assert torch.equal(got, want), (k, (got - want).abs().max())
    x = torch.randn(2, 64, generator=gen)
    q = torch.randint(0, 16, (5, 64), generator=gen, dtype=torch.uint8)
    scale, minus = torch.rand(5, 2, generator=gen) / 8, torch.rand(5, 2, generator=gen) / 4
    w = cpu_products.int4_weight(q, scale, minus)
    for r, c in ((0, 0), (3, 1)):   # the weight: one rounding of s * q - m
        assert float(w[r, c * 32 + 5]) == _fma32(float(q[r, c * 32 + 5]), float(scale[r, c]), -float(minus[r, c]))
    got = torch.ops.gemmaserve.int4_mm(x, cpu_products.pack_int4(q), scale, minus)
    assert torch.equal(got, torch.tensor([[_documented_dot(xr.tolist(), wr.tolist()) for wr in w] for xr in x]))
    q8, s8 = torch.randint(-127, 128, (5, 64), generator=gen, dtype=torch.int8), torch.rand(5, generator=gen).bfloat16()
    got = torch.ops.gemmaserve.int8_mm(x, q8, s8)
    w8 = q8.float() * s8.float()[:, None]   # exact
    assert torch.equal(got, torch.tensor([[_documented_dot(xr.tolist(), wr.tolist()) for wr in w8] for xr in x]))
    h, rows = torch.randn(2, 40, generator=gen), torch.randn(2, 3, 40, generator=gen)
    got = torch.ops.gemmaserve.rows_dot(h, rows)
    assert torch.equal(got, torch.tensor([[_documented_dot(h[i].tolist(), rows[i, j].tolist()) for j in range(3)]
                                          for i in range(2)]))


@pytest.mark.parametrize("k, n", [(640, 2048), (2048, 640), (640, 1536), (64, 192), (32, 16), (37, 5)])
def test_products_rows_do_not_depend_on_the_batch(k, n):
    """Every product of the CPU path gives a row the same bits alone, in batches of 2-70 rows (13: where MKL
    broke on an AMX Xeon) and on 1 or 2 threads: linear, int4, int8 weight-only, the experts' grouped
    product, and the quantised layers' fbgemm product."""
    from gemmaserve.models.quant import FbgemmTensors, Int8Matmul, Rotation, int8_rows

    assert cpu_library.load() is None
    gen = torch.Generator().manual_seed(fresh_seed())
    ops = torch.ops.gemmaserve
    w, x = torch.randn(n, k, generator=gen), torch.randn(70, k, generator=gen)
    kernels = {"linear": lambda v: ops.linear(v, w),
               "grouped_linear": lambda v: ops.grouped_linear(v, w.expand(2, -1, -1),
                                                              torch.tensor([0, len(v)], dtype=torch.int32))}
    q8, s8 = int8_rows(w)
    kernels["int8_mm"] = lambda v: ops.int8_mm(v, q8, s8)
    if k % 32 == 0:
        q4 = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        scale, minus = torch.rand(n, k // 32, generator=gen) / 8, torch.rand(n, k // 32, generator=gen) / 4
        packed = cpu_products.pack_int4(q4)
        kernels["int4_mm"] = lambda v: ops.int4_mm(v, packed, scale, minus)
        rot = Rotation.for_width(k)
        kernels["fbgemm"] = Int8Matmul(*int8_rows(rot.apply(w)), Int8Kernel.FBGEMM_DYNAMIC, rot, keep_rows=False,
                                       fbgemm_tensors=FbgemmTensors.available())
    threads = torch.get_num_threads()
    try:
        for name, f in kernels.items():
            torch.set_num_threads(1)
            alone = torch.cat([f(x[i:i + 1]) for i in range(70)])
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                for m in (1, 2, 3, 5, 7, 8, 13, 16, 64, 70):
                    assert torch.equal(f(x[:m]), alone[:m]), (name, m, n_threads)
    finally:
        torch.set_num_threads(threads)


def test_the_start_up_check_names_a_kernel_whose_rows_follow_the_batch():
    """cpu_invariance.py: the step's kernels pass on this host (the C++ library built), and a kernel whose
    rows depend on the batch is named, with the row count: here one that scales by the row count, and the
    BLAS's unpadded product where this host's BLAS rounds a lone row otherwise."""
    from gemmaserve.models import cpu_invariance

    assert cpu_library.load() is None
    assert cpu_invariance.findings(fresh_seed()) == []
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(fresh_seed()))
    found = cpu_invariance.findings(kernels={"ok": lambda v: torch.ops.gemmaserve.linear(v, w),
                                             "scaled": lambda v: v * len(v),
                                             "blas": lambda v: F.linear(v, w)})
    assert [f.kernel for f in found if f.kernel != "blas"] == ["scaled"] * len({torch.get_num_threads(), 1})
    assert found[0].rows == 2 and found[0].row == 0
    x = torch.randn(8, 256)
    if not torch.equal(F.linear(x, w)[:1], F.linear(x[:1], w)):   # this BLAS rounds one row alone otherwise
        assert any(f.kernel == "blas" for f in found)


def test_cpp_kernels_agree_with_their_python_kernels():
    """models/cpu_kernels.py: the C++ kernels that make their Python kernels' ATen calls give the same bits
    (the engine switches to the C++ ones when the library is built, mid-run; a compiled graph calls the C++
    ones); the norms and the products (cpu_products.py) round their own way: close to their Python kernels
    (the fallback), and row by row."""
    assert cpu_library.load() is None
    gen = torch.Generator().manual_seed(fresh_seed())
    x = torch.randn(7, 4, 32, generator=gen) * 3
    for w in (None, torch.randn(32, generator=gen)):
        for offset in (0.0, 1.0):
            got = torch.ops.gemmaserve.rms_norm(x, w, 1e-6, offset)
            torch.testing.assert_close(got, fused_ops._norm_ref(x, w, NormKind(1e-6, offset)), rtol=2e-6, atol=2e-6)
            assert torch.equal(got[2:3], torch.ops.gemmaserve.rms_norm(x[2:3], w, 1e-6, offset))
            assert torch.equal(got[:, 1], torch.ops.gemmaserve.rms_norm(x[:, 1].contiguous(), w, 1e-6, offset))
            r = torch.randn(7, 4, 32, generator=gen)
            for scale in (None, torch.tensor([0.7])):
                want = fused_ops._add_rms_norm_ref(r, x, w if w is not None else torch.ones(32), w, NormKind(1e-6, offset),
                                                   scale)
                fused = torch.ops.gemmaserve.add_rms_norm(r, x, w if w is not None else torch.ones(32), w, 1e-6, offset,
                                                          scale)
                assert torch.equal(fused[0], want[0]) and (w is None or torch.equal(fused[1], want[1]))
    gate_up = torch.randn(175, 80, generator=gen)
    assert torch.equal(torch.ops.gemmaserve.gelu_mul(gate_up, 40), fused_ops._gelu_mul_ref(gate_up, 40))
    with torch.inference_mode():   # as the engine runs it (rows on several threads, which must inherit the mode)
        assert torch.equal(torch.ops.gemmaserve.gelu_mul(gate_up, 40), fused_ops._gelu_mul_ref(gate_up, 40))
    pos, inv = torch.arange(3, 12), layers.RopeParams(1e4).inv_freq(64)
    assert all(map(torch.equal, torch.ops.gemmaserve.rope_tables(pos, inv), layers._rope_tables(pos, inv)))
    logits = torch.randn(3, 300, generator=gen) * 50
    assert torch.equal(torch.ops.gemmaserve.softcap(logits, 30.0), layers._softcap(logits, 30.0))
    from gemmaserve.models.moe import _grouped_linear
    from gemmaserve.models.quant import (FbgemmTensors, Int8Matmul, Rotation, _int4_mm, _int8_linear_ref, _int8_mm,
                                         _rows_dot, int8_rows)

    if FbgemmTensors.available():
        lin = Int8Matmul(*int8_rows(torch.randn(96, 640, generator=gen)), Int8Kernel.FBGEMM_DYNAMIC,
                         Rotation.for_width(640), keep_rows=False)
        t, xs = lin._tensors, torch.randn(5, 640, generator=gen)
        args = (lin.rotation.a_t, lin.rotation.block, t.shape, t.packed, t.col_offsets, t.bias, t.scales, lin.row_sums,
                t.guard)
        assert torch.equal(torch.ops.gemmaserve.int8_linear(xs, *args), _int8_linear_ref(xs, *args))
    close = dict(rtol=1e-5, atol=1e-5)
    x, w = torch.randn(7, 64, generator=gen), torch.randn(96, 64, generator=gen)
    torch.testing.assert_close(torch.ops.gemmaserve.linear(x, w), layers._padded_linear(x, w), **close)
    ends = torch.tensor([2, 2, 7], dtype=torch.int32)
    experts = torch.randn(3, 96, 64, generator=gen)
    torch.testing.assert_close(torch.ops.gemmaserve.grouped_linear(x, experts, ends), _grouped_linear(x, experts, ends),
                               **close)
    q4 = torch.randint(0, 16, (96, 64), generator=gen, dtype=torch.uint8)
    scale, minus = torch.rand(96, 2, generator=gen) / 8, torch.rand(96, 2, generator=gen) / 4
    packed = cpu_products.pack_int4(q4)
    torch.testing.assert_close(torch.ops.gemmaserve.int4_mm(x, packed, scale, minus), _int4_mm(x, packed, scale, minus),
                               **close)
    q8, s8 = int8_rows(w)
    torch.testing.assert_close(torch.ops.gemmaserve.int8_mm(x, q8, s8), _int8_mm(x, q8, s8), rtol=1e-2, atol=5e-2)
    h, rows = torch.randn(3, 64, generator=gen), torch.randn(3, 40, 64, generator=gen)
    torch.testing.assert_close(torch.ops.gemmaserve.rows_dot(h, rows), _rows_dot(h, rows), **close)
    for t, n, hq, hkv, d, nk in [(3, 1, 4, 1, 32, 128), (1, 9, 4, 2, 16, 192), (2, 1, 2, 2, 16, 64), (1, 3, 2, 1, 20, 64)]:
        q = torch.randn(t, n, hq, d, generator=gen)
        k, v = torch.randn(2, t, nk, hkv, d, generator=gen)
        seen = torch.rand(t, n, nk, generator=gen) > 0.4
        torch.testing.assert_close(torch.ops.gemmaserve.attend(q, k, v, seen, 0.1), attend_reference(q, k, v, seen, 0.1),
                                   **close)


def test_gelu_mul_rows_do_not_depend_on_the_batch():
    """The CPU gelu kernel's leftover elements (past its vector body) round differently, and where they
    fall follows the tensor's size and its split among threads: on 2 threads a [175, 96] gate changed row
    87's last 16 values. gelu_mul runs gelu a row at a time."""
    gen = torch.Generator().manual_seed(fresh_seed())
    for width in (96, 40, 2048):
        gate_up = torch.randn(175, 2 * width, generator=gen)
        alone = torch.cat([fused_ops.gelu_mul(gate_up[i:i + 1], width) for i in range(175)])
        assert torch.equal(fused_ops.gelu_mul(gate_up, width), alone), width


@pytest.mark.parametrize("model", ["gemma3", "gemma3-int8", "e2b", "31b"])
def test_any_chunking_gives_every_position_the_same_logits(model):
    """A prompt scored one token at a time (decode rows), in chunks of 7, 64 or 87, or whole: every
    position's log-probabilities are the same bits (the prefill/decode split and a chunk boundary move
    nothing)."""
    from gemmaserve.models.quant import quantize_model
    from gemmaserve.testing.scoring import score

    from helpers import ours_from_hf

    seed = fresh_seed()
    if model.startswith("gemma3"):
        ours = ours_from_hf(tiny_hf_model(seed, vocab_size=320, intermediate_size=96 if model == "gemma3" else 128))
        if model == "gemma3-int8":
            quantize_model(ours, {})
    else:
        ours = ours_from_hf(tiny_gemma4_hf(seed, model))
    vocab = ours.config.vocab_size
    ids = [2] + torch.randint(3, vocab, (174,), generator=torch.Generator().manual_seed(seed)).tolist()
    whole = score(ours, ids, chunk=len(ids), keep_logprobs=True, kv_manager="v2").full_logprobs
    for chunk in (1, 7, 64, 87):
        got = score(ours, ids, chunk=chunk, keep_logprobs=True, kv_manager="v2").full_logprobs
        assert torch.equal(got, whole), (model, chunk, (got != whole).any(-1).nonzero().flatten()[:5].tolist())


def test_paged_attention_is_attend_over_the_gathered_keys():
    """attend_paged (the compiled decode step's attention): each key read where it lies, from the cache or a
    row's new K/V (its own, or the one of a row before it, as a verification step's rows see them), masked keys
    skipped: the same bits as the Python kernel (gather, put the new tokens in place, `attend`)."""
    from gemmaserve.attention.blockwise import MASKED, NEW, SEEN, attend_paged_reference

    gen = torch.Generator().manual_seed(fresh_seed())
    t, nk, hq, hkv, d, r = 5, 2 * KEY_BLOCK, 4, 2, 40, 700
    kv = torch.randn(r, 2, hkv, d, generator=gen)
    q = torch.randn(t, 1, hq, d, generator=gen)
    new = torch.randn(t, 2, hkv, d, generator=gen)
    rows = torch.randint(0, r, (t, nk), generator=gen)
    state = torch.where(torch.rand(t, nk, generator=gen) < 0.8, SEEN, MASKED).to(torch.int8)
    state[:, 0] = SEEN
    for row in range(t):   # its own new token, and the new tokens of up to two rows before it
        state[row, -1] = NEW
        for back in range(1, min(row, 2) + 1):
            state[row, -1 - back] = NEW + back
    got = torch.ops.gemmaserve.attend_paged(q, kv, rows, new, state, 0.125)
    assert torch.equal(got, attend_paged_reference(q, kv, rows, new, state, 0.125))
    one = torch.ops.gemmaserve.attend_paged(q[:1], kv, rows[:1], new[:1], state[:1], 0.125)   # a row alone
    assert torch.equal(one[0], got[0])


def test_attend_reads_strided_keys_and_values_as_their_copies():
    """The C++ attend reads K and V through their strides (the compiled step hands it both as views of one
    [T, nk, 2, Hkv, D] tensor): the same bits as contiguous copies, and as the Python kernel's up to rounding."""
    gen = torch.Generator().manual_seed(fresh_seed())
    t, nk, hq, hkv, d = 3, 2 * KEY_BLOCK, 4, 2, 48
    kv = torch.randn(t, nk, 2, hkv, d, generator=gen)
    q = torch.randn(t, 1, hq, d, generator=gen)
    seen = torch.rand(t, 1, nk, generator=gen) < 0.7
    seen[:, :, 0] = True
    k, v = kv.select(2, 0), kv.select(2, 1)
    assert not k.is_contiguous()
    got = torch.ops.gemmaserve.attend(q, k, v, seen, 0.125)
    assert torch.equal(got, torch.ops.gemmaserve.attend(q, k.contiguous(), v.contiguous(), seen, 0.125))
    assert torch.allclose(got, attend_reference(q, k, v, seen, 0.125), atol=1e-5)
    # a key set's stride other than nk keys (every other set of a larger tensor)
    wide = torch.randn(2 * t, nk, 2, hkv, d, generator=gen)[::2]
    got = torch.ops.gemmaserve.attend(q, wide.select(2, 0), wide.select(2, 1), seen, 0.125)
    assert torch.equal(got, torch.ops.gemmaserve.attend(q, wide.select(2, 0).contiguous(),
                                                         wide.select(2, 1).contiguous(), seen, 0.125))


@pytest.mark.parametrize("hq, hkv, d, window", [(4, 1, 256, None), (4, 1, 256, 100), (2, 1, 16, 30), (8, 4, 64, None)])
def test_a_query_attends_the_same_alone_in_a_batch_and_in_any_chunk(hq, hkv, d, window):
    """blockwise.py: a query's output is the same bits as a decode row alone, among other decode rows of
    other lengths, and inside prefill chunks that start at other places (its keys then share tiles with
    other queries' and run past its own)."""
    gen = torch.Generator().manual_seed(fresh_seed())
    n = 400
    K, V = torch.randn(2, n, hkv, d, generator=gen)
    Q = torch.randn(n, hq, d, generator=gen)

    def first_key(p: int) -> int:
        return 0 if window is None else max(0, p - window + 1)

    def decode(ps: list[int]) -> torch.Tensor:
        spans = [block_span(first_key(p), p + 1) for p in ps]
        nk = max(hi - lo for lo, hi in spans)
        keys, seen = [], []
        for p, (lo, _) in zip(ps, spans):
            at = torch.arange(lo, lo + nk)
            keys.append(at.clamp(first_key(p), p))
            seen.append(((at >= first_key(p)) & (at <= p))[None])
        keys = torch.stack(keys)
        return attend(Q[ps][:, None], K[keys], V[keys], torch.stack(seen), 0.1)[:, 0]

    def chunk(q0: int, q1: int) -> torch.Tensor:
        lo, hi = block_span(first_key(q0), q1)
        at = torch.arange(lo, hi)
        diff = torch.arange(q0, q1)[:, None] - at[None]
        seen = diff >= 0 if window is None else (diff >= 0) & (diff < window)
        keys = at.clamp(first_key(q0), q1 - 1)
        return attend(Q[q0:q1][None], K[keys][None], V[keys][None], seen[None], 0.1)[0]

    for p in (0, 5, KEY_BLOCK - 1, KEY_BLOCK, 130, 399):
        alone = decode([p])[0]
        assert torch.equal(decode([399, p, 7])[1], alone), p
        for q0, q1 in ((0, n), (p, p + 1), (max(0, p - 40), min(n, p + 17)), (max(0, p - 200), p + 1)):
            assert torch.equal(chunk(q0, q1)[p - q0], alone), (p, q0, q1)
    if window is None:   # and it is attention
        ref = F.scaled_dot_product_attention(Q[300][None, :, None].double(), K[:301].double().transpose(0, 1)[None],
                                             V[:301].double().transpose(0, 1)[None], scale=0.1, enable_gqa=True)
        assert (decode([300])[0].double() - ref[0, :, 0]).abs().max() < 1e-5


# -- engines ------------------------------------------------------------------------------------------
PARAMS = SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True)
PROBE = "the river valley is long and farmers settled on its banks " * 3
OTHERS = ["hello world", "abcdefghij klmnop qrstuv " * 6, "zyxw vuts", "a b c d e f g h i j k l m n o p",
          "grain with the towns downstream " * 4, "x", "the mills and the towns"]


def _generated(llm: LLM, prompts: list[str], params: SamplingParams = PARAMS) -> list[tuple]:
    """(token ids, every logprob and top alternative) of each prompt's completion: equal only if each
    step's logits were the same bits."""
    out = []
    for o in llm.generate(prompts, params):
        c = o.outputs[0]
        out.append((tuple(c.token_ids), tuple((lp.token_id, lp.logprob, lp.top) for lp in c.logprobs)))
    llm.engine._kv.check_integrity()
    return out


def _check_batches(make, what: str) -> None:
    """The probe alone (prefix cache cold, then warm), twice in one batch, and at the first, a middle and
    the last place of a batch of 8 (other prompts chunked beside it: prefill and decode rows mixed in
    one step), on engines from `make(**options)`: V2 with scratch and prefix caching, V1, small chunks."""
    alone = None
    for opts in (dict(kv_cache_manager="v2", enable_prefix_caching=True, max_num_batched_tokens=64),
                 dict(kv_cache_manager="v1", enable_prefix_caching=False, max_num_batched_tokens=64),
                 dict(kv_cache_manager="v2", enable_prefix_caching=True, swa_scratch_reuse="on",
                      max_num_batched_tokens=16)):
        llm = make(**opts)
        first = _generated(llm, [PROBE])[0]
        alone = alone or first
        assert first == alone, f"{what} {opts}: alone (cold)"
        hits = llm.engine._kv.stats().prefix_hit_tokens
        assert _generated(llm, [PROBE])[0] == alone, f"{what} {opts}: alone (warm)"
        assert llm.engine._kv.stats().prefix_hit_tokens > hits or not opts["enable_prefix_caching"]
        assert _generated(llm, [PROBE, PROBE]) == [alone, alone], f"{what} {opts}: twice"
        for at in (0, 3, 7):
            batch = OTHERS[:at] + [PROBE] + OTHERS[at:]
            assert _generated(llm, batch)[at] == alone, f"{what} {opts}: at {at} of 8"


def _config(path, **opts) -> EngineConfig:
    return EngineConfig(model=str(path), page_size=4, max_num_seqs=8, cpu_compile="off", **opts)


@pytest.mark.parametrize("quantised", [False, True], ids=["fp32", "quantised"])
def test_tiny_gemma3_output_does_not_depend_on_the_batch(tmp_path, quantised):
    """fp32 weights, and the quantised CPU path (rotated int8 on fbgemm, the int8 head and its exact
    refinement) built from the same weights: the probe's tokens and logprobs are the same bits in every
    batch and cache mode."""
    from gemmaserve.models.loader import load_model
    from gemmaserve.models.quant import quantize_model

    path = save_checkpoint(tiny_hf_model(fresh_seed(), hidden_size=64, intermediate_size=128, head_dim=32,
                                         sliding_window=6, num_key_value_heads=2, vocab_size=320), tmp_path / "tiny")
    loaded = load_model(str(path), torch.float32, torch.device("cpu"))
    if quantised:
        loaded = dataclasses.replace(loaded, weight_formats=quantize_model(loaded.model, {}))
        assert loaded.weight_formats["int8"] > 0 and loaded.model.model.embed_tokens.head4 is not None
    _check_batches(lambda **o: LLM.from_config(_config(path, **o), loaded), "gemma3 " + ("int8" if quantised else "fp32"))


@pytest.mark.parametrize("variant", ["e2b", "26b_a4b"])
def test_tiny_gemma4_output_does_not_depend_on_the_batch(tmp_path, variant):
    """Gemma 4: KV-sharing layers and per-layer inputs (E2B), experts whose rows per expert follow the
    batch (26B-A4B: each expert's rows padded to whole tiles, moe.py)."""
    path = save_checkpoint(tiny_gemma4_hf(fresh_seed(), variant), tmp_path / variant)
    base = LLM(model=str(path), max_num_seqs=8, cpu_compile="off")
    _check_batches(lambda **o: LLM.from_config(_config(path, **o), base), f"gemma4 {variant}")


def test_sampling_with_a_seed_does_not_depend_on_the_batch(tmp_path):
    """A seeded sampled request draws the same tokens with the same probabilities alone and in a batch
    (temperature, top-k, top-p, min-p, penalties): its filtering runs on its own row on the CPU."""
    path = save_checkpoint(tiny_hf_model(fresh_seed()), tmp_path / "tiny")
    llm = LLM(model=str(path), max_num_seqs=8, cpu_compile="off")
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, seed=5, logprobs=2,
                            repetition_penalty=1.1, ignore_eos=True)
    alone = _generated(llm, [PROBE], params)[0]
    assert _generated(llm, OTHERS[:3] + [PROBE] + OTHERS[3:], params)[3] == alone


def test_paged_attention_refuses_keys_outside_the_cache_or_the_step():
    q, kv, new = torch.randn(2, 1, 4, 16), torch.randn(10, 2, 1, 16), torch.randn(2, 2, 1, 16)
    state = torch.ones(2, KEY_BLOCK, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.gemmaserve.attend_paged(q, kv, torch.full((2, KEY_BLOCK), 10), new, state, 0.1)
    state[0, -1] = 3   # row 0's key: the new token of the row before it (there is none)
    with pytest.raises(RuntimeError, match="outside the step's rows"):
        torch.ops.gemmaserve.attend_paged(q, kv, torch.zeros(2, KEY_BLOCK, dtype=torch.long), new, state, 0.1)

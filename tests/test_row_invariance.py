"""A request's output does not depend on its batch: on the CPU every kernel computes each row by itself,
so a prompt's logits are the same bits alone, twice in one batch, at any place in a mixed batch, chunked
any way, with its prefix cached or not, on V1 or V2, eager or compiled.

Kernel level: the properties the model code relies on (MKL's 4-row tiles, the C++ kernels equal to their
Python kernels, attention the same for a query however it is batched). Engine level: tiny random Gemma 3
(fp32 and quantised) and Gemma 4 variants, every generated token's logprobs compared bit for bit (they
are the logits' log-softmax: equal logits, equal logprobs). One real-model test: the embedded 270M."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from gemmaserve import LLM, SamplingParams
from gemmaserve.attention.blockwise import KEY_BLOCK, attend, attend_reference, block_span
from gemmaserve.config.engine import EngineConfig
from gemmaserve.models import cpu_kernels, fused_ops, layers
from gemmaserve.models.fused_ops import NormKind
from gemmaserve.models.layers import ROW_TILE, linear
from gemmaserve.models.quant import Int8Kernel

from helpers import GEMMA4_VARIANTS, fresh_seed, save_checkpoint, tiny_gemma4_hf, tiny_hf_model


# -- kernels ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k, n", [(640, 2048), (2048, 640), (640, 1536), (64, 192), (32, 16)])
def test_blas_rows_of_whole_tiles_do_not_depend_on_the_batch(k, n):
    """What `linear` relies on (models/layers.py): padded to whole tiles of ROW_TILE rows, every row of
    x W^T is the same bits as that row alone, whatever the row count and the row's place. (Unpadded,
    1-3 rows and the rows of a partial tile round differently: the second half checks that the padding
    is what makes the difference, so this test fails where the BLAS has no such tiles.)"""
    gen = torch.Generator().manual_seed(fresh_seed())
    w, x = torch.randn(n, k, generator=gen), torch.randn(70, k, generator=gen)
    alone = torch.cat([linear(x[i:i + 1], w) for i in range(70)])
    for m in (1, 2, 3, 5, 7, 8, 13, 64, 70):
        assert torch.equal(linear(x[:m], w), alone[:m]), m
    unpadded = [F.linear(x[:m], w) for m in (1, 7)]
    assert not (torch.equal(unpadded[0], alone[:1]) and torch.equal(unpadded[1], alone[:7])), \
        f"this BLAS computes partial tiles like whole ones: ROW_TILE = {ROW_TILE} is not needed"


def test_cpp_kernels_make_their_python_kernels_calls():
    """models/cpu_kernels.py: each op's C++ kernel gives its Python kernel's bits (the engine switches to
    the C++ ones when the library is built, mid-run; a compiled graph calls the C++ ones)."""
    assert cpu_kernels.load() is None
    gen = torch.Generator().manual_seed(fresh_seed())
    x = torch.randn(7, 4, 32, generator=gen) * 3
    for w in (None, torch.randn(32, generator=gen)):
        for offset in (0.0, 1.0):   # (the norms round their own way: close to ATen's, and row by row)
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
    from gemmaserve.models.quant import FbgemmTensors, Int8Matmul, Rotation, _int8_linear_ref, int8_rows

    if FbgemmTensors.available():
        lin = Int8Matmul(*int8_rows(torch.randn(96, 640, generator=gen)), Int8Kernel.FBGEMM_DYNAMIC,
                         Rotation.for_width(640), keep_rows=False)
        t, xs = lin._tensors, torch.randn(5, 640, generator=gen)
        args = (lin.rotation.a_t, lin.rotation.block, t.shape, t.packed, t.col_offsets, t.bias, t.scales, lin.row_sums)
        assert torch.equal(torch.ops.gemmaserve.int8_linear(xs, *args), _int8_linear_ref(xs, *args))
    x, w = torch.randn(7, 64, generator=gen), torch.randn(96, 64, generator=gen)
    assert torch.equal(torch.ops.gemmaserve.linear(x, w), layers._padded_linear(x, w))
    h, rows = torch.randn(3, 64, generator=gen), torch.randn(3, 40, 64, generator=gen)
    assert torch.equal(torch.ops.gemmaserve.rows_dot(h, rows), torch.einsum("mh,mkh->mk", h, rows))
    for t, n, hq, hkv, d, nk in [(3, 1, 4, 1, 32, 128), (1, 9, 4, 2, 16, 192), (2, 1, 2, 2, 16, 64)]:
        q = torch.randn(t, n, hq, d, generator=gen)
        k, v = torch.randn(2, t, nk, hkv, d, generator=gen)
        seen = torch.rand(t, n, nk, generator=gen) > 0.4
        assert torch.equal(torch.ops.gemmaserve.attend(q, k, v, seen, 0.1), attend_reference(q, k, v, seen, 0.1))


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
    from gemmaserve.bench.scoring import score
    from gemmaserve.models.quant import quantize_model

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
    llm.engine.kv.check_integrity()
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
        hits = llm.engine.kv.stats().prefix_hit_tokens
        assert _generated(llm, [PROBE])[0] == alone, f"{what} {opts}: alone (warm)"
        assert llm.engine.kv.stats().prefix_hit_tokens > hits or not opts["enable_prefix_caching"]
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
        assert loaded.weight_formats["int8"] > 0 and loaded.model.model.embed_tokens.head is not None
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


@pytest.mark.slow
def test_embedded_model_output_does_not_depend_on_the_batch():
    """The issue's case: on the default path (quantised GGUF weights) the same prompt twice in one batch
    gave "...named Mary..." for one copy and "...named Lily..." for the other. Now: the same tokens and
    logprobs alone, twice, and at three places among 8 prompts, prefix cache cold and warm."""
    llm = LLM(max_num_seqs=8, cpu_compile="off")
    assert llm.engine.info.weights.startswith("int8")   # the default, quantised path
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=2)
    prompts = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "In 1492, Columbus",
               "The quick brown fox", "Water boils at", "My favourite food is", "Q: What is 2+2?\nA:"]
    alone = _generated(llm, ["Once upon a time"], params)[0]
    assert _generated(llm, ["Once upon a time"], params)[0] == alone   # its prompt from the prefix cache
    assert _generated(llm, ["Once upon a time"] * 2, params) == [alone, alone]
    for at in (0, 4, 7):
        batch = prompts[1:at + 1] + ["Once upon a time"] + prompts[at + 1:]
        assert _generated(llm, batch, params)[at] == alone, at

"""`--batch-invariant`: a request's logits have the same bits whatever else is in its batch, its place in it,
how its prompt was chunked and whether the step is a decode step or a mixed one (the CUDA-graph buffers
included). On the CPU the Triton kernels run in Triton's interpreter, whose tl.dot is numpy's matmul of the
tile: the tests pin the properties that carry over to a GPU (one tile configuration whatever M, the same
kernel and constants for decode rows and prefill rows, key tiles at absolute positions), and show that the
default path fails the same checks (its split-K decode changes a sequence's key partition with the batch)."""

import pytest
import torch

from helpers import fresh_seed

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("row_invariant_dot")
from gemmaserve.attention import triton_kernels as K  # noqa: E402
from gemmaserve.models import invariant_kernels as IK  # noqa: E402


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


class _Launches:
    """Wraps a Triton kernel: records each launch's constexprs and launch options, then runs it."""

    def __init__(self, kernel, names):
        self.kernel, self.names, self.calls = kernel, names, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append({n: kwargs[n] for n in self.names})
            return self.kernel[grid](*args, **kwargs)
        return launch


# -- matmuls ------------------------------------------------------------------------------------------
def test_gemm_rows_have_the_same_bits_for_any_batch_and_position(monkeypatch):
    gen = torch.Generator().manual_seed(fresh_seed())
    n, k = 80, 100   # tails in N and in K
    w = torch.randn(n, k, generator=gen)
    pool = torch.randn(130, k, generator=gen)
    probe = torch.randn(k, generator=gen)
    launches = _Launches(IK._matmul_kernel, ["BM", "BN", "BK", "GROUP_M", "PRECISION", "num_warps", "num_stages"])
    monkeypatch.setattr(IK, "_matmul_kernel", launches)
    ref = IK.matmul(probe[None], w)[0]
    assert torch.allclose(ref, w @ probe, atol=1e-5, rtol=1e-5)
    for m in (1, 3, 8, 17, 64, 130):   # 130: three row tiles
        for pos in sorted({0, m // 2, m - 1}):
            x = pool[:m].clone()
            x[pos] = probe
            assert _same(IK.matmul(x, w)[pos], ref), f"M={m}, row {pos}"
    # On a GPU a row's bits follow the tile configuration and the K loop: one configuration for every M.
    assert len({tuple(c.items()) for c in launches.calls}) == 1


def test_grouped_gemm_rows_do_not_depend_on_the_other_experts_rows():
    gen = torch.Generator().manual_seed(fresh_seed())
    experts, k, n = 4, 48, 40
    w = torch.randn(experts, n, k, generator=gen).transpose(1, 2)   # [E, K, N] views, as the MoE passes them
    probe = torch.randn(k, generator=gen)
    ref = None
    for counts, at in (([0, 1, 0, 0], 0), ([3, 70, 0, 5], 3 + 41), ([0, 9, 2, 0], 0 + 8)):
        x = torch.randn(sum(counts), k, generator=gen)
        x[at] = probe
        ends = torch.tensor(counts).cumsum(0).to(torch.int32)
        y = IK.grouped_matmul(x, w, ends)
        starts = [0] + ends[:-1].tolist()
        expect = torch.cat([x[s:e] @ w[i] for i, (s, e) in enumerate(zip(starts, ends.tolist()))])
        assert torch.allclose(y, expect, atol=1e-5, rtol=1e-5)
        ref = y[at] if ref is None else ref
        assert _same(y[at], ref), counts   # expert 1 each time, in tiles of other shapes


# -- norms ---------------------------------------------------------------------------------------------
def test_norm_and_elementwise_kernels_are_row_independent():
    """One program per row (per token and head for q/k norms), a fixed reduction per row: unchanged by
    the option, pinned here."""
    from gemmaserve.models import fused_kernels as FK
    from gemmaserve.models.fused_ops import NormKind
    from gemmaserve.models.layers import AttentionParams, RopeParams

    gen = torch.Generator().manual_seed(fresh_seed())
    kind = NormKind(1e-6, 1.0)
    hq, hkv, d, h = 4, 2, 16, 96
    p = AttentionParams(layer=0, hidden_size=h, num_heads=hq, num_kv_heads=hkv, head_dim=d, scale=1.0, window=None,
                        norm=kind)
    w1, w2 = torch.randn(h, generator=gen), torch.randn(h, generator=gen)
    wq, wk = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
    rows = torch.randn(17, h, generator=gen)
    res = torch.randn(17, h, generator=gen)
    qkv = torch.randn(17, sum(p.qkv_sizes), generator=gen)
    gu = torch.randn(17, 2 * 1500, generator=gen)
    cos, sin = RopeParams.cos_sin(RopeParams(1e4).inv_freq(d), torch.arange(17), torch.float32)

    def outs(sel):
        r, y = FK.add_rms_norm(res[sel], rows[sel], w1, w2, kind)
        q, kk, _ = FK.qkv_norm_rope(qkv[sel], p, wq, wk, cos[sel], sin[sel])
        return [FK.rms_norm(rows[sel], w1, kind), r, y, q, kk, FK.gelu_mul(gu[sel], 1500)]

    alone = outs(slice(5, 6))
    for sel in (slice(0, 17), slice(3, 8)):
        for a, b in zip(alone, outs(sel)):
            assert _same(a[0], b[5 - sel.start])


# -- attention -----------------------------------------------------------------------------------------
def _cache(gen, lens, hkv, d, t):
    from test_triton_kernels import _paged

    kc, vc, pages, _, _ = _paged(gen, lens, hkv, d, t)
    return kc, vc, pages


def _one_token_rows(q, kc, vc, pages, seq_lens, window):
    """Decode rows the batch-invariant way: the prefill kernel, one-token tiles (triton_backend)."""
    b = q.shape[0]
    iota = torch.arange(b, dtype=torch.int32)
    return K.prefill_attention(q, kc, vc, pages, torch.zeros(b, dtype=torch.int32), iota,
                               torch.ones(b, dtype=torch.int32), seq_lens.to(torch.int32), iota,
                               torch.zeros(b, dtype=torch.int32), 0.3, window)


@pytest.mark.parametrize("window", [None, 9])
def test_attention_query_has_the_same_bits_alone_in_a_batch_and_in_any_chunk(window, monkeypatch):
    gen = torch.Generator().manual_seed(fresh_seed())
    hq, hkv, d, t = 4, 2, 16, 4
    lens = [90, 40, 70]
    kc, vc, pages = _cache(gen, lens, hkv, d, t)
    n = lens[0]
    qs = torch.randn(n, hq, d, generator=gen)   # the query of each position of sequence 0
    launches = _Launches(K._prefill_kernel, ["G", "D", "T", "WINDOW", "BLOCK_M", "BLOCK_N", "BLOCK_D", "PRECISION",
                                             "num_warps", "num_stages"])
    monkeypatch.setattr(K, "_prefill_kernel", launches)
    # The last 30 positions, each as a decode row of its own (a batch of 30 one-token "sequences").
    pos = torch.arange(n - 30, n)
    decode = _one_token_rows(qs[pos], kc, vc, pages[[0] * 30], pos + 1, window)
    # Alone, and in a batch with the other sequences (placed before and after it).
    alone = _one_token_rows(qs[n - 1:], kc, vc, pages[:1], torch.tensor([n]), window)
    mixed_q = torch.cat([torch.randn(1, hq, d, generator=gen), qs[n - 1:], torch.randn(1, hq, d, generator=gen)])
    mixed = _one_token_rows(mixed_q, kc, vc, pages[[1, 0, 2]], torch.tensor([lens[1], n, lens[2]]), window)
    assert _same(alone[0], decode[-1]) and _same(mixed[1], decode[-1])

    def chunked(splits):
        """Positions n-30..n-1 of sequence 0 prefilled in chunks of `splits` tokens over the cached prefix,
        each chunk in a step with another sequence's chunk before it."""
        rows, start = [], n - 30
        for m in splits:
            ql = [5, m]
            q = torch.cat([torch.randn(5, hq, d, generator=gen), qs[start:start + m]])
            seqs, tiles = K.prefill_tiles(ql, K.prefill_block_m(d))
            out = K.prefill_attention(q, kc, vc, pages[[1, 0]], torch.zeros(2, dtype=torch.int32),
                                      torch.tensor([0, 5], dtype=torch.int32), torch.tensor(ql, dtype=torch.int32),
                                      torch.tensor([lens[1], start + m], dtype=torch.int32),
                                      torch.tensor(seqs, dtype=torch.int32), torch.tensor(tiles, dtype=torch.int32),
                                      0.3, window)
            rows.append(out[5:])
            start += m
        return torch.cat(rows)

    for splits in ([30], [7, 23], [13, 1, 16]):
        got = chunked(splits)
        for j in range(30):
            assert _same(got[j], decode[j]), f"chunks {splits}: position {n - 30 + j}"
    # One kernel, one set of constants, for decode rows and prefill chunks alike.
    assert len({tuple(c.items()) for c in launches.calls}) == 1


def test_default_split_k_decode_changes_a_query_bits_with_its_batch():
    """What the option turns off: the split-K decode kernel splits each sequence's keys by a count set
    from the batch (`decode_splits`), so the same query gets other bits in another batch. A small SM
    count stands for a long context on a GPU (where the count drops below the keys' tiles)."""
    gen = torch.Generator().manual_seed(fresh_seed())
    hq, hkv, d, t = 4, 2, 16, 4
    lens = [260, 40, 70, 100]
    kc, vc, pages = _cache(gen, lens, hkv, d, t)
    q = torch.randn(4, hq, d, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    first = torch.zeros(4, dtype=torch.int32)
    alone_splits, batch_splits = K.decode_splits(1, hkv, lens[0], sm_count=1), K.decode_splits(4, hkv, 260, sm_count=1)
    assert alone_splits != batch_splits
    alone = K.decode_attention(q[:1], kc, vc, pages[:1], first[:1], seq_lens[:1], 0.3, None, alone_splits)
    batch = K.decode_attention(q, kc, vc, pages, first, seq_lens, 0.3, None, batch_splits)
    assert torch.allclose(alone[0], batch[0], atol=1e-5) and not _same(alone[0], batch[0])
    # The batch-invariant path for the same rows: equal.
    assert _same(_one_token_rows(q[:1], kc, vc, pages[:1], seq_lens[:1], None)[0],
                 _one_token_rows(q, kc, vc, pages, seq_lens, None)[0])


# -- sampling ------------------------------------------------------------------------------------------
def test_sampler_filters_and_logprobs_row_by_row():
    from gemmaserve.engine.sampler import SamplingState, sample
    from gemmaserve.engine.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(fresh_seed())
    logits = torch.randn(5, 3000, generator=gen) * 3
    params = [SamplingParams(temperature=0.9, top_p=0.8, min_p=0.02, top_k=50, seed=7, logprobs=3),
              SamplingParams(temperature=0.0, logprobs=2)]

    def draw(rows, ps):
        states = [SamplingState.create(p, 11, [1, 2], torch.device("cpu")) for p in ps]
        out = sample(logits[rows], states, row_by_row=True)
        return out.resolve()

    alone = draw([3], params[:1])
    batch = draw([0, 3, 1], [params[1], params[0], params[1]])
    assert alone[0][0] == batch[0][1] and alone[1][0] == batch[1][1]


# -- options -------------------------------------------------------------------------------------------
def test_option_parses_everywhere_and_is_refused_where_it_cannot_hold():
    from gemmaserve.attention.base import BackendCapabilities
    from gemmaserve.cli import build_parser
    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.config.options import from_namespace
    from gemmaserve.config.resolve import BatchInvariance, resolve_batch_invariance
    from gemmaserve.errors import UserInputError

    parser = build_parser(with_bench=False)
    for argv in (["generate", "--batch-invariant", "x"], ["serve", "--batch-invariant"]):
        assert from_namespace(EngineConfig, parser.parse_args(argv)).batch_invariant is True
    assert "--batch-invariant" in parser._subparsers._group_actions[0].choices["generate"].format_help()
    triton_caps = BackendCapabilities("triton", frozenset({"cuda", "cpu"}), None, True, True, True, True)
    torch_caps = BackendCapabilities("torch", frozenset({"cuda", "cpu"}), None, False, True)
    on = EngineConfig(batch_invariant=True)
    assert resolve_batch_invariance(on, "cuda", triton_caps, quantized=False) is BatchInvariance.KERNELS
    assert resolve_batch_invariance(EngineConfig(), "cuda", torch_caps, quantized=False) is BatchInvariance.OFF
    # the CPU's torch path is row-independent whatever the flag (tests/test_row_invariance.py)
    for config in (on, EngineConfig()):
        assert resolve_batch_invariance(config, "cpu", torch_caps, quantized=True) is BatchInvariance.NATIVE
    with pytest.raises(UserInputError, match="needs the triton attention backend"):
        resolve_batch_invariance(on, "cuda", torch_caps, quantized=False)
    with pytest.raises(UserInputError, match="unquantised"):
        resolve_batch_invariance(on, "cpu", triton_caps, quantized=True)
    with pytest.raises(UserInputError, match="tensor_parallel_size"):
        EngineConfig(batch_invariant=True, tensor_parallel_size=2)


# -- end to end ----------------------------------------------------------------------------------------
# A probe prompt of 70 tokens (more than one 64-key tile, so split-K has something to split), 3 greedy
# steps, chunks of at most 24 tokens: alone, twice in one batch (prefix-cache hits), then among a longer
# prompt and two short ones (other chunk boundaries, decode rows inside prefill steps).
PROBE = [2] + [(7 * j) % 290 + 5 for j in range(69)]
OTHERS = [[2] + [(11 * j) % 290 + 5 for j in range(99)], [2, 9, 10, 11], [2, 40]]
ENGINE = dict(attention_backend="triton", dtype="float32", page_size=4, max_num_batched_tokens=24)


def _gemma3_tiny(tmp_path):
    from helpers import save_checkpoint, tiny_hf_model

    return save_checkpoint(tiny_hf_model(fresh_seed(), sliding_window=4, num_key_value_heads=2, num_hidden_layers=2,
                                         layer_types=["sliding_attention", "full_attention"]), tmp_path / "g3")


def test_gemma3_logits_have_the_same_bits_alone_duplicated_and_in_a_mixed_batch(tmp_path):
    from gemmaserve import LLM
    from gemmaserve.testing.invariance import probe_checks, record_logits, run_recorded, same_bits

    llm = LLM(model=str(_gemma3_tiny(tmp_path)), batch_invariant=True, **ENGINE)
    assert llm.engine.info.batch_invariant and llm.engine.info.swa_scratch_reuse
    got = probe_checks(llm.engine, PROBE, OTHERS, max_tokens=3)
    assert got["steps"] == 3 and got["duplicate_equal"] and got["mixed_equal"], got["mixed_max_abs_diff"]
    llm.engine._kv.check_integrity()
    # The check can fail: the same engine with the attention's default path (matmuls still invariant).
    # A prompt of 140 tokens alone decodes with its keys split three ways; twice in a batch, two ways
    # (`decode_splits`: a small SM count stands for a long context on a GPU, where the count follows the
    # batch), so the copies get other bits than the prompt alone.
    eng = llm.engine
    eng._backend.batch_invariant = False
    eng._backend.sm_count = 1
    seen = record_logits(eng)
    long_probe = [2] + [(5 * j) % 290 + 5 for j in range(139)]
    alone = run_recorded(eng, seen, [long_probe], 2, "base-alone")[0]
    dup = run_recorded(eng, seen, [long_probe, long_probe], 2, "base-dup")
    assert not any(same_bits(alone, d) for d in dup)


def test_gemma3_decode_graph_buffers_give_the_eager_bits(tmp_path):
    """The CUDA-graph path's fixed buffers (padded batch, one-token tiles at fixed addresses), run
    eagerly on the CPU: the same bits as the eager decode step."""
    from gemmaserve import LLM, SamplingParams
    from gemmaserve.models.base import ModelInputs

    llm = LLM(model=str(_gemma3_tiny(tmp_path)), batch_invariant=True, **ENGINE)
    eng = llm.engine
    for p in (PROBE[:30], OTHERS[1]):
        eng.add_request("", SamplingParams(max_tokens=8, ignore_eos=True), prompt_ids=p)
    while True:
        plan = eng._scheduler.schedule()
        if all(s.num_new_tokens == 1 for s in plan.seqs):
            break
        eng._update(plan, eng._runner.execute(plan))
    runner, model = eng._runner, eng._model
    runner.apply(plan)
    ids, pos, md = runner.build_inputs(plan.seqs)
    with torch.inference_mode():
        ref = model.compute_logits(model(ModelInputs(ids, pos, runner.backend.begin_batch(md, runner.kv_cache))))
        inputs = runner.backend.graph_inputs(8, eng._kv.groups, 256, eng._kv.num_pages, torch.device("cpu"))
        inputs.fill(md, 4)
        pad = lambda t: torch.cat([t, torch.zeros(2, dtype=t.dtype)])   # noqa: E731
        got = model.compute_logits(model(ModelInputs(pad(ids), pad(pos), inputs.attention(4, md.layer_slot,
                                                                                         runner.kv_cache))))
    assert _same(got[:2], ref)


def test_gemma4_logits_have_the_same_bits_alone_duplicated_and_in_a_mixed_batch(tmp_path):
    """One tiny Gemma 4 with every part that could mix rows: MoE beside the dense MLP (grouped GEMM, router),
    K = V full layers, value norms, per-layer inputs (PLE) and KV-sharing layers (which keep only the
    sampled rows: a decode-shaped batch inside a prefill step). PLE width 32: the CPU's torch gelu runs a
    vector body and a scalar tail whose split follows the tensor's size (on CUDA every element runs the
    same code), so a width that keeps T x P a multiple of 32 keeps this host-side op out of the check."""
    from helpers import save_checkpoint, tiny_gemma4_hf

    from gemmaserve import LLM
    from gemmaserve.testing.invariance import probe_checks

    sliding, full = "sliding_attention", "full_attention"
    hf = tiny_gemma4_hf(fresh_seed(), "26b_a4b", num_hidden_layers=4, layer_types=[sliding, full, sliding, full],
                        num_kv_shared_layers=2, hidden_size_per_layer_input=32)
    llm = LLM(model=str(save_checkpoint(hf, tmp_path / "g4")), batch_invariant=True, **ENGINE)
    cfg = llm.engine._model.config
    assert cfg.moe and cfg.hidden_size_per_layer_input and cfg.kv_sources[-1] is not None
    assert llm.engine._model.model.layers[0].experts.batch_invariant
    got = probe_checks(llm.engine, PROBE[:30], [OTHERS[0][:40], *OTHERS[1:]], max_tokens=2)
    assert got["steps"] == 2 and got["duplicate_equal"] and got["mixed_equal"], got["mixed_max_abs_diff"]

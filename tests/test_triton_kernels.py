"""Our Triton kernels against dense attention on fresh random inputs (on the CPU they run in Triton's
interpreter; the GPU check script `bench/gpu_check.py` covers bf16 and head dims 128/256/512 on an H200)."""

import pytest
import torch

from helpers import fresh_seed

triton = pytest.importorskip("triton")
from gemmaserve.attention import triton_kernels as K  # noqa: E402
from gemmaserve.attention.torch_backend import visible  # noqa: E402
from gemmaserve.models.base import ModelInputs  # noqa: E402


def _paged(gen, lens, hkv, d, t, extra_pages=5):
    """A random paged cache: each sequence's blocks on shuffled pages; returns dense K/V too."""
    blocks = [-(-n // t) for n in lens]
    num_pages = sum(blocks) + extra_pages
    perm = torch.randperm(num_pages, generator=gen)
    kc = torch.randn(num_pages, t, hkv, d, generator=gen)
    vc = torch.randn(num_pages, t, hkv, d, generator=gen)
    pages = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    dense_k, dense_v, i = [], [], 0
    for b, nb in enumerate(blocks):
        pages[b, :nb] = perm[i:i + nb].int()
        i += nb
        kk = kc[pages[b, :nb].long()].reshape(-1, hkv, d)[:lens[b]]
        vv = vc[pages[b, :nb].long()].reshape(-1, hkv, d)[:lens[b]]
        dense_k.append(kk)
        dense_v.append(vv)
    return kc, vc, pages, dense_k, dense_v


def _dense(q, k, v, q_pos, window, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    s = s.masked_fill(~visible(q_pos, torch.arange(k.shape[0]), window)[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


@pytest.mark.parametrize("d, hq, hkv, window", [(16, 4, 1, None), (16, 4, 2, 7), (64, 2, 2, 40)])
def test_decode_kernel_split_k(d, hq, hkv, window):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    lens, t = [70, 5, 33], 4
    kc, vc, pages, dk, dv = _paged(gen, lens, hkv, d, t)
    q = torch.randn(len(lens), hq, d, generator=gen)
    first = torch.zeros(len(lens), dtype=torch.int32)
    out = K.decode_attention(q, kc, vc, pages, first, torch.tensor(lens, dtype=torch.int32), 0.3, window,
                             num_splits=5)
    for b, n in enumerate(lens):
        ref = _dense(q[b:b + 1], dk[b], dv[b], torch.tensor([n - 1]), window, 0.3)
        err = ((out[b:b + 1].double() - ref).norm() / ref.norm()).item()
        assert err < 1e-5, f"seed={seed} seq={b}: {err}"


@pytest.mark.parametrize("d, hq, hkv, window", [(16, 4, 1, None), (32, 4, 2, 9)])
def test_prefill_kernel_over_cached_prefix(d, hq, hkv, window):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    seq_lens, q_lens, t = [90, 12, 40], [30, 12, 1], 8
    kc, vc, pages, dk, dv = _paged(gen, seq_lens, hkv, d, t)
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    starts = torch.tensor([0, 30, 42], dtype=torch.int32)
    seqs, tiles = K.prefill_tiles(q_lens, K.prefill_block_m(d))
    out = K.prefill_attention(q, kc, vc, pages, torch.zeros(3, dtype=torch.int32), starts,
                              torch.tensor(q_lens, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                              torch.tensor(seqs, dtype=torch.int32), torch.tensor(tiles, dtype=torch.int32),
                              0.25, window)
    for b, (n, m) in enumerate(zip(seq_lens, q_lens)):
        rows = slice(int(starts[b]), int(starts[b]) + m)
        ref = _dense(q[rows], dk[b], dv[b], torch.arange(n - m, n), window, 0.25)
        err = ((out[rows].double() - ref).norm() / ref.norm()).item()
        assert err < 1e-5, f"seed={seed} seq={b}: {err}"


def test_store_kv_writes_through_strided_views():
    gen = torch.Generator().manual_seed(fresh_seed())
    arena = torch.zeros(6 * 4 * 2 * 2 * 8)
    kv = arena.view(6, 4, 2, 2, 8)
    kc, vc = kv[:, :, 0], kv[:, :, 1]
    k, v = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    pages = torch.tensor([3, 3, 0, 5, 1], dtype=torch.int32)
    offs = torch.tensor([0, 3, 2, 1, 1], dtype=torch.int32)
    K.store_kv(k, v, kc, vc, pages, offs)
    for i in range(5):
        assert torch.equal(kc[pages[i], offs[i]], k[i]) and torch.equal(vc[pages[i], offs[i]], v[i])
    assert int((arena != 0).sum()) == 5 * 2 * 2 * 8   # nothing else was touched


def _tiny(tmp_path, window):
    from helpers import save_checkpoint, tiny_hf_model

    return save_checkpoint(tiny_hf_model(fresh_seed(), sliding_window=window, num_key_value_heads=2),
                           tmp_path / "tiny")


def test_triton_backend_gives_the_torch_tokens(tmp_path):
    """Chunked prefill with scratch pages, decode, and a warm prefix cache, through the Triton kernels
    (interpreted on the CPU: slow, so one small case; the GPU check covers real sizes)."""
    from gemmaserve import LLM, SamplingParams
    from gemmaserve.config.engine import EngineConfig

    path = _tiny(tmp_path, 5)
    prompts = ["abcdefghij klmnop qrstuv " * 2, "zyxw vuts"]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = LLM(model=str(path), attention_backend="torch", kv_cache_manager="v1", page_size=4)
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
    tri = LLM.from_config(EngineConfig(model=str(path), attention_backend="triton", page_size=4,
                                       max_num_batched_tokens=12), ref)
    assert tri.engine.info.attention_backend == "triton" and tri.engine.info.swa_scratch_reuse
    for _ in range(2):   # cold, then warm prefix cache
        assert [o.outputs[0].token_ids for o in tri.generate(prompts, params)] == expected
    tri.engine._kv.check_integrity()


def test_cli_triton_on_cpu_matches_torch(tmp_path):
    import json
    import os
    import subprocess
    import sys

    path = _tiny(tmp_path, 4)

    def run(*extra):
        env = dict(os.environ, TRITON_INTERPRET="1")
        res = subprocess.run([sys.executable, "-m", "gemmaserve", "generate", "--json", "--model", str(path),
                              "--device", "cpu", "--max-tokens", "8", "abc def ghi jkl mno", *extra],
                             capture_output=True, text=True, timeout=600, env=env)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)["token_ids"]

    assert run("--attention-backend", "triton") == run("--attention-backend", "torch")


def test_decode_graph_buffers_give_the_same_logits(tmp_path):
    """The CUDA-graph path's fixed buffers (padded batch, null page, static split grid), run eagerly
    on the CPU: same logits as the regular path, and padding rows touch only the null page."""
    import dataclasses

    from gemmaserve import LLM, SamplingParams
    from gemmaserve.attention.triton_backend import TritonAttentionBackend

    path = _tiny(tmp_path, 4)
    llm = LLM(model=str(path), attention_backend="triton", page_size=4)
    eng = llm.engine
    rids = [eng.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in ("abc def ghi jkl", "mnop")]
    for _ in range(2):   # the prompts prefilled (several pages) and one decode step
        eng.step()
    plan = eng._scheduler.schedule()
    assert all(s.num_new_tokens == 1 for s in plan.seqs) and len(plan.seqs) == 2
    runner = eng._runner
    runner.apply(plan)
    ids, pos, md = runner.build_inputs(plan.seqs)
    backend: TritonAttentionBackend = runner.backend
    model = eng._model
    null = eng._kv.num_pages
    snapshot = [(k.clone(), v.clone()) for k, v in runner.kv_cache[:1]]
    with torch.inference_mode():
        ref = model.compute_logits(model(ModelInputs(ids, pos, backend.begin_batch(md, runner.kv_cache))))
        inputs = backend.graph_inputs(8, eng._kv.groups, 64, null, torch.device("cpu"))
        inputs.fill(md, 4)
        attn = inputs.attention(4, md.layer_slot, runner.kv_cache)
        pad_ids = torch.cat([ids, torch.zeros(2, dtype=torch.long)])
        pad_pos = torch.cat([pos, torch.zeros(2, dtype=torch.long)])
        got = model.compute_logits(model(ModelInputs(pad_ids, pad_pos, attn)))[:2]
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
    k_after = runner.kv_cache[0][0]
    bits = lambda t: t.contiguous().view(torch.int32)  # noqa: E731  (bitwise: empty pages may hold NaNs)
    changed = (bits(k_after) != bits(snapshot[0][0])).flatten(1).any(1).nonzero().flatten().tolist()
    live_pages = set()   # every layer views every page of the arena: any layer's live page may change
    for g in md.groups:
        for b, n in enumerate(g.num_blocks):
            live_pages |= set(g.slot_pages[g.block_rows[b, :n]].flatten().tolist())
    assert set(changed) <= live_pages | {null}
    assert dataclasses.is_dataclass(inputs.buffers.view(4))
    for rid in rids:
        eng.abort_request(rid)


# Gemma 3 (1 + w norms, raw v), Gemma 4 sliding (w norms, value norm), full with K = V, a KV-sharing layer.
QKV_LAYOUTS = {
    "gemma3": dict(offset=1.0, value_norm=False, k_eq_v=False, owns_kv=True),
    "gemma4": dict(offset=0.0, value_norm=True, k_eq_v=False, owns_kv=True),
    "gemma4_k_eq_v": dict(offset=0.0, value_norm=True, k_eq_v=True, owns_kv=True),
    "gemma4_shared_kv": dict(offset=0.0, value_norm=True, k_eq_v=False, owns_kv=False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", sorted(QKV_LAYOUTS))
def test_fused_elementwise_kernels_match_the_torch_ops(dtype, layout):
    from gemmaserve.models import fused_kernels as FK
    from gemmaserve.models import fused_ops as FO
    from gemmaserve.models.layers import AttentionParams, RopeKind, RopeParams

    opts = QKV_LAYOUTS[layout]
    kind = FO.NormKind(1e-6, opts["offset"])
    gen = torch.Generator().manual_seed(fresh_seed())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    x = (torch.randn(5, 96, generator=gen) * 3).to(dtype)
    r = torch.randn(5, 96, generator=gen).to(dtype)
    wp, wn = (torch.randn(96, generator=gen) * 0.3).to(dtype), (torch.randn(96, generator=gen) * 0.3).to(dtype)
    scale = torch.tensor([0.7], dtype=dtype)

    def close(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item() < tol

    assert close(FK.rms_norm(x, wp, kind), FO._norm_ref(x, wp, kind))
    assert close(FK.rms_norm(x, None, kind), FO._norm_ref(x, None, kind))
    # A transposed input whose leading dim is 1 (Gemma 3's projector, one image) reshapes to a view
    # with stride != 1 along the normed dim: the kernels must not read it as contiguous rows.
    xt = (torch.randn(1, 96, 7, generator=gen) * 3).to(dtype).transpose(1, 2)
    assert xt.reshape(-1, 96).stride(-1) != 1
    assert close(FK.rms_norm(xt, wp, kind), FO._norm_ref(xt, wp, kind))
    r1, h1 = FK.add_rms_norm(xt, xt, wp, wn, kind)
    r2, h2 = FO.add_rms_norm(xt, xt, wp, wn, kind)
    assert close(r1, r2) and close(h1, h2)
    for s in (None, scale):
        r1, h1 = FK.add_rms_norm(r, x, wp, wn, kind, s)
        r2, h2 = FO.add_rms_norm(r, x, wp, wn, kind, s)
        assert close(r1, r2) and close(h1, h2)
        r1, none = FK.add_rms_norm(r, x, wp, None, kind, s)
        assert none is None and close(r1, r2)
    hq, hkv, d = 4, 2, 16
    p = AttentionParams(layer=0, hidden_size=96, num_heads=hq, num_kv_heads=hkv, head_dim=d, scale=1.0, window=None,
                        norm=kind, value_norm=opts["value_norm"], k_eq_v=opts["k_eq_v"], owns_kv=opts["owns_kv"])
    qkv = torch.randn(3, sum(p.qkv_sizes), generator=gen).to(dtype)
    wq, wk = (torch.randn(d, generator=gen) * 0.3).to(dtype), (torch.randn(d, generator=gen) * 0.3).to(dtype)
    rope = RopeParams(1e4, kind=RopeKind.PROPORTIONAL, partial_rotary_factor=0.5) if opts["k_eq_v"] else RopeParams(1e4)
    cos, sin = RopeParams.cos_sin(rope.inv_freq(d), torch.arange(7, 10), dtype)
    got = FK.qkv_norm_rope(qkv, p, wq, wk if p.owns_kv else None, cos, sin)
    ref = FO.qkv_norm_rope(qkv, p, wq, wk if p.owns_kv else None, cos, sin)
    for g, e in zip(got, ref):
        assert (g is None) == (e is None) and (g is None or close(g, e))
    if opts["k_eq_v"]:   # V is the value-normed raw k projection: neither RoPE nor k_norm
        k_raw = qkv[:, hq * d:].reshape(3, hkv, d)
        assert close(got[2], FO._norm_ref(k_raw, None, kind)) and not close(got[2], got[1])
    gu = (torch.randn(4, 2 * 1500, generator=gen) * 3).to(dtype)
    g, u = gu.split(1500, -1)
    assert close(FK.gelu_mul(gu, 1500), torch.nn.functional.gelu(g.float(), approximate="tanh") * u.float())

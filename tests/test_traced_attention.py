"""Decode attention as a compiled graph traces it (attention/traced.py), run eagerly here: through
real V2 page tables (sliding windows, a full layer, a KV-sharing layer, scratch pages in the prefill
chunks), ragged batches padded with extra rows, against dense attention on fresh random K/V and bit
for bit against the eager backend; the K/V each step commits are what later steps read."""

import dataclasses

import pytest
import torch

from gemmaserve.attention.base import AttentionMetadata
from gemmaserve.attention.blockwise import KEY_BLOCK
from gemmaserve.attention.torch_backend import TorchAttentionBackend
from gemmaserve.attention.traced import MIN_WIDTH, NEW, SEEN, DecodeLayout, DecodeTables, TracedDecodeAttention
from gemmaserve.kv.manager_v1 import KVCacheManagerV1
from gemmaserve.kv.manager_v2 import KVCacheManagerV2
from gemmaserve.kv.spec import AttentionKind, LayerSpec

from helpers import fresh_seed
from test_attention_backend import HQ, SPECS as MIXED_SPECS, _dense

F32 = torch.float32
SPECS = [
    LayerSpec(AttentionKind.SLIDING, 2, 8, F32, window=5),
    LayerSpec(AttentionKind.FULL, 2, 8, F32),
    LayerSpec(AttentionKind.SLIDING, 2, 8, F32, window=5),
    LayerSpec(AttentionKind.SLIDING, 2, 8, F32, window=11),
    LayerSpec(AttentionKind.SLIDING, 2, 8, F32, window=5, kv_source=2),   # reads layer 2's KV
]


def _layout(specs, kv, cache, null_page):
    return DecodeLayout.of(specs, cache, kv.layer_slot, kv.layout.tokens_per_page, null_page)


@pytest.mark.parametrize("scratch", [False, True])
def test_traced_decode_attention_matches_dense_and_commits_what_later_steps_read(scratch):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    lens = [3, 30, 1, 17]          # prompt lengths: one of a single token (nothing old to see)
    decode_steps = 9
    page = 2
    kv = KVCacheManagerV2(SPECS, page, 300, enable_prefix_caching=False, enable_scratch=scratch)
    backend = TorchAttentionBackend()
    null_page = kv.layout.num_pages
    cache = backend.allocate_kv_cache(SPECS, dataclasses.replace(kv.layout, num_pages=null_page + 1),
                                      torch.device("cpu"))
    for k, v in cache:   # torch.empty can hold NaN: what masked keys read must not reach the output
        k.fill_(float("nan")), v.fill_(float("nan"))
    layout = _layout(SPECS, kv, cache, null_page)
    assert isinstance(layout, DecodeLayout), layout
    total = max(lens) + decode_steps
    K = {i: torch.randn(total, 2, 8, generator=gen) for i, s in enumerate(SPECS) if s.owns_kv}
    V = {i: torch.randn(total, 2, 8, generator=gen) for i, s in enumerate(SPECS) if s.owns_kv}
    Q = [torch.randn(total, HQ, 8, generator=gen) for _ in SPECS]
    toks = {b: list(range(total)) for b in range(len(lens))}
    names = [str(b) for b in range(len(lens))]
    # Prompts through the eager backend, 7-token chunks.
    done = [0] * len(lens)
    while any(d < n for d, n in zip(done, lens)):
        batch = [(b, done[b], min(lens[b], done[b] + 7)) for b in range(len(lens)) if done[b] < lens[b]]
        for b, s, e in batch:
            assert kv.allocate(names[b], toks[b], s, e, prefill=True)
        md = AttentionMetadata([e - s for _, s, e in batch], [e for _, _, e in batch],
                               kv.group_tables([names[b] for b, _, _ in batch]), kv.layer_slot)
        attn = backend.begin_batch(md, cache)
        for layer, spec in enumerate(SPECS):
            src = layer if spec.owns_kv else spec.kv_source
            attn(layer, torch.cat([Q[layer][s:e] for _, s, e in batch]), torch.cat([K[src][s:e] for _, s, e in batch]),
                 torch.cat([V[src][s:e] for _, s, e in batch]), scale=0.3, window=spec.window)
        for b, s, e in batch:
            kv.commit(names[b], toks[b], e)
            done[b] = e
    # Decode steps through the traced attention: every sequence one token, padded to 6 rows.
    rows = 6
    for step in range(decode_steps):
        pos = list(done)
        for b in range(len(lens)):
            assert kv.allocate(names[b], toks[b], pos[b], pos[b] + 1, prefill=False)
        md = AttentionMetadata([1] * len(lens), [p + 1 for p in pos], kv.group_tables(names), kv.layer_slot)
        tables = DecodeTables.build(layout, md, rows)
        for keys, state in zip(tables.keys, tables.state):
            assert keys.shape[1] == rows and keys.shape[2] >= MIN_WIDTH and keys.shape[3] == KEY_BLOCK
            assert (keys[:, len(lens):] == layout.null_row).all() and state.shape == (rows, *keys.shape[2:])
            assert ((state.flatten(1) == NEW).sum(1) == 1).all()   # each row's new token, once
            assert (keys.flatten(2)[:, state.flatten(1) != SEEN] == layout.null_row).all()   # nothing else read
        attn = TracedDecodeAttention(layout, layout.kv, tables.keys, tables.state)
        eager = backend.begin_batch(md, cache)   # writes this step's K/V first: the traced reads none of it
        pad = rows - len(lens)
        for layer, spec in enumerate(SPECS):
            src = layer if spec.owns_kv else spec.kv_source
            q = torch.cat([torch.stack([Q[layer][p] for p in pos]), torch.randn(pad, HQ, 8, generator=gen)])
            k = v = None
            if spec.owns_kv:
                k = torch.cat([torch.stack([K[src][p] for p in pos]), torch.randn(pad, 2, 8, generator=gen)])
                v = torch.cat([torch.stack([V[src][p] for p in pos]), torch.randn(pad, 2, 8, generator=gen)])
            want = eager(layer, q[:len(lens)], None if k is None else k[:len(lens)], None if v is None else v[:len(lens)],
                         scale=0.3, window=spec.window)
            out = attn(layer, q, k, v, scale=0.3, window=spec.window)
            assert torch.isfinite(out).all()
            # the same bits as the eager backend's decode rows (what a compiled step must reproduce)
            assert torch.equal(out[:len(lens)], want), (seed, step, layer)
            for b, p in enumerate(pos):
                ref = _dense(Q[layer][p:p + 1], K[src][:p + 1], V[src][:p + 1], torch.tensor([p]), spec.window, 0.3)
                err = (out[b] - ref[0]).abs().max().item()
                assert err < 1e-5, f"seed={seed} scratch={scratch} step={step} layer={layer} seq={b}: {err}"
        new = attn.new_kv()
        assert new.shape == (len(layout.owners), rows, 2, 2, 8)
        tables.commit(layout, new)
        for b in range(len(lens)):
            kv.commit(names[b], toks[b], pos[b] + 1)
            done[b] = pos[b] + 1
        kv.check_integrity()


def test_caches_the_graph_cannot_read_as_one_tensor_say_why():
    page = 2
    backend = TorchAttentionBackend()
    v1 = KVCacheManagerV1(SPECS, page, 50)
    assert "V1" in _layout(SPECS, v1, backend.allocate_kv_cache(SPECS, v1.layout, torch.device("cpu")), 50)
    mixed = KVCacheManagerV2(MIXED_SPECS, page, 50, enable_prefix_caching=False, enable_scratch=False)
    cache = backend.allocate_kv_cache(MIXED_SPECS, mixed.layout, torch.device("cpu"))
    assert "geometry" in _layout(MIXED_SPECS, mixed, cache, 50)
    fp8 = [LayerSpec(s.kind, s.num_kv_heads, s.head_dim, torch.float8_e4m3fn, window=s.window, kv_source=s.kv_source)
           for s in SPECS]
    v2 = KVCacheManagerV2(fp8, page, 50, enable_prefix_caching=False, enable_scratch=False)
    assert "fp8" in _layout(fp8, v2, backend.allocate_kv_cache(fp8, v2.layout, torch.device("cpu")), 50)

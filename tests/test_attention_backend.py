"""The torch attention backend against dense attention, through real V1/V2 page tables: mixed page
geometry (layers with different bytes per token share one arena), scratch pages, KV-sharing layers,
chunked prefill and batched decode, on fresh random K/V."""

import pytest
import torch

from gemmaserve.attention.base import AttentionMetadata
from gemmaserve.attention import torch_backend
from gemmaserve.attention.blockwise import KEY_BLOCK
from gemmaserve.attention.torch_backend import TorchAttentionBackend, query_tiles, visible
from gemmaserve.kv.manager_v1 import KVCacheManagerV1
from gemmaserve.kv.manager_v2 import KVCacheManagerV2
from gemmaserve.kv.spec import AttentionKind, LayerSpec

from helpers import fresh_seed

F32 = torch.float32
SPECS = [
    LayerSpec(AttentionKind.SLIDING, 2, 8, F32, window=5),
    LayerSpec(AttentionKind.FULL, 1, 8, F32),                       # half the bytes per token: 2x tokens/page
    LayerSpec(AttentionKind.SLIDING, 2, 8, F32, window=5),
    LayerSpec(AttentionKind.SLIDING, 2, 8, F32, window=11),
    LayerSpec(AttentionKind.SLIDING, 2, 8, F32, window=5, kv_source=2),   # reads layer 2's KV
    LayerSpec(AttentionKind.FULL, 1, 8, F32, kv_source=1),
]
HQ = 4


def _dense(q, k, v, q_pos, window, scale):
    """q: [n, Hq, D]; k, v: [L, Hkv, D] for positions 0..L-1."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    mask = visible(q_pos, torch.arange(k.shape[0]), window)
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def _scratch_blocks(group_tables, spans):
    """The blocks of a batch mapped to one page for every layer of a multi-layer group (scratch slots) in a
    shared arena (V1's identity slots are page s of each layer's own tensor): (group, its layers, the page,
    the positions of the step's tokens in that block)."""
    out = []
    for gt in group_tables:
        g = gt.group
        if g.num_layers < 2:
            continue
        for b, (s, e) in enumerate(spans):
            for i in range(gt.num_blocks[b]):
                pages = gt.slot_pages[gt.block_rows[b, i]].tolist()
                if len(set(pages)) == 1:
                    block = gt.first_block[b] + i
                    lo, hi = max(s, block * g.tokens_per_page), min(e, (block + 1) * g.tokens_per_page)
                    assert lo < hi, "a scratch block outside the step's tokens"
                    out.append((g.index, g.layers, pages[0], range(lo, hi)))
    return out


def _backend(name: str):
    if name == "torch":
        return TorchAttentionBackend()
    pytest.importorskip("triton")
    from gemmaserve.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


@pytest.mark.parametrize("backend_name, query_block", [("torch", 256), ("torch", 4), ("triton", None)])
@pytest.mark.parametrize("manager, scratch", [("v1", False), ("v2", False), ("v2", True)])
def test_paged_attention_matches_dense(manager, scratch, backend_name, query_block, monkeypatch):
    """`query_block` 4: the torch backend's prefill chunks (11 and 7 tokens) in several query tiles,
    each reading only the key blocks it sees."""
    if query_block is not None:
        monkeypatch.setattr(torch_backend, "QUERY_BLOCK", query_block)
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    lens = [37, 9, 29]
    page = 2
    kv = (KVCacheManagerV1(SPECS, page, 400) if manager == "v1"
          else KVCacheManagerV2(SPECS, page, 400, enable_prefix_caching=False, enable_scratch=scratch))
    backend = _backend(backend_name)
    cache = backend.allocate_kv_cache(SPECS, kv.layout, torch.device("cpu"))
    # Ground truth K/V per owning layer and position; queries per layer and position.
    K = {i: torch.randn(max(lens), s.num_kv_heads, s.head_dim, generator=gen) for i, s in enumerate(SPECS) if s.owns_kv}
    V = {i: torch.randn(max(lens), s.num_kv_heads, s.head_dim, generator=gen) for i, s in enumerate(SPECS) if s.owns_kv}
    Q = [torch.randn(max(lens), HQ, s.head_dim, generator=gen) for s in SPECS]
    done = [0] * len(lens)
    step = scratch_seen = 0
    while any(d < n for d, n in zip(done, lens)):
        # The first step prefills 11-token chunks, the next two mix chunks and decodes, then only decodes
        # (a decode-only batch takes the split-K decode kernel).
        chunk = [11 if step == 0 else (1 if b % 2 or step >= 3 else 7) for b in range(len(lens))]
        batch = [(b, done[b], min(lens[b], done[b] + chunk[b])) for b in range(len(lens)) if done[b] < lens[b]]
        toks = {b: list(range(lens[b])) for b in range(len(lens))}
        for b, s, e in batch:
            assert kv.allocate(str(b), toks[b], s, e, prefill=e - s > 1)
        md = AttentionMetadata([e - s for _, s, e in batch], [e for _, _, e in batch],
                               kv.group_tables([str(b) for b, _, _ in batch]), kv.layer_slot)
        shared = [] if kv.layout.identity_slots else _scratch_blocks(md.groups, [(s, e) for _, s, e in batch])
        scratch_seen += len(shared)
        # the manager's own count agrees with the page tables the backend reads
        assert kv.stats().scratch_pages == len({p for _, _, p, _ in shared})
        attn = backend.begin_batch(md, cache)
        for layer, spec in enumerate(SPECS):
            src = layer if spec.owns_kv else spec.kv_source
            q = torch.cat([Q[layer][s:e] for _, s, e in batch])
            k = torch.cat([K[src][s:e] for _, s, e in batch])
            v = torch.cat([V[src][s:e] for _, s, e in batch])
            out = attn(layer, q, k, v, scale=0.3, window=spec.window)
            # a scratch page holds the keys of the layer that wrote it last (this one, if it is in the
            # page's group): every layer of the group wrote its chunk there, over the previous layer's
            for _, layers, page, positions in shared:
                if layer in layers:
                    t = kv.layout.tokens_per_page[layer]
                    for pos in positions:
                        assert torch.equal(cache[layer][0][page, pos % t], K[layer][pos]), (seed, step, layer, pos)
            row = 0
            for b, s, e in batch:
                ref = _dense(Q[layer][s:e], K[src][:e], V[src][:e], torch.arange(s, e), spec.window, 0.3)
                err = (out[row:row + e - s] - ref).abs().max().item()
                assert err < 1e-5, (f"seed={seed} {backend_name} {manager} scratch={scratch} step={step} "
                                    f"layer={layer} seq={b}: {err}")
                row += e - s
        for b, s, e in batch:
            kv.commit(str(b), toks[b], e)
            done[b] = e
        kv.check_integrity()
        step += 1
    # Scratch on: the first (11-token) chunks put blocks out of the windows of 5 on scratch pages shared by
    # layers 0 and 2; off (or V1): every block has one page per layer.
    assert (scratch_seen > 0) == scratch, f"seed={seed} {manager} scratch={scratch}: {scratch_seen} scratch blocks"


def test_query_tiles_read_only_the_key_blocks_their_queries_see():
    assert KEY_BLOCK == 64   # the spans below are in blocks of 64 keys
    causal = visible(torch.arange(600), torch.arange(640), None)
    assert query_tiles(causal, 256) == [(0, 256, 0, 256), (256, 512, 0, 512), (512, 600, 0, 640)]
    # a window of 100 over queries 20..619 (keys 0..639): each tile starts at the block holding the
    # key 99 before its first query
    window = visible(torch.arange(20, 620), torch.arange(640), 100)
    assert query_tiles(window, 256) == [(0, 256, 0, 320), (256, 512, 128, 576), (512, 600, 384, 640)]
    # an image's tokens (positions 250..269) see the image's later ones: the first tile reads to 270
    q_end = torch.arange(1, 301)
    q_end[250:270] = 270
    image = visible(torch.arange(300), torch.arange(320), None, q_end)
    assert query_tiles(image, 256) == [(0, 256, 0, 320), (256, 300, 0, 320)]


@pytest.mark.parametrize("manager", ["v1", "v2"])
def test_gathers_into_one_reused_buffer_read_what_fresh_ones_do(manager):
    """CPU gathers land in the backend's one buffer (no fresh ~70 MB block per layer): same K/V as a
    fresh gather, the block reused while it is big enough and grown when it is not."""
    kv = KVCacheManagerV1(SPECS, 2, 64) if manager == "v1" else KVCacheManagerV2(SPECS, 2, 64,
                                                                                 enable_prefix_caching=False)
    backend = TorchAttentionBackend()
    cache = backend.allocate_kv_cache(SPECS, kv.layout, torch.device("cpu"))
    for k, v in cache:
        k.normal_(generator=torch.Generator().manual_seed(fresh_seed()))
        v.normal_()
    rows = backend._token_rows(cache)
    buffer = backend._gather
    for layer in (0, 1):
        n = rows[layer].k.shape[0]
        for shape in ((3, 5), (2, 2), (4, n)):
            idx = torch.randint(0, n, (shape[0] * shape[1],))
            want = rows[layer].read(idx, shape, (1.0, 1.0), F32)
            got = rows[layer].read(idx, shape, (1.0, 1.0), F32, buffer)
            assert all(torch.equal(w, g) for w, g in zip(want, got))
            assert got[0].untyped_storage().data_ptr() == buffer._bytes.untyped_storage().data_ptr()
    held = buffer._bytes
    rows[0].read(torch.zeros(4, dtype=torch.long), (2, 2), (1.0, 1.0), F32, buffer)
    assert buffer._bytes is held   # smaller gathers reuse the block

"""Attention arithmetic whose result for a query depends only on that query and the keys it sees.

The same query must give the same bits alone or in a batch, as a decode row or inside a prefill
chunk of any size, with its keys cached or computed in the same step: a last bit is enough to flip
an int8 rounding downstream and then a greedy token. On the CPU `attend` is an op whose C++ kernel
(models/cpu_products.py) sums in an order of its own: per query row, the dot products with the keys
it sees, the exact maximum, exp, then the weighted values and the weights summed over those keys in
increasing position. Keys it does not see are skipped, so how keys are batched, padded or tiled
moves nothing.

Callers hand keys from a block boundary (absolute positions [j*KEY_BLOCK, ...)), so that a prefill
chunk's tiles and a decode row's keys line up the same way; keys a query must not see are masked,
whatever they hold (finite values).

The op's Python kernel (`attend_reference`, the fallback where the C++ library cannot be built) keeps
that layout for the BLAS: one bmm per product, rows padded to whole tiles of ROW_TILE, the value
products per block of exactly KEY_BLOCK keys and a sequential sum over blocks; whether the BLAS then
gives a row its own bits is what the start-up check tells (models/cpu_kernels.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KEY_BLOCK = 64
ROW_TILE = 4   # models/layers.py's
MASKED, SEEN, NEW = 0, 1, 2   # what a key of `attend_paged`'s state is; NEW + d: the new token of the row d before


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, n, Hq, D]; k, v [T, nk, Hkv, D] whose key j sits at absolute position base_t + j (base_t a
    multiple of KEY_BLOCK, nk a multiple of it); visible [T, n, nk] bool (each query sees at least one
    key; masked keys must hold finite values) -> [T, n, Hq, D] in q's dtype.

    T independent key sets: a decode batch is T sequences of n = 1 query, a prefill chunk one set of
    n queries sharing the keys. On the CPU an op (`gemmaserve::attend`, with a C++ kernel making the
    same ATen calls: models/cpu_kernels.py) that a compiled graph calls as it is."""
    if q.device.type == "cpu":
        return torch.ops.gemmaserve.attend(q, k, v, visible, scale)
    return attend_reference(q, k, v, visible, scale)


def attend_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """`attend` as torch ops (the op's Python kernel, and its specification)."""
    t, n, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    if nk % KEY_BLOCK:
        raise ValueError(f"{nk} keys: a multiple of {KEY_BLOCK} expected")
    g = hq // hkv
    rows = n * g
    m = -(-rows // ROW_TILE) * ROW_TILE
    nb = nk // KEY_BLOCK
    dtype = q.dtype
    # [T * Hkv, rows, D]: a kv head's query rows are its g heads of each of the n queries
    qh = (q.float() * scale).view(t, n, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(t * hkv, rows, d)
    if m > rows:   # padding rows (zeros: finite scores) are dropped at the end
        qh = F.pad(qh, (0, 0, 0, m - rows))
    kt = k.float().permute(0, 2, 3, 1).reshape(t * hkv, d, nk)
    s = torch.bmm(qh, kt).view(t, hkv, m, nk)
    mask = visible.view(t, 1, n, 1, nk).expand(t, 1, n, g, nk).reshape(t, 1, rows, nk)
    if m > rows:
        mask = F.pad(mask, (0, 0, 0, m - rows), value=True)
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))                          # [T, Hkv, m, nk]
    pb = p.view(t * hkv, m, nb, KEY_BLOCK).transpose(1, 2).reshape(t * hkv * nb, m, KEY_BLOCK)
    # V with a column of ones: the same product gives the block's weight sum
    vb = torch.empty(t, hkv, nb, KEY_BLOCK, d + 1, dtype=torch.float32, device=v.device)
    vb[..., :d] = v.view(t, nb, KEY_BLOCK, hkv, d).permute(0, 3, 1, 2, 4)
    vb[..., d] = 1.0
    ob = torch.bmm(pb, vb.view(t * hkv * nb, KEY_BLOCK, d + 1)).view(t * hkv, nb, m, d + 1)
    total = ob.cumsum(1)[:, -1] if nb > 1 else ob[:, 0]                 # [T * Hkv, m, D + 1], block by block
    out = total[..., :d] / total[..., d:]
    out = out[:, :rows].view(t, hkv, n, g, d).permute(0, 2, 1, 3, 4).reshape(t, n, hq, d)
    return out.to(dtype)


def block_span(first: int, end: int) -> tuple[int, int]:
    """Absolute key positions [lo, hi) of the blocks covering keys [first, end): lo a multiple of
    KEY_BLOCK, hi - lo a multiple of it."""
    lo = first // KEY_BLOCK * KEY_BLOCK
    hi = -(-end // KEY_BLOCK) * KEY_BLOCK
    return lo, max(hi, lo + KEY_BLOCK)


def attend_paged(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, new: torch.Tensor, state: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """Decode rows' attention straight from a cache of token rows (attention/traced.py): q [T, 1, Hq, D]; kv
    [R, 2, Hkv, D] the cache (K, V of a token row); rows [T, nk] each key's token row; new [T, 2, Hkv, D] the
    step's new K/V; state [T, nk] MASKED (not seen), SEEN, or NEW + d (the new token of row t - d, which the
    cache does not hold yet). The same bits as `attend` over the gathered keys; on the CPU with fp32 cache and
    queries an op whose C++ kernel reads each key where it lies (no gathered copy of every row's keys)."""
    if q.device.type == "cpu" and q.dtype == torch.float32 and kv.dtype == torch.float32:
        return torch.ops.gemmaserve.attend_paged(q, kv, rows, new, state, scale)
    return attend_paged_reference(q, kv, rows, new, state, scale)


def attend_paged_reference(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, new: torch.Tensor,
                           state: torch.Tensor, scale: float) -> torch.Tensor:
    """`attend_paged` as tensor ops (the op's Python kernel, and its specification): gather, put each new token
    in its place, `attend`."""
    b, nk = rows.shape
    old = kv.index_select(0, rows.reshape(-1)).view(b, nk, *kv.shape[1:])             # [T, nk, 2, Hkv, D]
    src = torch.arange(b, device=rows.device)[:, None] - (state.long() - NEW).clamp(min=0)
    fresh = new.to(kv.dtype).index_select(0, src.reshape(-1)).view(b, nk, *new.shape[1:])
    keys = torch.where((state >= NEW)[:, :, None, None, None], fresh, old).to(q.dtype)
    return attend(q, keys.select(2, 0), keys.select(2, 1), (state != MASKED)[:, None, :], scale)


@torch.library.custom_op("gemmaserve::attend_paged", mutates_args=())
def _attend_paged_op(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, new: torch.Tensor, state: torch.Tensor,
                     scale: float) -> torch.Tensor:
    return attend_paged_reference(q, kv, rows, new, state, scale)


@_attend_paged_op.register_fake
def _(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, new: torch.Tensor, state: torch.Tensor,
      scale: float) -> torch.Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("gemmaserve::attend", mutates_args=())
def _attend_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    return attend_reference(q, k, v, visible, scale)


@_attend_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q)

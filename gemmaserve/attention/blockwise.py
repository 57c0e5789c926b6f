"""Attention arithmetic whose result for a query depends only on that query and the keys it sees.

The same query must give the same bits alone or in a batch, as a decode row or inside a prefill
chunk of any size, with its keys cached or computed in the same step. Fused kernels (SDPA's CPU
flash kernel) and BLAS calls reduce in an order that follows the shapes of the call: padding a
decode batch to its widest row, or computing the last prompt token inside its chunk rather than
alone, changed results in the last bits (measured: up to 2e-7), and a last bit is enough to flip
an int8 rounding downstream and then a greedy token. So keys are cut into blocks at absolute
positions, and every reduction over keys has a shape that does not depend on the call:

    keys      [j*KEY_BLOCK, (j+1)*KEY_BLOCK) for absolute block index j (a query's key tensor starts
              at a block boundary; keys it must not see are masked, whatever they hold)
    scores    q . k per element: one bmm whose rows are the query's heads, padded to whole tiles of
              ROW_TILE rows (BLAS computes a partial tile with another kernel, other roundings)
    max       exact in any order
    weights   exp(s - max): elementwise
    blocks    [p | 1] @ [v | 1] per block: one bmm per block of exactly KEY_BLOCK keys gives each
              block's weighted values and weight sum in the same fixed order
    sum       over blocks, sequentially (a scan), so masked blocks before or after add exact zeros
    output    weighted values / weight sum

On this machine's MKL every row of a product padded to whole tiles of 4 rows comes out the same
whatever the row count, its place or the column count (tests/test_row_invariance.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KEY_BLOCK = 64
ROW_TILE = 4   # models/layers.py's


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


@torch.library.custom_op("gemmaserve::attend", mutates_args=())
def _attend_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    return attend_reference(q, k, v, visible, scale)


@_attend_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q)

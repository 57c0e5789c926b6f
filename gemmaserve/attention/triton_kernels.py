"""Triton kernels for paged attention.

Storage per layer: K and V views [pages, T, Hkv, D] (T = the layer's tokens per page) with arbitrary
strides (V2's shared arena interleaves K and V inside a page). A sequence's position p lives at page
`pages[b, p // T - first_block[b]]`, offset `p % T`; `pages` holds only live blocks (a sliding layer's
window), so the kernels never touch out-of-window pages.

* `store_kv`: write new tokens' K/V at their (page, offset).
* `decode_attention`: one query token per sequence; programs split the key range (split-K, for long
  contexts), each handles all query heads of one KV head (GQA); a second kernel merges the splits.
* `prefill_attention`: query tiles of several tokens per sequence (chunked prefill / extend over a
  cached prefix); causal + sliding window masks; keys gathered through the page table.

Numerics: scores and softmax in fp32 (exp2 with log2(e) folded into the scale), output in q's dtype.
Cache tiles are converted to q's dtype as they load (a no-op when the cache has the model's dtype). An
fp8 cache holds fp8(x / scale) (see kv_quant.py): `store_kv` scales, saturates and casts; attention
folds k_scale into the softmax scale and multiplies the output by v_scale, so the same kernels serve
every cache dtype and only the store kernel has an fp8 branch (a constexpr).
Visibility: key k is visible to query q iff k <= q and (no window, or k > q - window). The prefill
kernel optionally takes a per-row end instead of q + 1 (`query_ends`: tokens of one image see the
image's later tokens, which must be in the same chunk or already cached).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_quant import FP8_DTYPE, FP8_MAX

LOG2E = 1.4426950408889634

# Triton compiles one variant per (int == 1, int % 16 == 0, pointer 16-byte aligned) pattern of its
# arguments. The block-table width and the offsets of the per-layer column views of the page tables change
# from step to step, so specialising on them can compile new variants in the middle of a request that the
# startup warm-up did not shape alike (the suspected cause of the first 32K prompt taking 2.9x as long as
# the next one on the H200; `gpu_bench first` counts the variants compiled after warm-up). These index
# arguments are read a few values per program: one generic variant costs nothing measurable.
_PER_STEP_INDEX_ARGS = dict(do_not_specialize=["s_pb"], do_not_specialize_on_alignment=["pages_ptr", "offs_ptr"])


def _block_n(head_dim: int, dtype: torch.dtype) -> int:
    """Keys per tile: a K (and a V) tile of at most 32 KiB, 16..64 rows."""
    esize = torch.empty((), dtype=dtype).element_size()
    return max(16, min(64, (32 << 10) // (triton.next_power_of_2(head_dim) * esize)))


def _warps(head_dim: int) -> int:
    return 8 if head_dim >= 256 else 4


def _precision(dtype: torch.dtype) -> str:
    """fp32 attention must stay fp32 (tf32 would cost ~1e-3 relative error); bf16 is exact in any mode."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _round_to_e4m3(x):
    """x (fp32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32: the cast
    that follows is then exact, whatever rounding the cast itself does. (Triton's CPU interpreter
    rounds fp32 -> fp8 half-up and drops the carry when a mantissa of 0b111 rounds up into an odd
    exponent, e.g. 1.96 -> 1.0; the GPU's cvt.rn is right. Same result on both this way.)"""
    bits = x.to(tl.uint32, bitcast=True)
    # Normal range: keep 3 of fp32's 23 mantissa bits, round the 20 dropped ones to nearest even.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # Subnormals (|x| < 2^-6) are multiples of 2^-9: adding 1.5 * 2^14 rounds x there (IEEE add, RNE).
    subnormal = (x + 24576.0) - 24576.0
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit(**_PER_STEP_INDEX_ARGS)
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, pages_ptr, offs_ptr,
                     s_kt, s_kh, s_vt, s_vh,
                     s_cp, s_co, s_ch, s_vp, s_vo, s_vch, inv_k, inv_v,
                     H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
                     FP8_LIMIT: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    page = tl.load(pages_ptr + t).to(tl.int64)
    off = tl.load(offs_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = d < D
    k = tl.load(k_ptr + t * s_kt + h * s_kh + d, mask=m)
    v = tl.load(v_ptr + t * s_vt + h * s_vh + d, mask=m)
    if FP8:   # saturate: an out-of-range cast would be NaN
        k = _round_to_e4m3(tl.clamp(k.to(tl.float32) * inv_k, -FP8_LIMIT, FP8_LIMIT))
        v = _round_to_e4m3(tl.clamp(v.to(tl.float32) * inv_v, -FP8_LIMIT, FP8_LIMIT))
    tl.store(kc_ptr + page * s_cp + off * s_co + h * s_ch + d, k.to(kc_ptr.dtype.element_ty), mask=m)
    tl.store(vc_ptr + page * s_vp + off * s_vo + h * s_vch + d, v.to(vc_ptr.dtype.element_ty), mask=m)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             pages: torch.Tensor, offsets: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v: [T, Hkv, D]; caches [P, T, Hkv, D] views; pages, offsets: [T] int. An fp8 cache stores
    fp8(k / k_scale), fp8(v / v_scale)."""
    n, h, d = k.shape
    if n == 0:
        return
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    _store_kv_kernel[(n, h)](
        k, v, k_cache, v_cache, pages, offsets,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), 1.0 / k_scale, 1.0 / v_scale,
        H=h, D=d, BLOCK_D=triton.next_power_of_2(d), FP8=k_cache.dtype == FP8_DTYPE, FP8_LIMIT=FP8_MAX)


@triton.jit
def _attend_tile(q, kc_ptr, vc_ptr, page, off, kvh, d, load_mask, visible, m_i, l_i, acc,
                 s_kp, s_ko, s_kh, s_vp, s_vo, s_vh, qk_scale, PRECISION: tl.constexpr):
    """One online-softmax step: load a tile of keys/values through its (page, offset) rows and fold the
    `visible` ones into (running max m, running sum l, accumulator acc) of the query rows in q."""
    k = tl.load(kc_ptr + page[:, None] * s_kp + off[:, None] * s_ko + kvh * s_kh + d[None, :],
                mask=load_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), out_dtype=tl.float32, input_precision=PRECISION) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row that sees nothing yet stays at zero
    # A tile that does not raise a row's maximum (one it cannot see, among others) keeps its state exactly:
    # scale 1 by construction, not by exp2(0) (an approximate instruction on the GPU). Batch invariance
    # needs it: a query meets such tiles inside a prefill chunk and not as a decode row.
    alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_safe))
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(vc_ptr + page[:, None] * s_vp + off[:, None] * s_vo + kvh * s_vh + d[None, :],
                mask=load_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, out_dtype=tl.float32, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit(**_PER_STEP_INDEX_ARGS)
def _decode_split_kernel(q_ptr, kc_ptr, vc_ptr, pages_ptr, first_ptr, lens_ptr,
                         acc_ptr, m_ptr, l_ptr,
                         s_qb, s_qh, s_kp, s_ko, s_kh, s_vp, s_vo, s_vh, s_pb,
                         s_ab, s_ah, s_as, s_mb, s_mh, s_ms,
                         qk_scale, v_scale, WINDOW: tl.constexpr, T: tl.constexpr, G: tl.constexpr,
                         D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    first_block = tl.load(first_ptr + b)
    k_begin = 0
    if WINDOW > 0:
        k_begin = tl.maximum(seq_len - WINDOW, 0)
    # Each sequence's keys are cut into NUM_SPLITS parts (whole tiles), whatever its length: the grid
    # does not depend on context length, so a captured graph serves every step.
    per_split = tl.cdiv(tl.cdiv(seq_len - k_begin, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = k_begin + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gm = g < G
    dm = d < D
    q = tl.load(q_ptr + b * s_qb + (kvh * G + g)[:, None] * s_qh + d[None, :], mask=gm[:, None] & dm[None, :],
                other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pm = pos < hi
        page = tl.load(pages_ptr + b * s_pb + (pos // T - first_block), mask=pm, other=0).to(tl.int64)
        off = (pos % T).to(tl.int64)
        m_i, l_i, acc = _attend_tile(q, kc_ptr, vc_ptr, page, off, kvh, d, pm[:, None] & dm[None, :], pm[None, :],
                                     m_i, l_i, acc, s_kp, s_ko, s_kh, s_vp, s_vo, s_vh, qk_scale, PRECISION)
    heads = kvh * G + g
    tl.store(acc_ptr + b * s_ab + heads[:, None] * s_ah + split * s_as + d[None, :], acc * v_scale,
             mask=gm[:, None] & dm[None, :])
    tl.store(m_ptr + b * s_mb + heads * s_mh + split * s_ms, m_i, mask=gm)
    tl.store(l_ptr + b * s_mb + heads * s_mh + split * s_ms, l_i, mask=gm)


@triton.jit
def _decode_merge_kernel(acc_ptr, m_ptr, l_ptr, out_ptr,
                         s_ab, s_ah, s_as, s_mb, s_mh, s_ms, s_ob, s_oh,
                         NUM_SPLITS: tl.constexpr, S_BLOCK: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_BLOCK)
    d = tl.arange(0, BLOCK_D)
    sm = s < NUM_SPLITS
    m = tl.load(m_ptr + b * s_mb + h * s_mh + s * s_ms, mask=sm, other=float("-inf"))
    l = tl.load(l_ptr + b * s_mb + h * s_mh + s * s_ms, mask=sm, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
    acc = tl.load(acc_ptr + b * s_ab + h * s_ah + s[:, None] * s_as + d[None, :],
                  mask=sm[:, None] & (d < D)[None, :], other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l * w, 0)
    tl.store(out_ptr + b * s_ob + h * s_oh + d, (num / den).to(out_ptr.dtype.element_ty), mask=d < D)


def decode_splits(batch: int, kv_heads: int, max_keys: int, sm_count: int = 132) -> int:
    """Splits per sequence. Enough programs (~8 per SM) that short batches are not latency-bound on a
    few long loops and waves stay even at long context; no split shorter than ~64 keys."""
    want = -(-8 * sm_count // max(1, batch * kv_heads))
    return max(1, min(want, -(-max_keys // 64), 64))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
                     first_block: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int | None,
                     num_splits: int, out: torch.Tensor | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """q: [B, Hq, D] (one token per sequence, at position seq_len - 1); pages: [B, W] page of each live
    block; first_block, seq_lens: [B]. Each sequence's keys are split `num_splits` ways (static, so a
    CUDA graph can capture the launch; see `decode_splits`). k/v_scale: the cache's dequantisation."""
    bsz, hq, d = q.shape
    hkv = k_cache.shape[2]
    t = k_cache.shape[1]
    g = hq // hkv
    acc = torch.empty(bsz, hq, num_splits, d, device=q.device, dtype=torch.float32)
    m = torch.empty(bsz, hq, num_splits, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    block_d = max(16, triton.next_power_of_2(d))
    block_n = _block_n(d, q.dtype)   # tiles live in q's dtype once loaded
    _decode_split_kernel[(bsz, hkv, num_splits)](
        q, k_cache, v_cache, pages, first_block, seq_lens, acc, m, l,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), pages.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1), m.stride(2),
        scale * LOG2E * k_scale, v_scale, WINDOW=window or 0, T=t, G=g, D=d,
        BLOCK_G=max(16, triton.next_power_of_2(g)), BLOCK_D=block_d,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, PRECISION=_precision(q.dtype), num_warps=_warps(d), num_stages=2)
    if out is None:
        out = torch.empty_like(q)
    _decode_merge_kernel[(bsz, hq)](
        acc, m, l, out, acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1), m.stride(2),
        out.stride(0), out.stride(1), NUM_SPLITS=num_splits, S_BLOCK=max(2, triton.next_power_of_2(num_splits)),
        D=d, BLOCK_D=block_d)
    return out


@triton.jit(**_PER_STEP_INDEX_ARGS)
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, pages_ptr, first_ptr, tile_seq_ptr, tile_q_ptr,
                    qstart_ptr, qlen_ptr, lens_ptr, qend_ptr,
                    s_qt, s_qh, s_kp, s_ko, s_kh, s_vp, s_vo, s_vh, s_pb, s_ot, s_oh,
                    qk_scale, v_scale, WINDOW: tl.constexpr, T: tl.constexpr, G: tl.constexpr,
                    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    PRECISION: tl.constexpr, HAS_QEND: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // G
    b = tl.load(tile_seq_ptr + tile)
    q_off = tl.load(tile_q_ptr + tile)          # first query of the tile, relative to the sequence's chunk
    q_row0 = tl.load(qstart_ptr + b)
    q_len = tl.load(qlen_ptr + b)
    seq_len = tl.load(lens_ptr + b)
    first_block = tl.load(first_ptr + b)
    ctx = seq_len - q_len                       # positions before the chunk (cached prefix)
    i = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    qm = (q_off + i) < q_len
    dm = d < D
    q_pos = ctx + q_off + i
    q = tl.load(q_ptr + (q_row0 + q_off + i)[:, None] * s_qt + h * s_qh + d[None, :],
                mask=qm[:, None] & dm[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    last_q = ctx + tl.minimum(q_off + BLOCK_M, q_len) - 1
    if HAS_QEND:   # keys end (exclusive) per row: q + 1, or the end of the row's image
        q_end = tl.load(qend_ptr + q_row0 + q_off + i, mask=qm, other=0)
        last_q = tl.maximum(last_q, tl.max(q_end, 0) - 1)
    else:
        q_end = q_pos + 1
    k_lo = 0
    if WINDOW > 0:
        k_lo = tl.maximum(ctx + q_off - WINDOW + 1, 0)
    k_lo = (k_lo // BLOCK_N) * BLOCK_N
    for start in range(k_lo, last_q + 1, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pm = pos <= last_q
        if WINDOW > 0:
            pm = pm & (pos > ctx + q_off - WINDOW)
        page = tl.load(pages_ptr + b * s_pb + (pos // T - first_block), mask=pm, other=0).to(tl.int64)
        off = (pos % T).to(tl.int64)
        diff = q_pos[:, None] - pos[None, :]
        vis = (pos[None, :] < q_end[:, None]) & pm[None, :]
        if WINDOW > 0:
            vis = vis & (diff < WINDOW)
        m_i, l_i, acc = _attend_tile(q, kc_ptr, vc_ptr, page, off, kvh, d, pm[:, None] & dm[None, :], vis,
                                     m_i, l_i, acc, s_kp, s_ko, s_kh, s_vp, s_vo, s_vh, qk_scale, PRECISION)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
    tl.store(out_ptr + (q_row0 + q_off + i)[:, None] * s_ot + h * s_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=qm[:, None] & dm[None, :])


def prefill_tiles(query_lens: list[int], block_m: int) -> tuple[list[int], list[int]]:
    """(sequence, first query) of every query tile."""
    seqs, starts = [], []
    for b, n in enumerate(query_lens):
        for s in range(0, n, block_m):
            seqs.append(b)
            starts.append(s)
    return seqs, starts


def prefill_block_m(head_dim: int) -> int:
    return 32 if head_dim >= 512 else 64


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
                      first_block: torch.Tensor, query_start: torch.Tensor, query_lens: torch.Tensor,
                      seq_lens: torch.Tensor, tile_seq: torch.Tensor, tile_q: torch.Tensor, scale: float,
                      window: int | None, out: torch.Tensor | None = None, k_scale: float = 1.0,
                      v_scale: float = 1.0, query_ends: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D] rows of all sequences' new tokens (sequence b at rows query_start[b]...);
    tiles from `prefill_tiles(query_lens, prefill_block_m(D))`. k/v_scale: the cache's dequantisation.
    query_ends: [T] int32, the position each row's keys end before (default: causal, q + 1)."""
    ntok, hq, d = q.shape
    hkv, t = k_cache.shape[2], k_cache.shape[1]
    if out is None:
        out = torch.empty_like(q)
    block_d = max(16, triton.next_power_of_2(d))
    block_m = prefill_block_m(d)
    block_n = min(_block_n(d, q.dtype), 32 if block_d >= 256 else 64)
    _prefill_kernel[(tile_seq.shape[0], hq)](
        q, k_cache, v_cache, out, pages, first_block, tile_seq, tile_q, query_start, query_lens, seq_lens,
        query_ends if query_ends is not None else seq_lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), pages.stride(0), out.stride(0), out.stride(1),
        scale * LOG2E * k_scale, v_scale, WINDOW=window or 0, T=t, G=hq // hkv, D=d, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION=_precision(q.dtype), HAS_QEND=query_ends is not None, num_warps=_warps(d), num_stages=2)
    return out

"""The CPU's output head over a Q8_0 table: a 4-bit scan of the whole vocabulary, then the likely tokens exact.

At one decode row the head is a third of the 270M's step: its 262,144 x 640 table is 168 MB of int8, read once
a token at the memory's rate. This head reads half of that. The table is kept twice: as the file's Q8_0 blocks
(the exact weights, and the embedding's lookups) and as 4-bit copies of the same blocks (`pack`: one fp16 scale
per 32 inputs, amax / 7; q = round(w / scale) in -8..7, stored +8). A row's logits are:

    scan     every token: sum over groups g of float(idot_g) * (scale_g * xscale_g), added in increasing g,
             where idot_g is the exact integer dot of the 4-bit weights with the row's activations quantised
             to int8 per group of 32 (xscale_g = amax_g / 127, round half to even). The integer dots are
             exact on every branch (AVX512-VNNI, AVX-512BW, AVX-VNNI where the flags enable it, AVX2, plain C), and the
             floating-point steps are the same in each, so the scan's bits do not depend on the host's ISA,
             the batch or the threads.
    refine   every token whose scanned logit is within `REFINE_MARGIN` of the row's highest: recomputed
             exactly, the hidden state (fp32) against the Q8_0 row, in the products' order
             (cpu_products.py: the same bits as `rows_dot`).

The scan's error (mean |error| ~0.4 logits on the 270M, at most ~4.6 over 1,400 positions of text) is
far below the margin of 12, so the greedy token, and every token that carries probability mass, is the
exact one; the far tail (each token below e^-12 of the top) keeps the scan's value. Measured on the 270M
(BENCHMARKS.md, issue 47): KL from the exact Q8_0 head 0.0004, against 0.0008 for the int8 scan with the
32 highest refined that this replaces; ~2,700 tokens refined a row on average.

Rows are independent: the op's Python kernel (the fallback where the library cannot be built) does the
same operations in the same order, for the same bits.
"""

from __future__ import annotations

import torch

GROUP = 32          # inputs per 4-bit scale: Q8_0's block
TILE = 16           # tokens per packed tile (one 16-lane vector of sums)
REFINE_MARGIN = 12.0


def supports(k: int) -> bool:
    return k % GROUP == 0


def pack(q8: torch.Tensor, s8: torch.Tensor, chunk: int = 16384) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks (int8 q [V, K], fp16 s [V, K / 32]) -> the scan's 4-bit copy: uint8 [ceil(V / 16),
    K / 32 * 256] and fp16 scales [ceil(V / 16), K / 32, 16]. In tile t, group g, bytes p * 64 + i * 4 + e
    (p < 4, token i < 16, e < 4) hold input g * 32 + 8p + e of token 16t + i in the low nibble and input
    g * 32 + 8p + 4 + e in the high one: one 64-byte load gives two sets of four inputs for all 16 tokens, as
    the 8-bit dot instructions take them. Padding tokens are zeros."""
    v, k = q8.shape
    if not supports(k):
        raise ValueError(f"a 4-bit head needs a width divisible by {GROUP}, not {k}")
    groups, tiles = k // GROUP, -(-v // TILE)
    packed = torch.empty(tiles, groups * 256, dtype=torch.uint8)
    scales = torch.zeros(tiles, groups, TILE, dtype=torch.float16)
    for t0 in range(0, tiles, chunk // TILE):
        t1 = min(tiles, t0 + chunk // TILE)
        rows = slice(t0 * TILE, min(v, t1 * TILE))
        qc, sc = q8[rows].view(-1, groups, GROUP), s8[rows].float()
        # amax |w| = amax |q| * s exactly (|q| <= 128, an fp16 s: both exact in fp32): no pass over w for it
        s = (qc.to(torch.int16).abs_().amax(-1).float().mul_(sc).div_(7)).half()            # [n, G]
        sf = s.float()
        w = qc.float().mul_(sc[..., None])                                                   # exact: 8 x 11 bits
        # a zero scale's group is all zeros: divided by 1 it stays 0
        q = w.div_(torch.where(sf > 0, sf, 1)[..., None]).round_().clamp_(-8, 7).add_(8).to(torch.uint8)
        n = t1 * TILE - rows.start
        if len(q) < n:   # the last tile's padding: weight 0 (stored 8), scale 0
            q = torch.cat([q, torch.full((n - len(q), groups, GROUP), 8, dtype=torch.uint8)])
            s = torch.cat([s, s.new_zeros(n - len(s), groups)])
        q = q.view(t1 - t0, TILE, groups, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)              # [t, g, p, half, i, e]
        packed[t0:t1] = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(t1 - t0, groups * 256)
        scales[t0:t1] = s.view(t1 - t0, TILE, groups).transpose(1, 2)
    return packed, scales


def unpack(packed: torch.Tensor, scales: torch.Tensor, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack`'s 4-bit values (int8 -8..7 [V, K]) and scales (fp16 [V, K / 32])."""
    tiles, width = packed.shape
    groups = width // 256
    b = packed.view(tiles, groups, 4, TILE, 4)
    q = torch.stack((b & 0x0F, b >> 4), 3)                                                  # [t, g, p, half, i, e]
    q = q.permute(0, 4, 1, 2, 3, 5).reshape(tiles * TILE, groups * GROUP)[:v]
    return q.to(torch.int8) - 8, scales.transpose(1, 2).reshape(tiles * TILE, groups)[:v]


def quantize_rows(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 rows [M, K] -> (int8 [M, K], fp32 scales [M, G], int32 sums [M, G]) per group of 32:
    xq = round_half_even(x * (127 / amax)), scale = amax / 127 (0 for an all-zero group)."""
    m, k = h.shape
    x = h.view(m, k // GROUP, GROUP)
    amax = x.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / torch.where(amax > 0, amax, 1), 0)
    q = torch.round(x * inv[..., None]).clamp_(-127, 127)
    return q.view(m, k).to(torch.int8), amax / 127, q.sum(-1).to(torch.int32)


def scan_reference(h: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, v: int) -> torch.Tensor:
    """The scan's logits [M, V], operation for operation as the C++ kernel does them."""
    xq, xs, _ = quantize_rows(h)
    q, s = unpack(packed, scales, v)
    groups = xs.shape[1]
    # integer dots per group, exact in float64 (|dot| < 2^15)
    d = torch.einsum("mgi,vgi->mvg", xq.double().view(len(h), groups, GROUP), q.double().view(v, groups, GROUP))
    sf = s.float()
    acc = torch.zeros(len(h), v)
    for g in range(groups):
        acc = acc + d[:, :, g].float() * (sf[:, g][None, :] * xs[:, g][:, None])
    return acc


@torch.library.custom_op("gemmaserve::head_logits", mutates_args=())
def head_logits(h: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, q8: torch.Tensor, s8: torch.Tensor,
                margin: float) -> torch.Tensor:
    """h [M, K] -> logits [M, V]: the 4-bit scan, then every token within `margin` of the row's highest
    recomputed exactly against the Q8_0 rows (q8 int8 [V, K], s8 fp16 [V, K / 32])."""
    h = h.float().contiguous()
    v = q8.shape[0]
    logits = scan_reference(h, packed, scales, v)
    for r in range(len(h)):
        if not v:
            break
        idx = (logits[r] >= logits[r].max() - torch.tensor(margin, dtype=torch.float32)).nonzero().flatten()
        rows = (q8[idx].float().view(len(idx), -1, GROUP) * s8[idx].float()[..., None]).view(len(idx), -1)
        logits[r, idx] = torch.ops.gemmaserve.rows_dot(h[r:r + 1], rows[None])[0]
    return logits


@head_logits.register_fake
def _(h: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, q8: torch.Tensor, s8: torch.Tensor,
      margin: float) -> torch.Tensor:
    return h.new_empty(h.shape[0], q8.shape[0], dtype=torch.float32)


SOURCE = r"""
// ---- the output head: a 4-bit scan of the vocabulary, then the likely tokens exact (models/cpu_head.py) ----
constexpr int64_t HEAD_GROUP = 32, HEAD_TILE = 16, HEAD_ROWS = 8;   // rows per pass over a tile

// The integer dots of one group for R rows and 16 tokens: sums[r][i] = sum over the group's 32 inputs of
// (stored nibble) * xq. Exact in int32 on every branch.
template <int R>
static inline void head_group_dots(const uint8_t* w, const int8_t* const* xq, vint* sums) {
#if defined(__AVX512BW__)
  __m512i acc[R][2];   // the low and high nibbles' sums apart: two dependency chains, not one
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  const __m512i low = _mm512_set1_epi8(0x0F);
#if !defined(__AVX512VNNI__)
  const __m512i ones = _mm512_set1_epi16(1);
#endif
  _mm_prefetch(reinterpret_cast<const char*>(w) + 2048, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(w) + 2048 + 64, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(w) + 2048 + 128, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(w) + 2048 + 192, _MM_HINT_T0);
  for (int p = 0; p < 4; ++p) {
    const __m512i v = _mm512_loadu_si512(w + p * 64);
    const __m512i half[2] = {_mm512_and_si512(v, low), _mm512_and_si512(_mm512_srli_epi16(v, 4), low)};
    for (int j = 0; j < 2; ++j)
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq[r] + p * 8 + j * 4, 4);
        const __m512i x = _mm512_set1_epi32(four);
#if defined(__AVX512VNNI__)
        acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], half[j], x);
#else   // nibble * int8 pairs in int16 (at most 2 * 15 * 127: no saturation), then pairs of those in int32
        acc[r][j] = _mm512_add_epi32(acc[r][j], _mm512_madd_epi16(_mm512_maddubs_epi16(half[j], x), ones));
#endif
      }
  }
  for (int r = 0; r < R; ++r) sums[r] = (vint)_mm512_add_epi32(acc[r][0], acc[r][1]);
#elif defined(__AVX2__)
  __m256i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  const __m256i low = _mm256_set1_epi8(0x0F);
#if !defined(__AVXVNNI__)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int p = 0; p < 4; ++p)
    for (int hh = 0; hh < 2; ++hh) {   // tokens 0..7, then 8..15
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 64 + hh * 32));
      const __m256i half[2] = {_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low)};
      for (int j = 0; j < 2; ++j)
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, xq[r] + p * 8 + j * 4, 4);
          const __m256i x = _mm256_set1_epi32(four);
#if defined(__AVXVNNI__)
          acc[r][hh] = _mm256_dpbusd_avx_epi32(acc[r][hh], half[j], x);
#else
          acc[r][hh] = _mm256_add_epi32(acc[r][hh], _mm256_madd_epi16(_mm256_maddubs_epi16(half[j], x), ones));
#endif
        }
    }
  for (int r = 0; r < R; ++r) std::memcpy(&sums[r], acc[r], sizeof sums[r]);
#else
  for (int r = 0; r < R; ++r) sums[r] = vint{};
  for (int p = 0; p < 4; ++p)
    for (int i = 0; i < HEAD_TILE; ++i)
      for (int e = 0; e < 4; ++e) {
        const uint8_t b = w[p * 64 + i * 4 + e];
        for (int r = 0; r < R; ++r)
          sums[r][i] += int32_t(b & 0x0F) * xq[r][p * 8 + e] + int32_t(b >> 4) * xq[r][p * 8 + 4 + e];
      }
#endif
}

// 16 fp16 values widened to fp32 (exact).
static inline vfloat load_half16(const at::Half* p) {
  vfloat r;
#if defined(__AVX512F__)
  r = (vfloat)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  const __m256 h[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                       _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  std::memcpy(&r, h, sizeof r);
#else
  for (int i = 0; i < HEAD_TILE; ++i) r[i] = static_cast<float>(p[i]);
#endif
  return r;
}

// The indices of a row's values at or above (its highest - margin), in increasing order.
static void head_candidates(const float* row, int64_t v, float margin, std::vector<int64_t>& out) {
  vfloat top = splat(row[0]);
  const int64_t v16 = v - v % VL;
  for (int64_t i = 0; i < v16; i += VL) {
    const vfloat x = load16(row + i);
    top = x > top ? x : top;
  }
  float best = row[0];
  for (int i = 0; i < VL; ++i) best = std::max(best, top[i]);
  for (int64_t i = v16; i < v; ++i) best = std::max(best, row[i]);
  const float bar = best - margin;
  const vfloat barv = splat(bar);
  for (int64_t i = 0; i < v16; i += VL) {
    const vint hit = load16(row + i) >= barv;
    bool any = false;
    for (int l = 0; l < VL; ++l) any |= hit[l] != 0;
    if (any)
      for (int l = 0; l < VL; ++l)
        if (row[i + l] >= bar) out.push_back(i + l);
  }
  for (int64_t i = v16; i < v; ++i)
    if (row[i] >= bar) out.push_back(i);
}

// One token's exact logit: the hidden row against its Q8_0 row, w = q * s (exact in fp32), summed as
// dot_tile<1, 1> sums the dequantised row (16 lanes by fused multiply-add in increasing k, the fixed tree):
// the same bits as rows_dot.
// N tokens at once (independent chains: the fused multiply-adds' latency overlaps), each in that order.
template <int N>
static inline void head_exact(const float* const* x, const int8_t* const* q, const at::Half* const* s, int64_t k,
                              float* const* out) {
  vfloat acc[N];
  for (int n = 0; n < N; ++n) acc[n] = vfloat{};
  for (int64_t g = 0; g < k / HEAD_GROUP; ++g) {
    vfloat sc[N];
    for (int n = 0; n < N; ++n) sc[n] = splat(static_cast<float>(s[n][g]));
    for (int64_t i = g * HEAD_GROUP; i < (g + 1) * HEAD_GROUP; i += VL)
      for (int n = 0; n < N; ++n)
        acc[n] = vfma(load16(x[n] + i), __builtin_convertvector(widen16(q[n] + i), vfloat) * sc[n], acc[n]);
  }
  for (int n = 0; n < N; ++n) *out[n] = lanes_sum(acc[n]);
}

// Tokens [16 t0, 16 t1) for R rows: the groups in increasing order, acc += float(dot - 8 sum x) * (s * xs).
template <int R>
static void head_scan_tiles(const uint8_t* packed, const at::Half* scales, int64_t groups, int64_t t0, int64_t t1,
                            const int8_t* xq, const float* xs, const int32_t* xsum, int64_t k, float* y, int64_t ldy,
                            int64_t v) {
  for (int64_t t = t0; t < t1; ++t) {
    vfloat acc[R];
    for (int r = 0; r < R; ++r) acc[r] = vfloat{};
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* x[R];
      for (int r = 0; r < R; ++r) x[r] = xq + r * k + g * HEAD_GROUP;
      vint sums[R];
      head_group_dots<R>(packed + (t * groups + g) * 256, x, sums);
      const vfloat s = load_half16(scales + (t * groups + g) * HEAD_TILE);
      for (int r = 0; r < R; ++r) {
        const vint d = sums[r] - 8 * xsum[r * groups + g];   // the nibbles are stored +8
        const vfloat prod = __builtin_convertvector(d, vfloat) * (s * splat(xs[r * groups + g]));
        acc[r] = acc[r] + prod;
      }
    }
    const int64_t n = std::min<int64_t>(HEAD_TILE, v - t * HEAD_TILE);
    for (int r = 0; r < R; ++r) {
      float out[HEAD_TILE];
      store16(out, acc[r]);
      std::memcpy(y + r * ldy + t * HEAD_TILE, out, n * sizeof(float));
    }
  }
}

at::Tensor head_logits(const at::Tensor& h_in, const at::Tensor& packed_in, const at::Tensor& scales_in,
                       const at::Tensor& q8_in, const at::Tensor& s8_in, double margin) {
  const at::Tensor h = h_in.to(at::kFloat).contiguous(), packed = packed_in.contiguous();
  const at::Tensor scales = scales_in.contiguous(), q8 = q8_in.contiguous(), s8 = s8_in.contiguous();
  const int64_t m = h.size(0), k = h.size(1), v = q8.size(0), groups = k / HEAD_GROUP;
  const int64_t tiles = (v + HEAD_TILE - 1) / HEAD_TILE;
  TORCH_CHECK(k % HEAD_GROUP == 0 && packed.scalar_type() == at::kByte && packed.size(0) == tiles &&
              packed.size(1) == groups * 256 && scales.scalar_type() == at::kHalf && scales.numel() == tiles * groups * HEAD_TILE &&
              q8.scalar_type() == at::kChar && q8.size(1) == k && s8.scalar_type() == at::kHalf && s8.size(1) == groups,
              "head_logits: h [M, K], packed uint8 [V/16, K/32*256], scales fp16 [V/16, K/32, 16], q8 int8 [V, K], s8 fp16 [V, K/32]");
  at::Tensor y = at::empty({m, v}, h.options());
  if (m == 0 || v == 0) return y;
  const float* hp = h.data_ptr<float>();
  // the rows' activations, per group of 32: int8 values, scale, sum (cpu_head.quantize_rows)
  std::vector<int8_t> xq(m * k);
  std::vector<float> xs(m * groups);
  std::vector<int32_t> xsum(m * groups);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* x = hp + r * k + g * HEAD_GROUP;
      float amax = 0.f;
      for (int i = 0; i < HEAD_GROUP; ++i) amax = std::max(amax, std::fabs(x[i]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int i = 0; i < HEAD_GROUP; ++i) {
        const float q = std::min(127.f, std::max(-127.f, std::nearbyint(x[i] * inv)));
        xq[r * k + g * HEAD_GROUP + i] = static_cast<int8_t>(q);
        sum += static_cast<int32_t>(q);
      }
      xs[r * groups + g] = amax / 127.f;
      xsum[r * groups + g] = sum;
    }
  float* yp = y.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  at::parallel_for(0, tiles, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t c0 = t0; c0 < t1; c0 += 64) {   // 64 tiles (~320 KB at K = 640) pass every row block in L2
      const int64_t c1 = std::min(t1, c0 + 64);
      int64_t r = 0;
      for (; r + HEAD_ROWS <= m; r += HEAD_ROWS)
        head_scan_tiles<HEAD_ROWS>(pp, sp, groups, c0, c1, xq.data() + r * k, xs.data() + r * groups,
                                   xsum.data() + r * groups, k, yp + r * v, v, v);
      for (; r < m; ++r)
        head_scan_tiles<1>(pp, sp, groups, c0, c1, xq.data() + r * k, xs.data() + r * groups,
                           xsum.data() + r * groups, k, yp + r * v, v, v);
    }
  });
  // refine: every token within the margin of its row's highest, exactly (the same order as rows_dot)
  std::vector<std::vector<int64_t>> found(m);
  at::parallel_for(0, m, 1, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) head_candidates(yp + r * v, v, static_cast<float>(margin), found[r]);
  });
  std::vector<std::pair<int64_t, int64_t>> todo;
  for (int64_t r = 0; r < m; ++r)
    for (const int64_t i : found[r]) todo.emplace_back(r, i);
  // by token: a token several rows refine is read from memory once, and the table in increasing order
  // (each output is computed by itself: the order of the work does not change its bits)
  if (m > 1)
    std::sort(todo.begin(), todo.end(), [](const auto& a, const auto& b) {
      return a.second != b.second ? a.second < b.second : a.first < b.first;
    });
  const int8_t* qp = q8.data_ptr<int8_t>();
  const at::Half* s8p = s8.data_ptr<at::Half>();
  constexpr int N = 4, AHEAD = 8;   // tokens per pass; rows prefetched this many tokens ahead (random rows)
  at::parallel_for(0, static_cast<int64_t>(todo.size()), 64, [&](int64_t a, int64_t b) {
    for (int64_t j = a; j < b; j += N) {
      for (int64_t f = j + AHEAD; f < std::min(b, j + AHEAD + N); ++f)
        for (int64_t line = 0; line < k; line += 64)
          __builtin_prefetch(qp + todo[f].second * k + line, 0, 3);
      const float* x[N];
      const int8_t* q[N];
      const at::Half* sc[N];
      float* out[N];
      const int n = static_cast<int>(std::min<int64_t>(N, b - j));
      for (int t = 0; t < N; ++t) {
        const auto [r, i] = todo[j + std::min(t, n - 1)];   // a short last pass repeats its last token
        x[t] = hp + r * k;
        q[t] = qp + i * k;
        sc[t] = s8p + i * groups;
        out[t] = yp + r * v + i;
      }
      head_exact<N>(x, q, sc, k, out);
    }
  });
  return y;
}
"""

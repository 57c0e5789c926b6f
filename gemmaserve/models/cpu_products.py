"""Products on the CPU whose summation order is ours: a row's bits never depend on the batch or the host's BLAS.

A BLAS picks its kernel, its tiles and its split of the reduction by the shape of the call: MKL on an
AMX Xeon rounded a row of a 13-row product differently from the same row alone, padded to 4-row tiles or
not, and PyTorch's int4/int8 weight-only kernels switch to oneDNN's brgemm above a few rows. A greedy
token must not follow the rest of the batch, so every product of the CPU's default path runs here, and
each output element is summed in one order, the same whatever else is computed beside it:

    dot(x, w) over k < K     16 lanes: lane l sums x[k] * w[k] for k = l, l + 16, l + 32, ... by fused
                             multiply-add, in increasing k; the lanes are added in a fixed tree (lane l
                             takes l + 8, then l + 4, l + 2, l + 1); then the terms k >= K - K % 16, by
                             fused multiply-add in increasing k.

A fused multiply-add rounds once, so the AVX-512, AVX2 (two halves), NEON and scalar forms of a lane's
chain give the same bits: a row's result depends on the row and the weights only, on any x86 host
class, at any thread count and split. Register tiles (several rows and columns at once) and the
threads' split change which outputs are computed together, never an output's order.

Ops (C++ kernels in `SOURCE`, registered with models/cpu_kernels.py's library; each op's Python kernel
is the fallback where the library cannot be built, on the BLAS, which the start-up check then judges):

    linear(x, w)                    x [M, K] fp32, w [N, K] fp32 -> x w^T
    grouped_linear(x, w, ends)      rows of expert e (ends[e-1]:ends[e]) times w[e]^T, w [E, N, K]
    rows_dot(h, rows)               h [M, H] . rows [M, k, H] -> [M, k]
    int4_mm(x, q, scale, minus)     w = fma(q, scale, -minus) per group of 32 inputs (q 0..15, two per
                                    byte: `pack_int4`), then the dot above: the same bits as `linear`
                                    of the dequantised weight
    int8_mm(x, q, scale)            w = q * scale (one scale per row; exact in fp32), then the dot
    attend(q, k, v, visible, scale) per query row: s_j = dot(q * scale, k_j) for the keys it sees,
                                    p_j = exp(s_j - max s), out = (sum_j p_j v_j) / (sum_j p_j), both sums
                                    in increasing key order (the values by fused multiply-add): keys it
                                    does not see are skipped, so its result is the same alone, in a batch
                                    and inside any prefill chunk
"""

from __future__ import annotations

import torch

GROUP = 32   # int4 inputs per scale (quant.py's GROUP)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] of 0..15 -> uint8 [N, K / 2]: each group of 32 inputs as 16 bytes, byte i holding
    input i in its low nibble and input 16 + i in its high one (one 16-byte load gives the group's two
    lane vectors)."""
    n, k = q.shape
    g = q.to(torch.uint8).view(n, k // GROUP, 2, GROUP // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """`pack_int4`'s inverse."""
    n, half = packed.shape
    g = packed.view(n, half // (GROUP // 2), GROUP // 2)
    return torch.stack((g & 0x0F, g >> 4), 2).reshape(n, 2 * half)


def int4_weight(q: torch.Tensor, scale: torch.Tensor, minus: torch.Tensor) -> torch.Tensor:
    """The fp32 weight `int4_mm` multiplies by: fma(q, scale, -minus) per group, rounded once. (float64
    holds q * scale - minus exactly unless the two terms are over 2^25 apart, where the larger alone decides
    the fp32 value: rounding it to fp32 is the fused multiply-add's single rounding.)"""
    n, k = q.shape
    w = q.view(n, k // GROUP, GROUP).double() * scale.double()[..., None] - minus.double()[..., None]
    return w.view(n, k).float()


SOURCE = r"""
// ---- products in an order of our own (models/cpu_products.py) ----------------------------------
typedef float vfloat __attribute__((vector_size(64)));
typedef uint16_t vbf16 __attribute__((vector_size(32)));
typedef uint32_t vuint __attribute__((vector_size(64)));
typedef int32_t vint __attribute__((vector_size(64)));
constexpr int64_t VL = 16;

static inline vfloat load16(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
static inline vfloat load16(const at::BFloat16* p) {   // bf16 -> fp32 is exact: the bits shifted up
  vbf16 h;
  std::memcpy(&h, p, sizeof h);
  return (vfloat)(__builtin_convertvector(h, vuint) << 16);
}
static inline float load1(const float* p) { return *p; }
static inline float load1(const at::BFloat16* p) { return static_cast<float>(*p); }
static inline void store16(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }
static inline vfloat splat(float v) {   // (not vfloat{} + v: that adds, and 0 + -0 is +0)
#if defined(__AVX512F__)
  return (vfloat)_mm512_set1_ps(v);
#else
  vfloat r;
  for (int i = 0; i < VL; ++i) r[i] = v;
  return r;
#endif
}

// 16 bytes widened to 32-bit lanes (GCC's generic byte-vector conversion goes through scalars on x86).
static inline vint widen16(const uint8_t* p) {
#if defined(__AVX512F__)
  return (vint)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  __m256i h[2] = {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
                  _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
  vint r;
  std::memcpy(&r, h, sizeof r);
  return r;
#else
  vint r;
  for (int i = 0; i < VL; ++i) r[i] = p[i];
  return r;
#endif
}
static inline vint widen16(const int8_t* p) {
#if defined(__AVX512F__)
  return (vint)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  __m256i h[2] = {_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
                  _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
  vint r;
  std::memcpy(&r, h, sizeof r);
  return r;
#else
  vint r;
  for (int i = 0; i < VL; ++i) r[i] = p[i];
  return r;
#endif
}

// a * b + c, rounded once, lane by lane: the same bits from every branch.
static inline vfloat vfma(vfloat a, vfloat b, vfloat c) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  __m256 a2[2], b2[2], c2[2];
  std::memcpy(a2, &a, sizeof a);
  std::memcpy(b2, &b, sizeof b);
  std::memcpy(c2, &c, sizeof c);
  c2[0] = _mm256_fmadd_ps(a2[0], b2[0], c2[0]);
  c2[1] = _mm256_fmadd_ps(a2[1], b2[1], c2[1]);
  vfloat r;
  std::memcpy(&r, c2, sizeof r);
  return r;
#elif defined(__ARM_NEON)
  float32x4_t a4[4], b4[4], c4[4];
  std::memcpy(a4, &a, sizeof a);
  std::memcpy(b4, &b, sizeof b);
  std::memcpy(c4, &c, sizeof c);
  for (int i = 0; i < 4; ++i) c4[i] = vfmaq_f32(c4[i], a4[i], b4[i]);
  vfloat r;
  std::memcpy(&r, c4, sizeof r);
  return r;
#else
  vfloat r;
  for (int i = 0; i < VL; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}

// The lanes added in the fixed tree: lane l takes l + 8, then l + 4, l + 2, l + 1 (the halves of a register
// added, then the halves of that: the same pairs with shuffles as with scalars).
static inline float lanes_sum(vfloat v) {
#if defined(__AVX512F__) || defined(__AVX__)
  __m256 h[2];
  std::memcpy(h, &v, sizeof h);
  const __m256 v8 = _mm256_add_ps(h[0], h[1]);                                            // l + 8
  const __m128 v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));  // l + 4
  const __m128 v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));                                 // l + 2
  return _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 1)));                        // l + 1
#else
  float l[VL];
  std::memcpy(l, &v, sizeof l);
  for (int h = VL / 2; h > 0; h /= 2)
    for (int i = 0; i < h; ++i) l[i] = l[i] + l[i + h];
  return l[0];
#endif
}

// Register tiles: rows x columns of accumulators that fit the vector registers (32 of 16 lanes with
// AVX-512; 16 of 8 lanes, half a vfloat each, with AVX2 and NEON).
#if defined(__AVX512F__)
constexpr int TILE_R = 4, TILE_C = 4;
#else
constexpr int TILE_R = 2, TILE_C = 2;
#endif

// y[r * ldy + c] = dot(x_r, w_c) for R rows of x (stride ldx) and C rows of w (stride ldw), k inputs.
template <int R, int C>
static inline void dot_tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, float* y,
                            int64_t ldy) {
  vfloat acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vfloat{};
  const int64_t k16 = k - k % VL;
  for (int64_t i = 0; i < k16; i += VL) {
    vfloat wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load16(w + c * ldw + i);
    for (int r = 0; r < R; ++r) {
      const vfloat xv = load16(x + r * ldx + i);
      for (int c = 0; c < C; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = lanes_sum(acc[r][c]);
      for (int64_t i = k16; i < k; ++i) s = std::fma(x[r * ldx + i], w[c * ldw + i], s);
      y[r * ldy + c] = s;
    }
}

// Rows [r0, r1) of x against columns [c0, c1) of w, in register tiles (edges with 1-wide tiles: the
// same order per output).
static void dot_block(const float* x, int64_t ldx, int64_t r0, int64_t r1, const float* w, int64_t ldw, int64_t c0,
                      int64_t c1, int64_t k, float* y, int64_t ldy) {
  int64_t r = r0;
  for (; r + TILE_R <= r1; r += TILE_R) {
    int64_t c = c0;
    for (; c + TILE_C <= c1; c += TILE_C)
      dot_tile<TILE_R, TILE_C>(x + r * ldx, ldx, w + c * ldw, ldw, k, y + r * ldy + c, ldy);
    for (; c < c1; ++c) dot_tile<TILE_R, 1>(x + r * ldx, ldx, w + c * ldw, ldw, k, y + r * ldy + c, ldy);
  }
  for (; r < r1; ++r) {
    int64_t c = c0;
    for (; c + TILE_C <= c1; c += TILE_C)
      dot_tile<1, TILE_C>(x + r * ldx, ldx, w + c * ldw, ldw, k, y + r * ldy + c, ldy);
    for (; c < c1; ++c) dot_tile<1, 1>(x + r * ldx, ldx, w + c * ldw, ldw, k, y + r * ldy + c, ldy);
  }
}

// Columns in blocks that stay in L2 (~128 KB) while every row passes them (`bytes` per column); at least
// two blocks per thread where the columns allow.
static int64_t column_block(int64_t n, int64_t bytes) {
  int64_t cb = std::max<int64_t>(TILE_C, (int64_t(1) << 17) / std::max<int64_t>(1, bytes) / TILE_C * TILE_C);
  const int64_t threads = at::get_num_threads();
  while (cb > TILE_C && (n + cb - 1) / cb < 2 * threads) cb = std::max<int64_t>(TILE_C, cb / 2 / TILE_C * TILE_C);
  return cb;
}

static void linear_into(const float* x, int64_t m, int64_t ldx, const float* w, int64_t n, int64_t k, float* y,
                        int64_t ldy) {
  if (m == 0 || n == 0) return;
  const int64_t cb = column_block(n, 4 * k);
  at::parallel_for(0, (n + cb - 1) / cb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      dot_block(x, ldx, 0, m, w, k, b * cb, std::min(n, (b + 1) * cb), k, y, ldy);
  });
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w_in) {
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && x_in.size(1) == w_in.size(1), "linear: x [M, K], w [N, K]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous(), w = w_in.to(at::kFloat).contiguous();
  const int64_t m = x.size(0), n = w.size(0), k = x.size(1);
  at::Tensor y = at::empty({m, n}, x.options());
  linear_into(x.data_ptr<float>(), m, k, w.data_ptr<float>(), n, k, y.data_ptr<float>(), n);
  return y.to(x_in.scalar_type());
}

at::Tensor grouped_linear(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& ends_in) {
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 3 && x_in.size(1) == w_in.size(2),
              "grouped_linear: x [M, K], w [E, N, K]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous(), w = w_in.to(at::kFloat).contiguous();
  const at::Tensor ends = ends_in.to(at::kLong).contiguous();
  const int64_t m = x.size(0), e = w.size(0), n = w.size(1), k = w.size(2);
  TORCH_CHECK(ends.numel() == e, "grouped_linear: one row end per expert");
  at::Tensor y = at::empty({m, n}, x.options());
  const int64_t* ep = ends.data_ptr<int64_t>();
  for (int64_t g = 0, start = 0; g < e; start = ep[g], ++g) {
    const int64_t stop = std::min(ep[g], m);
    TORCH_CHECK(stop >= start, "grouped_linear: row ends must not decrease");
    linear_into(x.data_ptr<float>() + start * k, stop - start, k, w.data_ptr<float>() + g * n * k, n, k,
                y.data_ptr<float>() + start * n, n);
  }
  return y.to(x_in.scalar_type());
}

at::Tensor rows_dot(const at::Tensor& h_in, const at::Tensor& rows_in) {
  const at::Tensor h = h_in.to(at::kFloat).contiguous(), rows = rows_in.to(at::kFloat).contiguous();
  const int64_t m = rows.size(0), kk = rows.size(1), d = rows.size(2);
  at::Tensor y = at::empty({m, kk}, h.options());
  const float* hp = h.data_ptr<float>();
  const float* rp = rows.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, m, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dot_block(hp + i * d, d, 0, 1, rp + i * kk * d, d, 0, kk, d, yp + i * kk, kk);
  });
  return y.to(h_in.scalar_type());
}

// -- quantised weights: each tile dequantises its columns once for all its rows -----------------------
// int4: a group of 32 inputs is 16 bytes (low nibbles inputs 0..15, high ones 16..31); w = fma(q, s, -m).
template <int R, int C>
static inline void int4_tile(const float* x, int64_t ldx, const uint8_t* q, const float* s, const float* mn,
                             int64_t groups, float* y, int64_t ldy) {
  vfloat acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vfloat{};
  for (int64_t g = 0; g < groups; ++g) {
    vfloat w0[C], w1[C];
    for (int c = 0; c < C; ++c) {
      // the bytes widened first: shifts and masks of 32-bit lanes are single instructions (of bytes, not on x86)
      const vint u = widen16(q + c * groups * 16 + g * 16);
      const vfloat sc = splat(s[c * groups + g]), neg = splat(-mn[c * groups + g]);
      w0[c] = vfma(__builtin_convertvector(u & 0x0F, vfloat), sc, neg);
      w1[c] = vfma(__builtin_convertvector(u >> 4, vfloat), sc, neg);
    }
    for (int r = 0; r < R; ++r) {
      const vfloat x0 = load16(x + r * ldx + g * 32), x1 = load16(x + r * ldx + g * 32 + 16);
      for (int c = 0; c < C; ++c) acc[r][c] = vfma(x1, w1[c], vfma(x0, w0[c], acc[r][c]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = lanes_sum(acc[r][c]);
}

// int8 rows with one scale each: w = q * s (exact in fp32 for bf16 scales).
template <int R, int C>
static inline void int8_tile(const float* x, int64_t ldx, const int8_t* q, const float* s, int64_t k, float* y,
                             int64_t ldy) {
  vfloat acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vfloat{};
  const int64_t k16 = k - k % VL;
  for (int64_t i = 0; i < k16; i += VL) {
    vfloat wv[C];
    for (int c = 0; c < C; ++c) {
      wv[c] = __builtin_convertvector(widen16(q + c * k + i), vfloat) * splat(s[c]);
    }
    for (int r = 0; r < R; ++r) {
      const vfloat xv = load16(x + r * ldx + i);
      for (int c = 0; c < C; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float t = lanes_sum(acc[r][c]);
      for (int64_t i = k16; i < k; ++i) t = std::fma(x[r * ldx + i], static_cast<float>(q[c * k + i]) * s[c], t);
      y[r * ldy + c] = t;
    }
}

// M x N outputs in register tiles, column blocks over the threads; `tile(R, C, row, column)`.
template <typename Tile>
static void quant_product(int64_t m, int64_t n, int64_t bytes, Tile tile) {
  if (m == 0 || n == 0) return;
  const int64_t cb = column_block(n, bytes);
  at::parallel_for(0, (n + cb - 1) / cb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t c0 = b * cb, c1 = std::min(n, (b + 1) * cb);
      using R = std::integral_constant<int, TILE_R>;
      using C = std::integral_constant<int, TILE_C>;
      using one = std::integral_constant<int, 1>;
      int64_t r = 0;
      for (; r + TILE_R <= m; r += TILE_R) {
        int64_t c = c0;
        for (; c + TILE_C <= c1; c += TILE_C) tile(R{}, C{}, r, c);
        for (; c < c1; ++c) tile(R{}, one{}, r, c);
      }
      for (; r < m; ++r) {
        int64_t c = c0;
        for (; c + TILE_C <= c1; c += TILE_C) tile(one{}, C{}, r, c);
        for (; c < c1; ++c) tile(one{}, one{}, r, c);
      }
    }
  });
}

at::Tensor int4_mm(const at::Tensor& x_in, const at::Tensor& q_in, const at::Tensor& s_in, const at::Tensor& m_in) {
  const at::Tensor x = x_in.to(at::kFloat).contiguous(), q = q_in.contiguous();
  const at::Tensor s = s_in.to(at::kFloat).contiguous(), mn = m_in.to(at::kFloat).contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0), groups = k / 32;
  TORCH_CHECK(k % 32 == 0 && q.size(1) * 2 == k && q.scalar_type() == at::kByte && s.size(1) == groups,
              "int4_mm: x [M, K], q uint8 [N, K / 2], scales [N, K / 32]");
  at::Tensor y = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = s.data_ptr<float>();
  const float* mp = mn.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  quant_product(m, n, k / 2 + groups * 8, [&](auto R, auto C, int64_t r, int64_t c) {
    int4_tile<decltype(R)::value, decltype(C)::value>(xp + r * k, k, qp + c * groups * 16, sp + c * groups,
                                                      mp + c * groups, groups, yp + r * n + c, n);
  });
  return y.to(x_in.scalar_type());
}

at::Tensor int8_mm(const at::Tensor& x_in, const at::Tensor& q_in, const at::Tensor& s_in) {
  const at::Tensor x = x_in.to(at::kFloat).contiguous(), q = q_in.contiguous(), s = s_in.to(at::kFloat).contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0);
  TORCH_CHECK(q.size(1) == k && q.scalar_type() == at::kChar && s.numel() == n,
              "int8_mm: x [M, K], q int8 [N, K], scales [N]");
  at::Tensor y = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  quant_product(m, n, k, [&](auto R, auto C, int64_t r, int64_t c) {
    int8_tile<decltype(R)::value, decltype(C)::value>(xp + r * k, k, qp + c * k, sp + c, k, yp + r * n + c, n);
  });
  return y.to(x_in.scalar_type());
}

// -- attention ------------------------------------------------------------------------------------------
// One unit: query rows [r0, r1) of kv head h of key set t (row i * g + j: query i, head h * g + j).
// k and v are read through their strides (ks/vs: key set, key, head; elements of a head contiguous), so a view
// into a larger cache (the compiled step's K/V, one tensor with both) needs no copy.
static void attend_rows(const float* q, const float* k, const float* v, const bool* vis, float* out, int64_t t,
                        int64_t h, int64_t r0, int64_t r1, int64_t n, int64_t nk, int64_t hq, int64_t hkv, int64_t d,
                        const int64_t* ks, const int64_t* vs, float scale, std::vector<float>& qs,
                        std::vector<float>& p) {
  const int64_t g = hq / hkv, rows = r1 - r0;
  qs.resize(rows * d);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = (r0 + r) / g, j = (r0 + r) % g;
    const float* src = q + ((t * n + i) * hq + h * g + j) * d;
    for (int64_t e = 0; e < d; ++e) qs[r * d + e] = src[e] * scale;
  }
  const bool* seen = vis + t * n * nk;
  auto sees = [&](int64_t r, int64_t key) { return seen[((r0 + r) / g) * nk + key]; };
  int64_t lo = nk, hi = 0;   // the keys any of these rows sees
  for (int64_t r = 0; r < rows; r += 1)
    if (r == 0 || (r0 + r) / g != (r0 + r - 1) / g)
      for (int64_t key = 0; key < nk; ++key)
        if (sees(r, key)) {
          lo = std::min(lo, key);
          hi = std::max(hi, key + 1);
        }
  float* o = out;
  if (hi <= lo) {   // sees nothing (callers never ask): zeros
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = (r0 + r) / g, j = (r0 + r) % g;
      std::fill_n(o + ((t * n + i) * hq + h * g + j) * d, d, 0.0f);
    }
    return;
  }
  const int64_t span = hi - lo, ldk = ks[1], ldv = vs[1];
  const float* kh = k + t * ks[0] + lo * ldk + h * ks[2];   // this head's keys and values from key `lo`
  const float* vh = v + t * vs[0] + lo * ldv + h * vs[2];
  p.assign(rows * span, 0.0f);
  // scores, tile by tile (a tile no row of which sees a key of is skipped)
  for (int64_t r = 0; r < rows; r += TILE_R) {
    const int64_t rr = std::min<int64_t>(TILE_R, rows - r);
    for (int64_t c = 0; c < span; c += TILE_C) {
      const int64_t cc = std::min<int64_t>(TILE_C, span - c);
      bool any = false;
      for (int64_t a = 0; a < rr && !any; ++a)
        for (int64_t b = 0; b < cc && !any; ++b) any = sees(r + a, lo + c + b);
      if (any) dot_block(qs.data() + r * d, d, 0, rr, kh + c * ldk, ldk, 0, cc, d, p.data() + r * span + c, span);
    }
  }
  // softmax weights: the exact maximum over the keys a row sees, then exp; 0 where it does not see
  std::vector<float> den(rows);
  for (int64_t r = 0; r < rows; ++r) {
    float* pr = p.data() + r * span;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < span; ++c)
      if (sees(r, lo + c)) mx = std::max(mx, pr[c]);
    float sum = 0.0f;
    for (int64_t c = 0; c < span; ++c) {
      if (sees(r, lo + c)) {
        pr[c] = std::exp(pr[c] - mx);
        sum = sum + pr[c];
      } else {
        pr[c] = 0.0f;
      }
    }
    den[r] = sum;
  }
  // weighted values: per output, the keys in increasing order by fused multiply-add (0 * v adds exact
  // zeros for a key another row of the tile sees)
  constexpr int DC = TILE_C;   // vectors of d per pass
  const int64_t d16 = d - d % VL;
  for (int64_t r = 0; r < rows; r += TILE_R) {
    const int64_t rr = std::min<int64_t>(TILE_R, rows - r);
    int64_t c_lo = span, c_hi = 0;
    for (int64_t a = 0; a < rr; ++a)
      for (int64_t c = 0; c < span; ++c)
        if (sees(r + a, lo + c)) {
          c_lo = std::min(c_lo, c);
          c_hi = std::max(c_hi, c + 1);
        }
    float* dst[TILE_R];
    for (int64_t a = 0; a < rr; ++a) {
      const int64_t i = (r0 + r + a) / g, j = (r0 + r + a) % g;
      dst[a] = o + ((t * n + i) * hq + h * g + j) * d;
    }
    for (int64_t e0 = 0; e0 < d16; e0 += DC * VL) {
      const int64_t nv = std::min<int64_t>(DC, (d16 - e0) / VL);
      vfloat acc[TILE_R][DC];
      for (int a = 0; a < TILE_R; ++a)
        for (int b = 0; b < DC; ++b) acc[a][b] = vfloat{};
      for (int64_t c = c_lo; c < c_hi; ++c) {
        vfloat vv[DC];
        for (int64_t b = 0; b < nv; ++b) vv[b] = load16(vh + c * ldv + e0 + b * VL);
        for (int64_t a = 0; a < rr; ++a) {
          const vfloat pa = splat(p[(r + a) * span + c]);
          for (int64_t b = 0; b < nv; ++b) acc[a][b] = vfma(pa, vv[b], acc[a][b]);
        }
      }
      for (int64_t a = 0; a < rr; ++a)
        for (int64_t b = 0; b < nv; ++b) store16(dst[a] + e0 + b * VL, acc[a][b] / splat(den[r + a]));
    }
    for (int64_t e = d16; e < d; ++e)
      for (int64_t a = 0; a < rr; ++a) {
        float acc = 0.0f;
        for (int64_t c = c_lo; c < c_hi; ++c) acc = std::fma(p[(r + a) * span + c], vh[c * ldv + e], acc);
        dst[a][e] = acc / den[r + a];
      }
  }
}

at::Tensor attend(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& visible,
                  double scale) {
  // K and V as given where a head's elements are contiguous (a strided view of the step's K/V: no copy)
  auto heads = [](const at::Tensor& x) {
    const at::Tensor f = x.to(at::kFloat);
    return f.dim() == 4 && f.stride(3) == 1 ? f : f.contiguous();
  };
  const at::Tensor q = q_in.to(at::kFloat).contiguous(), k = heads(k_in), v = heads(v_in);
  const at::Tensor vis = visible.to(at::kBool).contiguous();
  const int64_t ks[3] = {k.stride(0), k.stride(1), k.stride(2)}, vs[3] = {v.stride(0), v.stride(1), v.stride(2)};
  const int64_t t = q.size(0), n = q.size(1), hq = q.size(2), d = q.size(3), nk = k.size(1), hkv = k.size(2);
  TORCH_CHECK(hq % hkv == 0 && vis.size(0) == t && vis.size(1) == n && vis.size(2) == nk, "attend: shapes");
  at::Tensor out = at::empty(q.sizes(), q.options());
  const int64_t rows = n * (hq / hkv);
  // units of query rows: enough for every thread, and a score buffer of at most ~1M floats each
  const int64_t threads = at::get_num_threads(), sets = t * hkv;
  int64_t per = std::max<int64_t>(1, std::min<int64_t>(rows, (int64_t(1) << 20) / std::max<int64_t>(1, nk)));
  if (sets * ((rows + per - 1) / per) < threads) per = std::max<int64_t>(1, (rows * sets + threads - 1) / threads);
  const int64_t units_per_set = (rows + per - 1) / per;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* bp = vis.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, sets * units_per_set, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> qs, p;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t set = u / units_per_set, part = u % units_per_set;
      const int64_t r0 = part * per, r1 = std::min(rows, r0 + per);
      attend_rows(qp, kp, vp, bp, op, set / hkv, set % hkv, r0, r1, n, nk, hq, hkv, d, ks, vs, sc, qs, p);
    }
  });
  return out.to(q_in.scalar_type());
}

// attention/blockwise.py's attend_paged: decode rows (one query each) whose keys are read where they lie, key j
// of row t the cache's token row rows[t, j], or where state[t, j] >= NEW (2) the step's new K/V of row
// t - (state - NEW); masked where state is 0. Each unit copies its head's keys and values into a buffer of its
// own, then runs attend_rows on it: the values attend's caller would gather, so the same bits, without writing
// (and reading back) a gathered copy of every row's keys.
at::Tensor attend_paged(const at::Tensor& q_in, const at::Tensor& kv, const at::Tensor& rows_in,
                        const at::Tensor& new_in, const at::Tensor& state_in, double scale) {
  TORCH_CHECK(kv.scalar_type() == at::kFloat && kv.dim() == 4 && kv.size(1) == 2 && kv.stride(3) == 1 &&
              kv.stride(2) == kv.size(3), "attend_paged: a float cache [R, 2, Hkv, D], a head's elements contiguous");
  const at::Tensor q = q_in.to(at::kFloat).contiguous(), fresh = new_in.to(at::kFloat).contiguous();
  const at::Tensor rows_t = rows_in.to(at::kLong).contiguous(), state = state_in.to(at::kInt).contiguous();
  const int64_t t = q.size(0), n = q.size(1), hq = q.size(2), d = q.size(3), nk = rows_t.size(1), hkv = kv.size(2);
  TORCH_CHECK(n == 1 && hq % hkv == 0 && kv.size(3) == d && rows_t.size(0) == t && state.size(0) == t &&
              state.size(1) == nk && fresh.size(0) == t && fresh.size(1) == 2 && fresh.size(2) == hkv &&
              fresh.size(3) == d, "attend_paged: shapes");
  const at::Tensor vis = state.ne(0).view({t, 1, nk}).contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  const int64_t rows = hq / hkv;
  const int64_t threads = at::get_num_threads(), sets = t * hkv;
  int64_t per = rows;
  if (sets < threads) per = std::max<int64_t>(1, (rows * sets + threads - 1) / threads);
  const int64_t units_per_set = (rows + per - 1) / per;
  const float* qp = q.data_ptr<float>();
  const float* cache = kv.data_ptr<float>();
  const float* np = fresh.data_ptr<float>();
  const int64_t* rp = rows_t.data_ptr<int64_t>();
  const int32_t* st = state.data_ptr<int32_t>();
  const bool* bp = vis.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int64_t c0 = kv.stride(0), c1 = kv.stride(1), c2 = kv.stride(2);
  const int64_t ks[3] = {0, d, 0};   // the buffers: one head's keys (values), key after key
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, sets * units_per_set, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> qs, p, kb(nk * d), vb(nk * d);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t set = u / units_per_set, part = u % units_per_set, row = set / hkv, h = set % hkv;
      for (int64_t j = 0; j < nk; ++j) {
        const int32_t s = st[row * nk + j];
        const int64_t src = s >= 2 ? row - (s - 2) : rp[row * nk + j];   // a new token's row, or a cache row
        TORCH_CHECK(src >= 0 && src < (s >= 2 ? t : kv.size(0)), "attend_paged: key ", j, " of row ", row,
                    " points outside ", s >= 2 ? "the step's rows" : "the cache");
        const float* kj = s >= 2 ? np + (src * 2 * hkv + h) * d : cache + src * c0 + h * c2;
        const float* vj = s >= 2 ? kj + hkv * d : kj + c1;
        std::memcpy(kb.data() + j * d, kj, d * sizeof(float));
        std::memcpy(vb.data() + j * d, vj, d * sizeof(float));
      }
      const int64_t r0 = part * per, r1 = std::min(rows, r0 + per);
      attend_rows(qp, kb.data(), vb.data(), bp, op, row, h, r0, r1, n, nk, hq, hkv, d, ks, ks, sc, qs, p);
    }
  });
  return out.to(q_in.scalar_type());
}
// ---- end of products ------------------------------------------------------------------------------
"""

"""C++ kernels of our CPU custom ops, built once with inductor's C++ toolchain.

Each op is defined in Python (`torch.library.custom_op`, whose Python kernel always works) and gets
a C++ kernel here, registered for the CPU dispatch key, which the dispatcher prefers:

* `gemmaserve::row_affine(x, a_t, block)`: the activations of a quantised int8 matrix, rotated
  (quant.py's `Rotation`: Hadamard butterflies within blocks of `block` channels, then A mixing the
  blocks) and mapped row by row onto [0, 1]: xn = (x - min) / (max - min). fbgemm quantises its input
  with one scale per call; a batch of rows that each span exactly [0, 1] gets the scale 1/255 and the
  zero point 0 whatever else is in it, so every row's product is its own (quant.py's `Int8Matmul`).
  Both kernels do the same IEEE operations in the same order (butterflies, one scaling, A's sum from
  j = 0, the affine map), which a test checks. In C++ it is one call instead of ~20 tensor ops.
* `gemmaserve::fbgemm_int8_linear(x, shape, packed, col_offsets, bias)`: PyTorch's fbgemm int8 x int8
  linear; `gemmaserve::int8_linear`: row_affine, that product and the map back in one call (each call
  of a custom op from a compiled graph costs ~10 us of argument handling: 240 a step of the 270M).
* `lora_add` (lora.py): each adapter slot's rows of y plus (x A^T) B^T; for stacked ranks up to 32 row by
  row as fp32 dot products in vectors of 16 (one call per projection instead of ~8 ATen calls per adapter in
  the batch; the rows of all the call's adapters spread over the threads; A and B in fp32 or bf16; roundings
  of their own, like the norms': within ~1e-6 of the Python kernel's MKL products), above it through MKL as
  the Python kernel does. Every row is independent of the others either way.
* `linear`: fp32 x W^T with the rows padded to whole tiles of 4 (layers.py: MKL rounds a partial tile
  differently). `int4_mm`: PyTorch's int4 kernel with the group size fixed (quant.py: a graph's
  argument, not a tensor constant).
* `rms_norm`, `add_rms_norm` (fused_ops.py): one pass per row in C++, with roundings of their own (a
  sum in 16 lanes); the Python kernels are ATen's composite norm, ~17 us a call. A process runs one or
  the other for every step: `cpu_library.load()` comes before the first.
* `gelu_mul`, `rope_tables`, `softcap`, `attend`, `rows_dot` (fused_ops.py, layers.py,
  attention/blockwise.py, quant.py): the C++ kernel makes its Python kernel's ATen calls in the same
  order, so the same bits.

All are ops so that a compiled decode graph calls them as they are: inductor's own fused versions
sum and round in other orders (1-5e-7 apart), and a last bit is enough to flip a greedy token.

Built with inductor's toolchain (the one compiled graphs need anyway; no ninja; its cache keeps the
library across processes: ~30 s the first time, then a load). Where it cannot be built the Python
kernels serve: the same results but for the norms' last bits.
"""

from __future__ import annotations

import math

import torch

# `lora_add`: stacked ranks up to this run the C++ row loop, higher ones MKL's products (BENCHMARKS.md, issue 32);
# engine/lora.py holds the former's weights in bf16 over quantised projections.
LORA_LOOP_RANK = 32

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

constexpr int64_t LORA_LOOP_RANK = @LORA_LOOP_RANK@;   // stacked ranks above this take the GEMM

namespace {
@PRODUCTS@

at::Tensor fbgemm_int8_linear(const at::Tensor& x, const at::Tensor& shape, const at::Tensor& packed,
                              const at::Tensor& col_offsets, const at::Tensor& bias) {
  return at::fbgemm_linear_int8_weight_fp32_activation(x, shape, packed, col_offsets, 1.0, 0, bias);
}

// quant.py's row_affine_reference, operation for operation (compiled without FP contraction).
std::tuple<at::Tensor, at::Tensor, at::Tensor> row_affine(const at::Tensor& x_in, const at::Tensor& a_t_in,
                                                          int64_t block) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "row_affine takes a 2-D float tensor");
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor out = at::empty({m, k}, x.options());
  at::Tensor lo = at::empty({m, 1}, x.options());
  at::Tensor span = at::empty({m, 1}, x.options());
  const int64_t n = block > 0 ? k / block : 0;
  const at::Tensor a_t = a_t_in.contiguous();
  const float* a = n > 1 ? a_t.data_ptr<float>() : nullptr;
  const float scale = block > 0 ? static_cast<float>(1.0 / std::sqrt(static_cast<double>(block))) : 1.0f;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* lop = lo.data_ptr<float>();
  float* sp = span.data_ptr<float>();
  at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> y(k);
    for (int64_t r = r0; r < r1; ++r) {
      const float* src = xp + r * k;
      float* dst = op + r * k;
      if (block > 0) {
        for (int64_t i = 0; i < k; ++i) y[i] = src[i];
        for (int64_t c = 0; c < n; ++c) {
          float* yb = y.data() + c * block;
          for (int64_t h = 1; h < block; h *= 2)
            for (int64_t i = 0; i < block; i += 2 * h)
              for (int64_t j = i; j < i + h; ++j) {
                const float u = yb[j], v = yb[j + h];
                yb[j] = u + v;
                yb[j + h] = u - v;
              }
          for (int64_t i = 0; i < block; ++i) yb[i] = yb[i] * scale;
        }
        if (n > 1) {
          for (int64_t i = 0; i < n; ++i)
            for (int64_t t = 0; t < block; ++t) {
              float acc = 0.0f;
              for (int64_t j = 0; j < n; ++j) {
                const float p = a[i * n + j] * y[j * block + t];
                acc = acc + p;
              }
              dst[i * block + t] = acc;
            }
        } else {
          for (int64_t i = 0; i < k; ++i) dst[i] = y[i];
        }
      } else {
        for (int64_t i = 0; i < k; ++i) dst[i] = src[i];
      }
      float mn = dst[0], mx = dst[0];
      for (int64_t i = 1; i < k; ++i) {
        mn = std::min(mn, dst[i]);
        mx = std::max(mx, dst[i]);
      }
      float s = mx - mn;
      if (!(s > 0.0f)) s = 1.0f;
      for (int64_t i = 0; i < k; ++i) dst[i] = (dst[i] - mn) / s;
      lop[r] = mn;
      sp[r] = s;
    }
  });
  return {out, lo, span};
}
// The ops below make the ATen calls of their Python kernels, one for one and in order (same kernels,
// same bits): fused_ops.py's _norm_ref and _gelu_mul_ref, layers.py's _rope_tables and _softcap,
// attention/blockwise.py's attend_reference.
// RMSNorm of one row, in one pass: the sum of squares in 16 running sums (lane j takes elements j,
// j + 16, ...) added up in lane order, then x * rstd * (w + offset). A row's result depends only on the
// row (and its width): ~1 us where the composite ATen norm took ~17 us in ~6 kernels. Its own roundings,
// not the Python kernel's (which a process without these kernels runs for every step instead).
static inline void norm_row(const float* x, float* y, int64_t h, const float* w, float offset, float eps) {
  float acc[16] = {0.0f};
  int64_t i = 0;
  for (; i + 16 <= h; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] = acc[j] + x[i + j] * x[i + j];
  for (int j = 0; i + j < h; ++j) acc[j] = acc[j] + x[i + j] * x[i + j];
  float ss = 0.0f;
  for (int j = 0; j < 16; ++j) ss = ss + acc[j];
  const float rstd = 1.0f / std::sqrt(ss * (1.0f / static_cast<float>(h)) + eps);
  if (w) {
    for (int64_t k = 0; k < h; ++k) y[k] = x[k] * rstd * (w[k] + offset);
  } else {
    for (int64_t k = 0; k < h; ++k) y[k] = x[k] * rstd;
  }
}

static const float* float_data(const std::optional<at::Tensor>& t, at::Tensor& keep) {
  if (!t.has_value()) return nullptr;
  keep = t->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

at::Tensor rms_norm(const at::Tensor& x_in, const std::optional<at::Tensor>& w, double eps, double offset) {
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t h = x.size(-1), rows = h ? x.numel() / h : 0;
  at::Tensor out = at::empty(x.sizes(), x.options()), wk;
  const float* wp = float_data(w, wk);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * h, op + r * h, h, wp, offset, eps);
  });
  return out.to(x_in.scalar_type());
}

// residual + RMSNorm_post(x), times `scale` if given, and RMSNorm_next of that (fused_ops.add_rms_norm):
// the Python kernel's operations, row by row.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& residual, const at::Tensor& x_in,
                                                const at::Tensor& w_post, const std::optional<at::Tensor>& w_next,
                                                double eps, double offset, const std::optional<at::Tensor>& scale) {
  const at::Tensor x = x_in.to(at::kFloat).contiguous(), res = residual.to(at::kFloat).contiguous();
  const int64_t h = x.size(-1), rows = h ? x.numel() / h : 0;
  at::Tensor r = at::empty(x.sizes(), x.options());
  at::Tensor out = w_next.has_value() ? at::empty(x.sizes(), x.options()) : at::empty({0}, x.options());
  at::Tensor k1, k2, k3;
  const float* wp = float_data(w_post, k1);
  const float* wn = float_data(w_next, k2);
  const float* sp = float_data(scale, k3);
  const float* xp = x.data_ptr<float>();
  const float* rp0 = res.data_ptr<float>();
  float* rp = r.data_ptr<float>();
  float* op = wn ? out.data_ptr<float>() : nullptr;
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    std::vector<float> y(h);
    for (int64_t row = r0; row < r1; ++row) {
      norm_row(xp + row * h, y.data(), h, wp, offset, eps);
      float* rr = rp + row * h;
      const float* res_row = rp0 + row * h;
      for (int64_t k = 0; k < h; ++k) rr[k] = res_row[k] + y[k];
      if (sp) for (int64_t k = 0; k < h; ++k) rr[k] = rr[k] * sp[0];
      if (wn) norm_row(rr, op + row * h, h, wn, offset, eps);
    }
  });
  return {r.to(residual.scalar_type()), out.to(residual.scalar_type())};
}

at::Tensor gelu_mul(const at::Tensor& gate_up, int64_t intermediate) {
  std::vector<at::Tensor> parts = gate_up.split(intermediate, -1);
  const at::Tensor rows = parts[0].reshape({-1, intermediate});
  at::Tensor out = at::empty(rows.sizes(), rows.options());
  const bool inference = c10::InferenceMode::is_enabled();   // (worker threads do not inherit it)
  at::parallel_for(0, rows.size(0), 1, [&](int64_t r0, int64_t r1) {   // (nested: each gelu on one thread)
    c10::InferenceMode mode(inference);
    for (int64_t i = r0; i < r1; ++i) out.select(0, i).copy_(at::gelu(rows.select(0, i), "tanh"));
  });
  return out.view(parts[0].sizes()) * parts[1];
}

std::tuple<at::Tensor, at::Tensor> rope_tables(const at::Tensor& positions, const at::Tensor& inv_freq) {
  at::Tensor angles = positions.to(at::kFloat).unsqueeze(1) * inv_freq.unsqueeze(0);
  at::Tensor emb = at::cat({angles, angles}, -1);
  return {emb.cos(), emb.sin()};
}

at::Tensor softcap(const at::Tensor& x, double cap) {
  return at::tanh(x / cap) * cap;
}

// quant.py's _int8_linear_ref: row_affine, fbgemm's product (beside the guard rows), its rows' scales, the map back.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& a_t, int64_t block, const at::Tensor& shape,
                       const at::Tensor& packed, const at::Tensor& col_offsets, const at::Tensor& bias,
                       const at::Tensor& scales, const at::Tensor& row_sums, const at::Tensor& guard) {
  auto [xn, lo, span] = row_affine(x, a_t, block);
  const int64_t rows = xn.size(0);
  if (guard.size(0) > 0) xn = at::cat({xn, guard});   // the 7-bit classes' guard row (quant.py)
  at::Tensor y = at::fbgemm_linear_int8_weight_fp32_activation(xn, shape, packed, col_offsets, 1.0, 0, bias);
  if (guard.size(0) > 0) y = y.narrow(0, 0, rows);
  y.mul_(scales);
  return y * span + lo * row_sums;
}

// LoRA's per-row loop, explicitly vectorised (the build turns loop vectorisation off) on the products'
// vectors of 16 floats (cpu_products.py): lane by lane the same IEEE operations whatever registers -march
// picks, so the ISA never changes a bit.

// The line `d` bytes past p (in another adapter's weights: `lora_row`), asked for ahead of its use (into L2:
// an adapter's share of a projection is tens of KB).
static inline void prefetch_at(const void* p, std::ptrdiff_t d) {
  if (d) __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + d), 0, 2);
}

// xa[t] = a_t . x for G rank rows of a at once (G independent chains, G streams of A read side by side): 16
// partial sums per rank, added in a fixed tree, then the tail. Depends only on the two rows and `in`.
template <int G, typename W>
static inline void lora_dots(const W* a, const float* x, int64_t in, float* xa, std::ptrdiff_t ahead) {
  vfloat acc[G] = {};
  int64_t k = 0;
  for (; k + VL <= in; k += VL) {
    const vfloat xv = load16(x + k);
    for (int t = 0; t < G; ++t) {
      prefetch_at(a + t * in + k, ahead);
      acc[t] += load16(a + t * in + k) * xv;
    }
  }
  for (int t = 0; t < G; ++t) {
    float l[VL];
    std::memcpy(l, &acc[t], sizeof l);
    for (int h = VL / 2; h > 0; h /= 2)
      for (int i = 0; i < h; ++i) l[i] = l[i] + l[i + h];
    float sum = l[0];
    for (int64_t kk = k; kk < in; ++kk) sum += load1(a + t * in + kk) * x[kk];
    xa[t] = sum;
  }
}

// One row: xa = A x, then y += xa B over each rank's nonzero outputs (B stored transposed, [r, out]; spans
// [r, 2]). Each output adds rank 0's term first, then rank 1's, ...: its own order whatever the split. Ranks
// with the same span (a fused projection's part) go together, output block by output block: their rows of B
// are read side by side (streams the prefetchers keep up with) and y's block is loaded and stored once.
// `a_ahead`, `b_ahead`: byte offsets to the next row's A and B if it has another adapter of the same shape
// (else 0): each line read here asks for the same line there, so a decode step's next adapter streams in
// while this one is used.
template <typename W>
static void lora_row(const float* x, float* y, const W* a, const W* b, const int64_t* spans, int64_t r,
                     int64_t in, int64_t out, std::ptrdiff_t a_ahead, std::ptrdiff_t b_ahead) {
  float xa[LORA_LOOP_RANK];
  int64_t j = 0;
  for (; j + 8 <= r; j += 8) lora_dots<8>(a + j * in, x, in, xa + j, a_ahead);
  for (; j + 4 <= r; j += 4) lora_dots<4>(a + j * in, x, in, xa + j, a_ahead);
  for (; j < r; ++j) lora_dots<1>(a + j * in, x, in, xa + j, a_ahead);
  for (int64_t j0 = 0, j1; j0 < r; j0 = j1) {
    const int64_t lo = spans[2 * j0], hi = spans[2 * j0 + 1];
    for (j1 = j0 + 1; j1 < r && spans[2 * j1] == lo && spans[2 * j1 + 1] == hi; ++j1) {}
    int64_t o = lo;
    for (; o + VL <= hi; o += VL) {
      vfloat acc = load16(y + o);
      for (int64_t t = j0; t < j1; ++t) {
        prefetch_at(b + t * out + o, b_ahead);
        acc = acc + load16(b + t * out + o) * xa[t];
      }
      store16(y + o, acc);
    }
    for (; o < hi; ++o) {
      float acc = y[o];
      for (int64_t t = j0; t < j1; ++t) acc = acc + load1(b + t * out + o) * xa[t];
      y[o] = acc;
    }
  }
}

at::Tensor lora_add(const at::Tensor& y_in, const at::Tensor& x_in, at::TensorList rows, at::TensorList a,
                    at::TensorList bt, at::TensorList spans) {
  // Each row on its own (lora_row), the rows of every adapter of the call spread over the threads: a row's
  // bits never depend on the other rows or on the split, and no ATen call is made per adapter. Which way a
  // projection's delta is computed depends only on its adapter's stacked rank, never on the batch. A and B
  // may be held in bf16 (engine/lora.py says when); the arithmetic is fp32 either way.
  at::Tensor y = y_in.contiguous().clone();
  if (x_in.scalar_type() != at::kFloat || y.scalar_type() != at::kFloat) {
    for (size_t i = 0; i < rows.size(); ++i) {
      at::Tensor d = ::linear(::linear(x_in.index_select(0, rows[i]), a[i]), bt[i].t());
      y = y.index_add(0, rows[i], d.to(y.scalar_type()));
    }
    return y;
  }
  const at::Tensor x = x_in.contiguous();
  const int64_t in = x.size(1), out = y.size(1);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  struct Slot { const void* a; const void* b; const int64_t* spans; const int64_t* rows; int64_t r; bool bf16; };
  std::vector<at::Tensor> keep;
  std::vector<Slot> slots;
  std::vector<std::pair<int64_t, int64_t>> work;   // (slot, row of y)
  for (size_t i = 0; i < rows.size(); ++i) {
    const bool bf16 = a[i].scalar_type() == at::kBFloat16;
    TORCH_CHECK(a[i].scalar_type() == bt[i].scalar_type() && (bf16 || a[i].scalar_type() == at::kFloat),
                "lora_add: A and B in fp32 or bf16, alike");
    if (a[i].size(0) > LORA_LOOP_RANK) {   // high ranks: MKL's products (rows padded to tiles) pay off
      at::Tensor d = ::linear(::linear(x.index_select(0, rows[i]), a[i].to(at::kFloat)), bt[i].to(at::kFloat).t());
      y.index_add_(0, rows[i], d);   // (a slot's rows are no other slot's: the loop below never touches them)
      continue;
    }
    for (const at::Tensor& t : {a[i].contiguous(), bt[i].contiguous(), spans[i].contiguous(), rows[i].contiguous()})
      keep.push_back(t);
    const size_t k = keep.size() - 4;
    slots.push_back({keep[k].data_ptr(), keep[k + 1].data_ptr(), keep[k + 2].data_ptr<int64_t>(),
                     keep[k + 3].data_ptr<int64_t>(), a[i].size(0), bf16});
    for (int64_t n = 0; n < rows[i].numel(); ++n)
      work.emplace_back(static_cast<int64_t>(slots.size()) - 1, slots.back().rows[n]);
  }
  at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t w0, int64_t w1) {   // any split, same bits
    for (int64_t w = w0; w < w1; ++w) {
      const Slot& s = slots[work[w].first];
      const int64_t row = work[w].second;
      std::ptrdiff_t a_ahead = 0, b_ahead = 0;
      if (w + 1 < w1 && work[w + 1].first != work[w].first) {
        const Slot& n = slots[work[w + 1].first];
        if (n.r == s.r && n.bf16 == s.bf16) {
          a_ahead = reinterpret_cast<uintptr_t>(n.a) - reinterpret_cast<uintptr_t>(s.a);
          b_ahead = reinterpret_cast<uintptr_t>(n.b) - reinterpret_cast<uintptr_t>(s.b);
        }
      }
      if (s.bf16)
        lora_row(xp + row * in, yp + row * out, static_cast<const at::BFloat16*>(s.a),
                 static_cast<const at::BFloat16*>(s.b), s.spans, s.r, in, out, a_ahead, b_ahead);
      else
        lora_row(xp + row * in, yp + row * out, static_cast<const float*>(s.a), static_cast<const float*>(s.b),
                 s.spans, s.r, in, out, a_ahead, b_ahead);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(gemmaserve, CPU, m) {
  m.impl("fbgemm_int8_linear", &fbgemm_int8_linear);
  m.impl("row_affine", &row_affine);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("int8_linear", &int8_linear);
  m.impl("gelu_mul", &gelu_mul);
  m.impl("rope_tables", &rope_tables);
  m.impl("softcap", &softcap);
  m.impl("attend", &attend);
  m.impl("attend_paged", &attend_paged);
  m.impl("rows_dot", &rows_dot);
  m.impl("int4_mm", &int4_mm);
  m.impl("int8_mm", &int8_mm);
  m.impl("linear", &linear);
  m.impl("grouped_linear", &grouped_linear);
  m.impl("lora_add", &lora_add);
  m.impl("head_logits", &head_logits);
}
"""


def row_affine_reference(x: torch.Tensor, a_t: torch.Tensor, block: int) -> tuple[torch.Tensor, ...]:
    """x [M, K] fp32 -> (xn [M, K], lo [M, 1], span [M, 1]): x rotated (butterflies within blocks of
    `block` channels, scaled by block^-1/2, then the blocks mixed by A: out_i = sum_j a_t[i, j] y_j,
    summed from j = 0; no rotation where block is 0), then mapped onto [0, 1] per row. The C++
    kernel's operations in its order, as tensor ops (the fallback, and its specification)."""
    m, k = x.shape
    y = x.float()
    if block:
        n = k // block
        y = y.reshape(m, n, block)
        h = 1
        while h < block:
            pairs = y.view(m, n, block // (2 * h), 2, h)
            u, v = pairs[..., 0, :], pairs[..., 1, :]
            y = torch.stack((u + v, u - v), -2).view(m, n, block)
            h *= 2
        y = y * torch.tensor(1.0 / math.sqrt(block), dtype=torch.float32)
        if n > 1:
            acc = torch.zeros_like(y)
            for j in range(n):
                acc = acc + a_t[:, j, None] * y[:, j:j + 1, :]
            y = acc
        y = y.reshape(m, k)
    lo = y.amin(-1, keepdim=True)
    span = y.amax(-1, keepdim=True) - lo
    span = torch.where(span > 0, span, torch.ones_like(span))
    return (y - lo) / span, lo, span


@torch.library.custom_op("gemmaserve::row_affine", mutates_args=())
def _row_affine(x: torch.Tensor, a_t: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return row_affine_reference(x, a_t, block)


@_row_affine.register_fake
def _(x: torch.Tensor, a_t: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape[0], 1), x.new_empty(x.shape[0], 1)


OPS = ("fbgemm_int8_linear", "int8_linear", "row_affine", "rms_norm", "add_rms_norm", "gelu_mul", "rope_tables",
       "softcap", "attend", "attend_paged", "rows_dot", "int4_mm", "int8_mm", "linear", "grouped_linear",
       "lora_add", "head_logits")

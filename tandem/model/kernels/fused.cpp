// The small per-layer operations of a Llama-family layer, one call each instead of the 3-8
// PyTorch ops (and as many Python-level dispatches) they take in model/layers.py. At one
// running request a decode step is ~120 matmuls of a few microseconds and ~1,000 such small
// ops; vLLM's CPU backend fuses the same set (csrc/cpu: layernorm, activation, pos_encoding).
//
// Each computes what the torch path computes, in the same precision at each step: inputs
// widened to float, every intermediate the torch path rounds to the model's dtype rounded to
// it here too (bf16 products, sums), and RMSNorm sums in the order of torch's sum kernel: the
// results equal the torch path's bit for bit (tests/model/test_fused_kernels.py). The one
// exception is masked_softmax_, within an ulp of bf16 of torch's softmax (see there).
//
// rms_norm(x, weight, eps, lanes) -> out:             weight * (x / rms(x)), x [T, H]
// add_rms_norm(x, residual, weight, eps, lanes) -> out: residual += x (in place), then the norm
//                                                     of residual: the layer's skip connection
//                                                     and the next norm in one pass
// rope_(x, cos, sin):                                 x = x * cos + roll(x, D / 2) * sin, in
//                                                     place; x [T, heads, D] (rows strided),
//                                                     cos, sin [T, 1, D] (sin signed)
// silu_and_mul(x) -> out:                             silu(x[:, :I]) * x[:, I:], x [T, 2I]
// masked_softmax_(scores, mask, scale):              a grouped attention's softmax, in place
// write_kv(k_cache, v_cache, slots, k, v[, k_scales, v_scales]):
//                                                     cache.view(-1, KVH, D)[slots[t]] = k[t]
//                                                     (and v), k, v [T, KVH, D] (rows strided);
//                                                     an 8-bit cache's values and scales as
//                                                     kv_quant.quantize_kv computes them
//
// DecodeStack: a decode-only step's whole layer stack in one call, for a model whose
// projections are int4 (a GGUF's own blocks, or --quantization int4). Python's cost per op
// (module calls, attribute lookups, argument parsing) is ~1.5-2 ms of a 7 ms batch-1 step;
// a GPU engine removes it with CUDA graphs, which CPUs do not have. It makes the same calls
// in the same order as model/llama.py with these kernels bound (torch's int4 matmul or, past
// its rows on AMX, dequant.cpp's int4_gemm; the ops above; paged_attention.cpp's decode
// kernel), so its output is the Python path's to the bit (tests/model/test_fused_kernels.py).

// The decode kernel, for DecodeStack; before the pragma below, so it compiles as in its own
// module.
#define TANDEM_PAGED_ATTENTION_NO_MODULE
#include "paged_attention.cpp"
#undef TANDEM_PAGED_ATTENTION_NO_MODULE
// ... and the AMX int4 matmul (int4_gemm), for steps past torch's int4 kernel's rows.
#define TANDEM_DEQUANT_NO_MODULE
#include "dequant.cpp"
#undef TANDEM_DEQUANT_NO_MODULE

#include <ATen/Parallel.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/add.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

// torch's eager ops round each product and sum separately; a contracted a * b + c (FMA)
// would not, and float32 results would differ from the torch path in the last bit.
#pragma GCC optimize("fp-contract=off")

namespace {

using fvec = at::vec::Vectorized<float>;
using bvec = at::vec::Vectorized<at::BFloat16>;

// Rows in float buffers: read and written through at::vec's bf16 conversions (round to
// nearest even, as torch's own kernels), the arithmetic between them on plain float arrays.
template <typename T>
void load(float* dst, const T* src, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    int64_t i = 0;
    for (; i + bvec::size() <= n; i += bvec::size()) {
      auto [lo, hi] = at::vec::convert_bfloat16_float(bvec::loadu(src + i));
      lo.store(dst + i);
      hi.store(dst + i + fvec::size());
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

template <typename T>
void store(T* dst, const float* src, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    int64_t i = 0;
    for (; i + bvec::size() <= n; i += bvec::size())
      at::vec::convert_float_bfloat16(fvec::loadu(src + i), fvec::loadu(src + i + fvec::size()))
          .store(dst + i);
    for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
  }
}

// What the torch path does by writing a tensor of dtype T: float values rounded to T.
template <typename T>
void round_to(float* buf, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) {
    int64_t i = 0;
    for (; i + bvec::size() <= n; i += bvec::size()) {
      auto [lo, hi] = at::vec::convert_bfloat16_float(at::vec::convert_float_bfloat16(
          fvec::loadu(buf + i), fvec::loadu(buf + i + fvec::size())));
      lo.store(buf + i);
      hi.store(buf + i + fvec::size());
    }
    for (; i < n; ++i) buf[i] = static_cast<float>(static_cast<T>(buf[i]));
  }
}

// Rows in parallel only when there are enough to pay for waking the other threads.
template <typename F>
void for_rows(int64_t rows, int64_t row_elems, const F& f) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems));
  if (rows <= grain) {
    f(0, rows);
  } else {
    at::parallel_for(0, rows, grain, f);
  }
}

// f(T{}) for T the tensor's element type: float32 or bf16, the dtypes the runner binds
// these kernels for.
template <typename F>
void for_dtype(const at::Tensor& x, const F& f) {
  switch (x.scalar_type()) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(at::BFloat16{});
    default: TORCH_CHECK(false, "float32 or bfloat16 only, got ", x.scalar_type());
  }
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, hidden] with unit inner stride");
}

// sum(x * x) in the order of torch's own float sum (aten/src/ATen/native/cpu/SumKernel.cpp:
// vectors of L lanes, 4 accumulators, cascaded in levels of 16 so long rows lose no
// precision), so the norm equals the torch path's bit for bit. L is the vector width torch's
// kernel ran with on this CPU (the caller finds it, layers.py).
template <int L>
float sum_squares(const float* x, int64_t n) {
  constexpr int ilp = 4, levels = 4;
  const int64_t vectors = n / L, size = vectors / ilp;
  int64_t log2 = 0;
  while ((int64_t{1} << log2) < size) ++log2;
  const int64_t power = std::max<int64_t>(4, log2 / levels), step = int64_t{1} << power;
  const int64_t mask = step - 1;
  float acc[levels][ilp][L] = {};
  auto add_row = [&](float (&a)[ilp][L], int64_t i) {  // ILP consecutive vectors of row i
    for (int k = 0; k < ilp; ++k)
      for (int l = 0; l < L; ++l) {
        const float v = x[(i * ilp + k) * L + l];
        a[k][l] += v * v;
      }
  };
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i) add_row(acc[0], i);
    for (int j = 1; j < levels; ++j) {
      for (int k = 0; k < ilp; ++k)
        for (int l = 0; l < L; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0.f;
        }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i) add_row(acc[0], i);
  for (int j = 1; j < levels; ++j)
    for (int k = 0; k < ilp; ++k)
      for (int l = 0; l < L; ++l) acc[0][k][l] += acc[j][k][l];
  for (int64_t v = size * ilp; v < vectors; ++v)  // vectors left over from the ILP rows
    for (int l = 0; l < L; ++l) acc[0][0][l] += x[v * L + l] * x[v * L + l];
  for (int k = 1; k < ilp; ++k)
    for (int l = 0; l < L; ++l) acc[0][0][l] += acc[0][k][l];
  float sum = 0.f;
  for (int64_t e = vectors * L; e < n; ++e) sum += x[e] * x[e];  // the scalar tail first
  for (int l = 0; l < L; ++l) sum += acc[0][0][l];
  return sum;
}

// norm_rows for bf16 rows a whole number of bf16 vectors wide: the same operations in the
// same order, the add, rounding and stores fused into two passes over vectors instead of six
// loops over a float row (2,048 rows of 576: ~2x faster).
void norm_rows_bf16(at::BFloat16* out, const at::BFloat16* in, const float* w, int64_t rows,
                    int64_t h, int64_t in_stride, float eps, at::BFloat16* residual,
                    int64_t res_stride, int64_t lanes) {
  constexpr int64_t V = bvec::size(), F = fvec::size();
  for_rows(rows, h, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(h);
    for (int64_t r = begin; r < end; ++r) {
      const at::BFloat16* x = in + r * in_stride;
      at::BFloat16* res = residual != nullptr ? residual + r * res_stride : nullptr;
      for (int64_t i = 0; i < h; i += V) {
        auto [a, b] = at::vec::convert_bfloat16_float(bvec::loadu(x + i));
        if (res != nullptr) {  // residual = bf16(x + residual): the torch path's `x + r`
          auto [ra, rb] = at::vec::convert_bfloat16_float(bvec::loadu(res + i));
          const bvec sum = at::vec::convert_float_bfloat16(a + ra, b + rb);
          sum.store(res + i);
          std::tie(a, b) = at::vec::convert_bfloat16_float(sum);
        }
        a.store(buf.data() + i);
        b.store(buf.data() + i + F);
      }
      const float ss = lanes == 16 ? sum_squares<16>(buf.data(), h) : sum_squares<8>(buf.data(), h);
      const fvec inv(1.f / std::sqrt(ss / static_cast<float>(h) + eps));  // torch's mean, rsqrt
      for (int64_t i = 0; i < h; i += V) {  // bf16(bf16(x * inv) * weight)
        auto [a, b] = at::vec::convert_bfloat16_float(at::vec::convert_float_bfloat16(
            fvec::loadu(buf.data() + i) * inv, fvec::loadu(buf.data() + i + F) * inv));
        at::vec::convert_float_bfloat16(a * fvec::loadu(w + i), b * fvec::loadu(w + i + F))
            .store(out + r * h + i);
      }
    }
  });
}

template <typename T>
void norm_rows(T* out, const T* in, const T* weight, int64_t rows, int64_t h, int64_t in_stride,
               float eps, T* residual, int64_t res_stride, int64_t lanes) {
  std::vector<float> w(h);
  load(w.data(), weight, h);
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (h % bvec::size() == 0)
      return norm_rows_bf16(out, in, w.data(), rows, h, in_stride, eps, residual, res_stride, lanes);
  }
  for_rows(rows, h, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(h), res(h);
    for (int64_t r = begin; r < end; ++r) {
      load(buf.data(), in + r * in_stride, h);
      if (residual != nullptr) {  // residual = T(x + residual): the torch path's `x + r`
        load(res.data(), residual + r * res_stride, h);
        for (int64_t i = 0; i < h; ++i) buf[i] += res[i];
        round_to<T>(buf.data(), h);
        store(residual + r * res_stride, buf.data(), h);
      }
      const float ss = lanes == 16 ? sum_squares<16>(buf.data(), h) : sum_squares<8>(buf.data(), h);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);  // torch's mean, rsqrt
      for (int64_t k = 0; k < h; ++k) buf[k] *= inv;
      round_to<T>(buf.data(), h);  // x.to(dtype)
      for (int64_t k = 0; k < h; ++k) buf[k] *= w[k];  // weight * x
      store(out + r * h, buf.data(), h);
    }
  });
}

at::Tensor norm(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                double eps, int64_t lanes) {
  TORCH_CHECK(lanes == 8 || lanes == 16, "lanes must be 8 or 16");
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type() &&
                  weight.numel() == x.size(1),
              "weight must be [hidden] in x's dtype");
  if (residual != nullptr) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->scalar_type() == x.scalar_type() && residual->sizes() == x.sizes(),
                "residual must match x");
  }
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  for_dtype(x, [&](auto zero) {
    using T = decltype(zero);
    norm_rows<T>(out.data_ptr<T>(), x.data_ptr<T>(), weight.data_ptr<T>(), x.size(0), x.size(1),
                 x.stride(0), static_cast<float>(eps),
                 residual ? residual->data_ptr<T>() : nullptr,
                 residual ? residual->stride(0) : 0, lanes);
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t lanes) {
  return norm(x, nullptr, weight, eps, lanes);
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps, int64_t lanes) {
  return norm(x, &residual, weight, eps, lanes);
}

// sum(x * x) of a float row with L lanes: the probe layers.py compares with torch's sum.
double sum_squares_with(const at::Tensor& x, int64_t lanes) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float");
  return lanes == 16 ? sum_squares<16>(x.data_ptr<float>(), x.numel())
                     : sum_squares<8>(x.data_ptr<float>(), x.numel());
}

// rope_rows for bf16 heads whose halves are whole bf16 vectors (up to kRopeChunks of them a
// head): the same products, roundings and sums, on a head held in registers instead of five
// loops over float copies of it (a 2,048-token prefill's q and k of the default model: 0.47 vs
// 0.72 ms a layer, an AMX Xeon).
constexpr int64_t kRopeChunks = 4;

void rope_rows_bf16(at::BFloat16* base, const at::BFloat16* cos, const at::BFloat16* sin,
                    int64_t rows, int64_t heads, int64_t d, int64_t stride) {
  const int64_t chunks = d / bvec::size(), F = fvec::size();
  for_rows(rows, heads * d, [&](int64_t begin, int64_t end) {
    std::vector<float> c(d), s(d);
    for (int64_t t = begin; t < end; ++t) {
      load(c.data(), cos + t * d, d);
      load(s.data(), sin + t * d, d);
      for (int64_t h = 0; h < heads; ++h) {
        at::BFloat16* v = base + t * stride + h * d;
        fvec x[2 * kRopeChunks];  // the whole head, read before it is written over
        for (int64_t i = 0; i < chunks; ++i)
          std::tie(x[2 * i], x[2 * i + 1]) = at::vec::convert_bfloat16_float(bvec::loadu(v + i * bvec::size()));
        for (int64_t i = 0; i < chunks; ++i) {
          const int64_t r = (i + chunks / 2) % chunks, e = i * bvec::size();  // roll(x)
          // bf16(x * cos) + bf16(roll(x) * sin), rounded
          auto [a0, a1] = at::vec::convert_bfloat16_float(at::vec::convert_float_bfloat16(
              x[2 * i] * fvec::loadu(c.data() + e), x[2 * i + 1] * fvec::loadu(c.data() + e + F)));
          auto [b0, b1] = at::vec::convert_bfloat16_float(at::vec::convert_float_bfloat16(
              x[2 * r] * fvec::loadu(s.data() + e), x[2 * r + 1] * fvec::loadu(s.data() + e + F)));
          at::vec::convert_float_bfloat16(a0 + b0, a1 + b1).store(v + e);
        }
      }
    }
  });
}

template <typename T>
void rope_rows(T* base, const T* cos, const T* sin, int64_t rows, int64_t heads, int64_t d,
               int64_t stride) {
  const int64_t half = d / 2;
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (half % bvec::size() == 0 && d <= kRopeChunks * bvec::size())
      return rope_rows_bf16(base, cos, sin, rows, heads, d, stride);
  }
  for_rows(rows, heads * d, [&](int64_t begin, int64_t end) {
    std::vector<float> c(d), s(d), in(d), a(d), b(d);
    for (int64_t t = begin; t < end; ++t) {
      load(c.data(), cos + t * d, d);
      load(s.data(), sin + t * d, d);
      for (int64_t h = 0; h < heads; ++h) {
        T* v = base + t * stride + h * d;
        load(in.data(), v, d);
        for (int64_t i = 0; i < d; ++i) a[i] = in[i] * c[i];  // x * cos
        for (int64_t i = 0; i < half; ++i) b[i] = in[i + half] * s[i];  // roll(x) * sin
        for (int64_t i = half; i < d; ++i) b[i] = in[i - half] * s[i];
        round_to<T>(a.data(), d);
        round_to<T>(b.data(), d);
        for (int64_t i = 0; i < d; ++i) a[i] += b[i];
        store(v, a.data(), d);
      }
    }
  });
}

void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x must be [T, heads, D] with contiguous heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2) &&
                  sin.numel() == cos.numel() && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type(),
              "cos and sin must be [T, 1, D] in x's dtype");
  for_dtype(x, [&](auto zero) {
    using T = decltype(zero);
    rope_rows<T>(x.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), x.size(0), x.size(1),
                 x.size(2), x.stride(0));
  });
}

// silu_mul_rows for bf16 rows a whole number of bf16 vectors wide: the same operations, in
// one pass over vectors instead of six loops over float rows.
void silu_mul_rows_bf16(at::BFloat16* out, const at::BFloat16* in, int64_t rows, int64_t inter,
                        int64_t stride) {
  for_rows(rows, inter, [&](int64_t begin, int64_t end) {
    const fvec one(1.f);
    for (int64_t r = begin; r < end; ++r) {
      const at::BFloat16* g = in + r * stride;
      const at::BFloat16* u = g + inter;
      for (int64_t i = 0; i < inter; i += bvec::size()) {
        auto [a, b] = at::vec::convert_bfloat16_float(bvec::loadu(g + i));
        // bf16(silu(x)), torch's x / (1 + exp(-x)), then times the up projection, rounded
        auto [sa, sb] = at::vec::convert_bfloat16_float(at::vec::convert_float_bfloat16(
            a / (one + a.neg().exp()), b / (one + b.neg().exp())));
        auto [ua, ub] = at::vec::convert_bfloat16_float(bvec::loadu(u + i));
        at::vec::convert_float_bfloat16(sa * ua, sb * ub).store(out + r * inter + i);
      }
    }
  });
}

template <typename T>
void silu_mul_rows(T* out, const T* in, int64_t rows, int64_t inter, int64_t stride) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (inter % bvec::size() == 0) return silu_mul_rows_bf16(out, in, rows, inter, stride);
  }
  for_rows(rows, inter, [&](int64_t begin, int64_t end) {
    std::vector<float> g(inter), u(inter);
    const fvec one(1.f);
    for (int64_t r = begin; r < end; ++r) {
      load(g.data(), in + r * stride, inter);
      load(u.data(), in + r * stride + inter, inter);
      int64_t i = 0;
      for (; i + fvec::size() <= inter; i += fvec::size()) {  // torch's silu: x / (1 + exp(-x))
        const fvec x = fvec::loadu(g.data() + i);
        (x / (one + x.neg().exp())).store(g.data() + i);
      }
      for (; i < inter; ++i) g[i] = g[i] / (1.f + std::exp(-g[i]));
      round_to<T>(g.data(), inter);
      for (int64_t k = 0; k < inter; ++k) g[k] *= u[k];
      store(out + r * inter, g.data(), inter);
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  auto out = at::empty({rows, inter}, x.options());
  for_dtype(x, [&](auto zero) {
    using T = decltype(zero);
    silu_mul_rows<T>(out.data_ptr<T>(), x.data_ptr<T>(), rows, inter, x.stride(0));
  });
  return out;
}

// One token's D values of one KV head as kv_quant.quantize_kv stores them: scale =
// max(absmax / the format's largest value, 1e-12), each value / scale rounded to the format
// (int8: to nearest even, clamped to +-127; e4m3: c10's conversion, torch's), in float.
template <typename T, typename C>
void quantize_slot(const T* x, int64_t d, C* out, float* scale) {
  constexpr float qmax = std::is_same_v<C, int8_t> ? 127.f : 448.f;
  float amax = 0.f;
  for (int64_t j = 0; j < d; ++j) amax = std::max(amax, std::abs(static_cast<float>(x[j])));
  const float s = std::max(amax / qmax, 1e-12f);
  for (int64_t j = 0; j < d; ++j) {
    const float y = static_cast<float>(x[j]) / s;
    if constexpr (std::is_same_v<C, int8_t>)  // min first: a NaN stores as 127, not UB
      out[j] = static_cast<int8_t>(std::max(-qmax, std::min(qmax, std::nearbyint(y))));
    else
      out[j] = C(y);
  }
  *scale = s;
}

void write_kv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
              const at::Tensor& k, const at::Tensor& v,
              const std::optional<at::Tensor>& k_scales,
              const std::optional<at::Tensor>& v_scales) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots must be long");
  const bool eight_bit = k_scales.has_value();
  TORCH_CHECK(eight_bit == v_scales.has_value(), "k_scales and v_scales come together");
  TORCH_CHECK(!eight_bit || k_cache.scalar_type() == at::kChar ||
                  k_cache.scalar_type() == at::kFloat8_e4m3fn,
              "scales go with an int8 or float8_e4m3fn cache");
  const int64_t rows = k.size(0), heads = k.size(1), d = k.size(2), row = heads * d;
  const int64_t capacity = k_cache.numel() / row;
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == t->size(2) &&
                    t->size(0) == rows && t->size(1) * t->size(2) == row &&
                    (eight_bit ? t->scalar_type() == k.scalar_type()
                               : t->scalar_type() == k_cache.scalar_type()),
                "k and v must be [T, KVH, D] with contiguous heads, in the cache's dtype (or "
                "one float dtype for an 8-bit cache)");
  }
  TORCH_CHECK(slots.numel() == rows && v_cache.numel() == k_cache.numel() &&
                  v_cache.scalar_type() == k_cache.scalar_type(), "shape mismatch");
  if (eight_bit) {
    for (const at::Tensor* t : {&*k_scales, &*v_scales})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() &&
                      t->numel() == capacity * heads,
                  "scales must be contiguous float32, one per slot and KV head");
  }
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "slot out of range");
  const int64_t ks = k.stride(0), vs = v.stride(0);
  if (eight_bit) {
    float* kscale = k_scales->data_ptr<float>();
    float* vscale = v_scales->data_ptr<float>();
    auto write = [&](auto x_zero, auto c_zero) {
      using T = decltype(x_zero);
      using C = decltype(c_zero);
      const T* kp = static_cast<const T*>(k.data_ptr());
      const T* vp = static_cast<const T*>(v.data_ptr());
      C* kc = static_cast<C*>(k_cache.data_ptr());
      C* vc = static_cast<C*>(v_cache.data_ptr());
      for_rows(rows, 2 * row, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t)
          for (int64_t h = 0; h < heads; ++h) {
            const int64_t i = slot[t] * heads + h;
            quantize_slot(kp + t * ks + h * d, d, kc + i * d, kscale + i);
            quantize_slot(vp + t * vs + h * d, d, vc + i * d, vscale + i);
          }
      });
    };
    auto with_cache = [&](auto x_zero) {
      if (k_cache.scalar_type() == at::kChar) write(x_zero, int8_t{});
      else write(x_zero, c10::Float8_e4m3fn{});
    };
    for_dtype(k, with_cache);
    return;
  }
  const int64_t bytes = row * k.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t kb = ks * k.element_size(), vb = vs * v.element_size();
  // in parallel past for_rows' grain (85 rows of the default model): a prompt's rows land on
  // cache lines no core holds (2,048 rows of the default model: 0.72 ms a layer on one thread)
  for_rows(rows, 2 * row, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + slot[t] * bytes, kp + t * kb, bytes);
      std::memcpy(vc + slot[t] * bytes, vp + t * vb, bytes);
    }
  });
}

// How many keys a row sees when its mask is a prefix [0, n), as causal masks are; -1 if not.
inline int64_t visible_prefix(const bool* m, int64_t len) {
  const void* hidden = std::memchr(m, 0, len);  // glibc's memchr: vectorized
  const int64_t n = hidden == nullptr ? len : static_cast<const bool*>(hidden) - m;
  return n == len || std::memchr(m + n, 1, len - n) == nullptr ? n : -1;
}

// One row of masked_softmax_. A prefix row computes its n visible keys only and writes zeros
// past them; any other mask computes every key, the hidden ones -inf.
void softmax_row(at::BFloat16* row, const bool* m, int64_t len, float sc, float* buf) {
  const int64_t prefix = visible_prefix(m, len), n = prefix < 0 ? len : prefix;
  if (n == 0) {  // nothing visible: NaN, as torch's softmax of all -inf
    std::fill(row, row + len, static_cast<at::BFloat16>(std::numeric_limits<float>::quiet_NaN()));
    return;
  }
  // float(bf16(s * scale)), the torch path's bf16 `scores * scale`, in one vectorized pass
  const fvec vsc(sc);
  int64_t i = 0;
  for (; i + bvec::size() <= n; i += bvec::size()) {
    auto [lo, hi] = at::vec::convert_bfloat16_float(bvec::loadu(row + i));
    auto [a, b] = at::vec::convert_bfloat16_float(at::vec::convert_float_bfloat16(lo * vsc, hi * vsc));
    a.store(buf + i);
    b.store(buf + i + fvec::size());
  }
  for (; i < n; ++i)
    buf[i] = static_cast<float>(static_cast<at::BFloat16>(static_cast<float>(row[i]) * sc));
  if (prefix < 0)
    for (i = 0; i < n; ++i)
      if (!m[i]) buf[i] = -std::numeric_limits<float>::infinity();
  const float inv = 1.f / softmax_numerators(buf, n);  // the decode kernel's exp and sum
  for (i = 0; i < n; ++i) buf[i] *= inv;
  store(row, buf, n);
  std::fill(row + n, row + len, static_cast<at::BFloat16>(0.f));
}

// softmax(where(mask, bf16(s * scale), -inf)) in float over each row of a grouped attention's
// bf16 scores, rounded back to bf16, in place: the torch path's five passes over the scores
// (scale, widen, mask, softmax, narrow) in one. scores [B, KVH, G, Q, L], mask [B, Q, L] bool.
// Not torch's softmax to the bit (its sum runs in its own lane order, its exp is Sleef's u10;
// this one is exp_u20, as the decode kernel's), so within an ulp of bf16 of it; every row
// depends on its own scores only, so blocks of query rows still give the whole's result.
void masked_softmax_(at::Tensor& scores, const at::Tensor& mask, double scale) {
  TORCH_CHECK(scores.dim() == 5 && scores.is_contiguous() &&
                  scores.scalar_type() == at::kBFloat16,
              "scores must be contiguous bf16 [B, KVH, G, Q, L]");
  const int64_t b = scores.size(0), heads = scores.size(1) * scores.size(2);
  const int64_t q = scores.size(3), len = scores.size(4);
  TORCH_CHECK(mask.dim() == 3 && mask.is_contiguous() && mask.scalar_type() == at::kBool &&
                  mask.size(0) == b && mask.size(1) == q && mask.size(2) == len,
              "mask must be contiguous bool [B, Q, L]");
  at::BFloat16* base = scores.data_ptr<at::BFloat16>();
  const bool* visible = mask.data_ptr<bool>();
  const float sc = static_cast<float>(scale);
  for_rows(b * heads * q, len, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(len);
    for (int64_t r = begin; r < end; ++r)
      softmax_row(base + r * len, visible + ((r / (heads * q)) * q + r % q) * len, len, sc,
                  buf.data());
  });
}

// One int4 projection as model/quant.py's Int4Linear computes it: up to kernel_max_rows rows
// the sum of its terms' torch int4 matmuls, cut to its output width; past them (where the
// CPU has AMX or AVX512-BF16) int4_gemm, with the layer's int8_activations; on bf16
// activations, cast back, plus its bias.
struct Int4Projection {
  std::vector<at::Tensor> packed, scales_zeros;  // one per term (GGUF's Q8_0 has two)
  int64_t group = 0, out_features = 0, kernel_max_rows = 0;
  std::optional<at::Tensor> bias;
  bool int8_activations = false;
  bool rows_invariant = false;  // int4_gemm's: a row's sums in one order whatever the rows

  at::Tensor operator()(const at::Tensor& x) const {
    const at::Tensor xb = x.scalar_type() == at::kBFloat16 ? x : x.to(at::kBFloat16);
    at::Tensor y;
    if (xb.size(0) > kernel_max_rows) {
      y = at::empty({xb.size(0), out_features}, xb.options());
      int4_gemm(y, xb.contiguous(), packed, scales_zeros, group, int8_activations, rows_invariant);
    } else {
      y = at::_weight_int4pack_mm_for_cpu(xb, packed[0], group, scales_zeros[0]);
      for (size_t t = 1; t < packed.size(); ++t)
        y.add_(at::_weight_int4pack_mm_for_cpu(xb, packed[t], group, scales_zeros[t]));
    }
    if (y.size(1) != out_features) y = y.narrow(1, 0, out_features);
    if (y.scalar_type() != x.scalar_type()) y = y.to(x.scalar_type());
    if (bias) y = at::add(y, *bias);
    return y;
  }
};

struct DecodeLayer {
  at::Tensor input_norm, post_norm;  // RMSNorm weights
  Int4Projection qkv, o, gate_up, down;
  at::Tensor k_cache, v_cache;  // [num_blocks, block_size, KVH, D]
  std::optional<at::Tensor> k_scales, v_scales;  // an 8-bit cache's: [num_blocks, block_size, KVH]
};

class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale,
              int64_t sum_lanes, at::Tensor final_norm)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        lanes_(sum_lanes), final_norm_(std::move(final_norm)) {}

  // Each projection: (packed terms, scales_zeros terms, group, out_features, kernel_max_rows,
  // bias or None, int8_activations, rows_invariant).
  using Proj = std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t,
                          int64_t, std::optional<at::Tensor>, bool, bool>;
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, const Proj& qkv, const Proj& o,
                 const Proj& gate_up, const Proj& down, at::Tensor k_cache, at::Tensor v_cache,
                 std::optional<at::Tensor> k_scales, std::optional<at::Tensor> v_scales) {
    auto proj = [](const Proj& p) {
      return Int4Projection{std::get<0>(p), std::get<1>(p), std::get<2>(p), std::get<3>(p),
                            std::get<4>(p), std::get<5>(p), std::get<6>(p),
                            std::get<7>(p)};
    };
    layers_.push_back({std::move(input_norm), std::move(post_norm), proj(qkv), proj(o),
                       proj(gate_up), proj(down), std::move(k_cache), std::move(v_cache),
                       std::move(k_scales), std::move(v_scales)});
  }

  // x: [B, hidden] embeddings; cos, sin: [B, 1, D]; slots: [B]; block_tables: [B, blocks];
  // context_lens: [B]. Returns the final norm's output, [B, hidden] (LlamaModel.forward).
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& slots, const at::Tensor& block_tables,
                     const at::Tensor& context_lens) const {
    TORCH_CHECK(!layers_.empty(), "a decode stack needs layers");
    const int64_t rows = x.size(0), h = heads_, kvh = kv_heads_, d = head_dim_;
    at::Tensor residual;
    for (const DecodeLayer& l : layers_) {
      at::Tensor hidden;  // LlamaDecoderLayer.forward
      if (!residual.defined()) {
        hidden = norm(x, nullptr, l.input_norm, eps_, lanes_);
        residual = x;
      } else {
        hidden = norm(x, &residual, l.input_norm, eps_, lanes_);
      }
      const at::Tensor qkv = l.qkv(hidden);                                // [B, (H + 2 KVH) D]
      at::Tensor qk = qkv.narrow(1, 0, (h + kvh) * d).view({rows, h + kvh, d});
      rope_(qk, cos, sin);
      at::Tensor k = qk.narrow(1, h, kvh);                                 // [B, KVH, D]
      at::Tensor v = qkv.narrow(1, (h + kvh) * d, kvh * d).view({rows, kvh, d});
      at::Tensor k_cache = l.k_cache, v_cache = l.v_cache;
      write_kv(k_cache, v_cache, slots, k, v, l.k_scales, l.v_scales);
      const at::Tensor attn = paged_decode_attention(qk.narrow(1, 0, h), k_cache, v_cache,
                                                     block_tables, context_lens, scale_,
                                                     l.k_scales, l.v_scales);  // [B, H, D]
      hidden = norm(l.o(attn.view({rows, h * d})), &residual, l.post_norm, eps_, lanes_);
      x = l.down(silu_and_mul(l.gate_up(hidden)));                         // LlamaMLP.forward
    }
    return norm(x, &residual, final_norm_, eps_, lanes_);
  }

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  int64_t lanes_;
  at::Tensor final_norm_;
  std::vector<DecodeLayer> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "residual += x in place, then RMSNorm of residual (CPU)");
  m.def("sum_squares", &sum_squares_with, "sum(x * x) in torch's order with this many lanes");
  m.def("rope_", &rope_, "rotate-half RoPE in place (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (CPU)");
  m.def("masked_softmax_", &masked_softmax_, "scale, mask, softmax, in place (CPU, bf16)");
  m.def("write_kv", &write_kv, "this step's K and V into their cache slots (CPU)",
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("k"), py::arg("v"),
        py::arg("k_scales") = py::none(), py::arg("v_scales") = py::none());
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<int64_t, int64_t, int64_t, double, double, int64_t, at::Tensor>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>());
}

// Decode attention (one query token per row) read straight from the paged KV cache.
//
// A work item is one (row, kv head); its G = H / KVH query heads share every key and value
// it loads, and it walks the row's block table up to the row's context length:
//   pass 1  scores[g, t] = scale * q[g] . k[t]           reads K once
//   pass 2  p[g, t] = exp(scores[g, t] - max_g), sums     exact softmax over a [G, ctx] buffer
//   pass 3  out[g] = sum_t p[g, t] v[t] / sum_g           reads V once
// Slots past the context length (the tail of the last block, null block 0 in the padding)
// are never read. Everything accumulates in float32; bf16 and fp16 are widened on load, and
// an 8-bit cache's int8 or e4m3 values too, its per-slot scales applied to scores and weights.
//
// Vectorized with at::vec::Vectorized<float> (8 lanes under CPU_CAPABILITY_AVX2, which the
// loader defines on CPUs with AVX2 + FMA; a portable fallback otherwise). head_dim must be a
// multiple of 8.

// Narrow includes: <torch/extension.h> alone costs ~40 s of compile time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int kLanes = Vec::size();

using Fp8 = c10::Float8_e4m3fn;

// e4m3 -> float for every bit pattern: an 8-bit cache's values widen by table lookup.
const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int b = 0; b < 256; ++b) t[b] = static_cast<float>(Fp8(static_cast<uint8_t>(b), Fp8::from_bits()));
    return t;
  }();
  return table.data();
}

template <typename T>
inline Vec widen(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else if constexpr (std::is_same_v<T, int8_t> || std::is_same_v<T, Fp8>) {
#if defined(CPU_CAPABILITY_AVX2)
    const __m256i wide = std::is_same_v<T, int8_t>
        ? _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))
        : _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    if constexpr (std::is_same_v<T, int8_t>) return Vec(_mm256_cvtepi32_ps(wide));
    else return Vec(_mm256_i32gather_ps(fp8_table(), wide, 4));
#else
    float f[kLanes];
    for (int i = 0; i < kLanes; ++i) {
      if constexpr (std::is_same_v<T, int8_t>) f[i] = p[i];
      else f[i] = fp8_table()[reinterpret_cast<const uint8_t*>(p)[i]];
    }
    return Vec::loadu(f);
#endif
  } else {
    Vec out;
    at::vec::load_to_float(p, out);
    return out;
  }
}

inline float hsum(Vec v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

struct Shapes {
  int64_t heads, kv_heads, head_dim, block_size, max_blocks;
  int64_t q_row, q_head;  // q strides, in elements
};

// out[i] = q . rows[i] for n rows of d floats. With kD (= d) known at compile time q stays in
// registers across the rows; two accumulators halve each dot's dependency chain.
template <int kD, typename T>
inline void dots(const float* q, const T* rows, int64_t stride, int64_t n, float* out, int d) {
  constexpr int kVecs = kD / kLanes;
  Vec qv[kVecs > 0 ? kVecs : 1];
  for (int r = 0; r < kVecs; ++r) qv[r] = Vec::loadu(q + r * kLanes);
  for (int64_t i = 0; i < n; ++i) {
    const T* k = rows + i * stride;
    Vec a0(0.f), a1(0.f);
    if constexpr (kVecs > 0) {
      for (int r = 0; r + 1 < kVecs; r += 2) {
        a0 = at::vec::fmadd(qv[r], widen(k + r * kLanes), a0);
        a1 = at::vec::fmadd(qv[r + 1], widen(k + (r + 1) * kLanes), a1);
      }
      if constexpr (kVecs % 2 == 1) {
        a0 = at::vec::fmadd(qv[kVecs - 1], widen(k + (kVecs - 1) * kLanes), a0);
      }
    } else {
      for (int j = 0; j < d; j += kLanes) a0 = at::vec::fmadd(Vec::loadu(q + j), widen(k + j), a0);
    }
    out[i] = hsum(a0 + a1);
  }
}

// acc[0:kRegs * kLanes] += sum_i w[i] * rows[i], the accumulator held in registers.
template <int kRegs, typename T>
inline void weighted_rows_chunk(const float* w, const T* rows, int64_t stride, int64_t n,
                                float* acc) {
  Vec a[kRegs];
  for (int r = 0; r < kRegs; ++r) a[r] = Vec::loadu(acc + r * kLanes);
  for (int64_t i = 0; i < n; ++i) {
    const Vec wi(w[i]);
    const T* v = rows + i * stride;
    for (int r = 0; r < kRegs; ++r) a[r] = at::vec::fmadd(wi, widen(v + r * kLanes), a[r]);
  }
  for (int r = 0; r < kRegs; ++r) a[r].store(acc + r * kLanes);
}

// acc[0:d] += sum_i w[i] * rows[i] for n rows: acc is loaded and stored once per call (a
// block), not once per row.
template <typename T>
inline void weighted_rows(const float* w, const T* rows, int64_t stride, int64_t n, float* acc,
                          int d) {
  constexpr int kRegs = 8;
  int j = 0;
  for (; j + kRegs * kLanes <= d; j += kRegs * kLanes) {
    weighted_rows_chunk<kRegs>(w, rows + j, stride, n, acc + j);
  }
  for (; j < d; j += kLanes) weighted_rows_chunk<1>(w, rows + j, stride, n, acc + j);
}

// p = exp(s - max(s)) in place over n scores; returns sum(p).
inline float softmax_numerators(float* s, int64_t n) {
  float m = s[0];
  for (int64_t t = 1; t < n; ++t) m = std::max(m, s[t]);
  const Vec vm(m);
  Vec vsum(0.f);
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    const Vec p = (Vec::loadu(s + t) - vm).exp_u20();
    p.store(s + t);
    vsum = vsum + p;
  }
  float sum = hsum(vsum);
  if (t < n) {
    const int rest = static_cast<int>(n - t);
    // Padding lanes load as 0 and exp(0 - m) > 0, so they are masked out of the sum by
    // storing and adding only the first `rest` lanes.
    const Vec p = (Vec::loadu(s + t, rest) - vm).exp_u20();
    p.store(s + t, rest);
    for (int i = 0; i < rest; ++i) sum += s[t + i];
  }
  return sum;
}

// kD > 0 fixes head_dim at compile time so the inner loops unroll; kD == 0 reads it at run
// time.
// An 8-bit cache (C = int8_t or Fp8) comes with float scales per (slot, kv head): a key's
// scale multiplies its scores, a value's its softmax weight.
template <typename T, typename C, int kD>
void attend_one(int64_t row, int64_t kvh, const Shapes& s, float scale, const T* q,
                const C* k_cache, const C* v_cache, const float* k_scales,
                const float* v_scales, const int64_t* tables, int64_t ctx, T* out,
                std::vector<float>& scratch) {
  const int d = kD > 0 ? kD : static_cast<int>(s.head_dim);
  const int64_t group = s.heads / s.kv_heads, bs = s.block_size;
  const int64_t token_stride = s.kv_heads * d;  // between consecutive slots of a block
  const int64_t* table = tables + row * s.max_blocks;

  // scratch: q * scale [G, D] | acc [G, D] | 1 / softmax sum [G] | scores [G, ctx] |
  // a block's scaled weights [block_size]
  scratch.resize(2 * group * d + group + group * ctx + bs);
  float* qf = scratch.data();
  float* acc = qf + group * d;
  float* inv_sum = acc + group * d;
  float* scores = inv_sum + group;
  float* weights = scores + group * ctx;
  for (int64_t g = 0; g < group; ++g) {
    const T* qg = q + row * s.q_row + (kvh * group + g) * s.q_head;
    for (int j = 0; j < d; ++j) qf[g * d + j] = static_cast<float>(qg[j]) * scale;
  }

  for (int64_t t0 = 0; t0 < ctx; t0 += bs) {
    const C* kb = k_cache + (table[t0 / bs] * bs * s.kv_heads + kvh) * d;
    const int64_t n = std::min(bs, ctx - t0);
    for (int64_t g = 0; g < group; ++g) {
      dots<kD>(qf + g * d, kb, token_stride, n, scores + g * ctx + t0, d);
      if (k_scales != nullptr) {
        const float* ks = k_scales + table[t0 / bs] * bs * s.kv_heads + kvh;
        for (int64_t i = 0; i < n; ++i) scores[g * ctx + t0 + i] *= ks[i * s.kv_heads];
      }
    }
  }

  for (int64_t g = 0; g < group; ++g) inv_sum[g] = 1.f / softmax_numerators(scores + g * ctx, ctx);

  std::fill(acc, acc + group * d, 0.f);
  for (int64_t t0 = 0; t0 < ctx; t0 += bs) {
    const C* vb = v_cache + (table[t0 / bs] * bs * s.kv_heads + kvh) * d;
    const int64_t n = std::min(bs, ctx - t0);
    for (int64_t g = 0; g < group; ++g) {
      const float* w = scores + g * ctx + t0;
      if (v_scales != nullptr) {
        const float* vs = v_scales + table[t0 / bs] * bs * s.kv_heads + kvh;
        for (int64_t i = 0; i < n; ++i) weights[i] = w[i] * vs[i * s.kv_heads];
        w = weights;
      }
      weighted_rows(w, vb, token_stride, n, acc + g * d, d);
    }
  }

  for (int64_t g = 0; g < group; ++g) {
    T* o = out + (row * s.heads + kvh * group + g) * d;
    for (int j = 0; j < d; ++j) o[j] = static_cast<T>(acc[g * d + j] * inv_sum[g]);
  }
}

template <typename T, typename C, int kD>
void attend_all(const Shapes& s, float scale, const T* q, const C* k_cache, const C* v_cache,
                const float* k_scales, const float* v_scales, const int64_t* tables,
                const int64_t* context_lens, T* out, int64_t rows) {
  // Threads claim items one at a time from a shared counter, so ragged context lengths
  // balance across them.
  const int64_t items = rows * s.kv_heads, group = s.heads / s.kv_heads;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (int64_t i = next++; i < items; i = next++) {
      const int64_t row = i / s.kv_heads, kvh = i % s.kv_heads;
      const int64_t ctx = context_lens[row];
      if (ctx > 0) {
        attend_one<T, C, kD>(row, kvh, s, scale, q, k_cache, v_cache, k_scales, v_scales, tables,
                             ctx, out, scratch);
      } else {
        T* o = out + (row * s.heads + kvh * group) * s.head_dim;
        std::fill(o, o + group * s.head_dim, static_cast<T>(0.f));
      }
    }
  });
}

template <typename T, typename C>
void dispatch_head_dim(const Shapes& s, float scale, const T* q, const C* k, const C* v,
                       const float* ks, const float* vs, const int64_t* tables,
                       const int64_t* lens, T* out, int64_t rows) {
  switch (s.head_dim) {
    case 64: return attend_all<T, C, 64>(s, scale, q, k, v, ks, vs, tables, lens, out, rows);
    case 128: return attend_all<T, C, 128>(s, scale, q, k, v, ks, vs, tables, lens, out, rows);
    default: return attend_all<T, C, 0>(s, scale, q, k, v, ks, vs, tables, lens, out, rows);
  }
}

// Every block a row reads is a real block: a bad table raises instead of reading wild memory.
void check_tables(const Shapes& s, const int64_t* tables, const int64_t* lens, int64_t rows,
                  int64_t num_blocks) {
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(lens[r] >= 0 && lens[r] <= s.max_blocks * s.block_size, "row ", r,
                ": context length ", lens[r], " exceeds its block table");
    for (int64_t b = 0; b * s.block_size < lens[r]; ++b) {
      const int64_t id = tables[r * s.max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "row ", r, ": block id ", id, " out of range");
    }
  }
}

}  // namespace

// q: [B, H, D] (head_dim contiguous); k_cache, v_cache: [num_blocks, block_size, KVH, D]
// contiguous; block_tables: [B, max_blocks] int64; context_lens: [B] int64 or int32.
// An 8-bit cache (int8 or float8_e4m3fn) comes with k_scales, v_scales: [num_blocks,
// block_size, KVH] float32. Returns [B, H, D] in q's dtype.
at::Tensor paged_decode_attention(at::Tensor q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale,
                                  const std::optional<at::Tensor>& k_scales,
                                  const std::optional<at::Tensor>& v_scales) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q must be [B, H, D], caches 4-d");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache differ in shape");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const bool scaled = k_scales.has_value();
  TORCH_CHECK(scaled == v_scales.has_value(), "k_scales and v_scales come together");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "the caches differ in dtype");
  TORCH_CHECK(scaled || q.scalar_type() == k_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(!scaled || k_cache.scalar_type() == at::kChar ||
                  k_cache.scalar_type() == at::kFloat8_e4m3fn,
              "scales go with an int8 or float8_e4m3fn cache");
  if (scaled) {
    for (const at::Tensor* t : {&*k_scales, &*v_scales}) {
      TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat &&
                      t->numel() * k_cache.size(3) == k_cache.numel(),
                  "scales must be contiguous float32 [num_blocks, block_size, KVH]");
    }
  }
  const int64_t rows = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim, "head_dim of q and the caches differ");
  TORCH_CHECK(head_dim % kLanes == 0, "head_dim must be a multiple of ", kLanes);
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv heads");
  if (q.stride(2) != 1) q = q.contiguous();
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = context_lens.to(at::kLong).contiguous();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == rows, "block_tables must be [B, blocks]");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == rows, "context_lens must be [B]");
  const Shapes s{heads,          kv_heads,    head_dim,   k_cache.size(1),
                 tables.size(1), q.stride(0), q.stride(1)};
  check_tables(s, tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), rows, k_cache.size(0));
  at::Tensor out = at::empty({rows, heads, head_dim}, q.options());
  if (rows == 0) return out;
  const float* ks = scaled ? k_scales->data_ptr<float>() : nullptr;
  const float* vs = scaled ? v_scales->data_ptr<float>() : nullptr;
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    const auto with_cache = [&](auto cache_zero) {
      using C = decltype(cache_zero);
      dispatch_head_dim<T, C>(s, static_cast<float>(scale), q.data_ptr<T>(),
                              reinterpret_cast<const C*>(k_cache.data_ptr()),
                              reinterpret_cast<const C*>(v_cache.data_ptr()), ks, vs,
                              tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                              out.data_ptr<T>(), rows);
    };
    if (!scaled) with_cache(T{});
    else if (k_cache.scalar_type() == at::kChar) with_cache(int8_t{});
    else with_cache(Fp8{});
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(at::BFloat16{}); break;
    case at::kHalf: run(at::Half{}); break;
    default: TORCH_CHECK(false, "float32, bfloat16 or float16 only, got ", q.scalar_type());
  }
  return out;
}

#ifndef TANDEM_PAGED_ATTENTION_NO_MODULE  // fused.cpp includes this file for its decode stack
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention read through block tables (CPU)", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("k_scales") = py::none(), py::arg("v_scales") = py::none(),
        py::call_guard<py::gil_scoped_release>());
}
#endif

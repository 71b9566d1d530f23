// Decode attention (one query token per row) read straight from the paged KV cache.
//
// A work item is one (row, kv head) (a thread takes a row's items together when there are
// rows enough: attend_all); its G = H / KVH query heads share every key and value it loads
// (up to kMaxHeads of them per pass), and it walks the row's block table up to the row's
// context length:
//   pass 1  scores[g, t] = scale * q[g] . k[t]           reads K once, widened once for all g
//   pass 2  p[g, t] = exp(scores[g, t] - max_g), sums     exact softmax over a [G, ctx] buffer
//   pass 3  out[g] = sum_t p[g, t] v[t] / sum_g           reads V once, widened once for all g
// A row's blocks are scattered over the cache, which the hardware prefetcher cannot follow:
// pass 1 prefetches the keys kAhead blocks ahead and each block's values for pass 3. A cold
// cache (the decode step reads every layer's KV from memory) ran at half speed without it.
// Slots past the context length (the tail of the last block, null block 0 in the padding)
// are never read. Everything accumulates in float32; bf16 and fp16 are widened on load, and
// an 8-bit cache's int8 or e4m3 values too, its per-slot scales applied to scores and weights.
//
// Vectorized with at::vec::Vectorized<float> at the width the loader builds for (16 lanes
// under CPU_CAPABILITY_AVX512, 8 under AVX2, as torch's own kernels run here; a portable
// fallback otherwise). head_dim must be a multiple of the lanes (build.py: vec_lanes).

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

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int kLanes = Vec::size();

using Fp8 = c10::Float8_e4m3fn;

// The inner loops, inlined into their pass: left as calls (as GCC leaves them for the 8-bit
// caches' widening), their accumulators went to the stack and back every key (int8 values, 30
// layers of 16 rows at 320 keys in cache, an AVX-512 EPYC: 5.1 -> 3.9 ms).
#define TANDEM_INLINE __attribute__((always_inline)) inline

// e4m3 -> float for every bit pattern: the portable build widens e4m3 by table lookup.
const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int b = 0; b < 256; ++b) t[b] = static_cast<float>(Fp8(static_cast<uint8_t>(b), Fp8::from_bits()));
    return t;
  }();
  return table.data();
}

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// e4m3 bits, sign-extended to 16 bits, as the float16 of the value / 256: its exponent and
// mantissa bits land in float16's low exponent and high mantissa bits (float16's bias is 8
// more than e4m3's, subnormals included), the sign on the sign; widen multiplies by 256,
// exactly. Every pattern but e4m3's NaN (never stored: kv_quant scales values to +-448) comes
// out as the table's. A table lookup by gather cost 3x the rest of the decode kernel.
template <typename V>
inline V fp8_as_fp16(V sign_extended) {
  if constexpr (sizeof(V) == 32)
    return _mm256_and_si256(_mm256_slli_epi16(sign_extended, 7), _mm256_set1_epi16(int16_t(0xBFFF)));
  else
    return _mm_and_si128(_mm_slli_epi16(sign_extended, 7), _mm_set1_epi16(int16_t(0xBFFF)));
}
#endif

template <typename T>
inline Vec widen(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else if constexpr (std::is_same_v<T, int8_t> || std::is_same_v<T, Fp8>) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<T, int8_t>) return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
    else return Vec(_mm512_mul_ps(_mm512_cvtph_ps(fp8_as_fp16(_mm256_cvtepi8_epi16(bytes))),
                                  _mm512_set1_ps(256.f)));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<T, int8_t>) return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
    else return Vec(_mm256_mul_ps(_mm256_cvtph_ps(fp8_as_fp16(_mm_cvtepi8_epi16(bytes))),
                                  _mm256_set1_ps(256.f)));
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

// Up to this many query heads of a KV head share one pass over its keys and values, each key
// and value widened once for all of them; a larger group goes in several passes.
constexpr int kMaxHeads = 4;
// Rows a thread needs for the work to be claimed a row at a time (attend_all).
constexpr int64_t kRowsPerThread = 4;
// Blocks of keys fetched ahead of pass 1 (1 and 3 measured no better: a cold 16-row step).
constexpr int64_t kAhead = 2;

// Fetch n rows of d values, `stride` elements apart, toward the cache ahead of their use: a
// row's slots are scattered across blocks, so the hardware prefetcher does not see them coming.
// Into L2, not L1 (locality 2, prefetcht1): 30 layers of 16 rows at 450 keys from memory
// 14.6 -> 11.1 ms on an AVX-512 EPYC, where prefetches into L1 queue on its few miss buffers;
// no faster on an AMX Xeon (measured there a stop before).
template <typename C>
inline void prefetch_rows(const C* rows, int64_t stride, int64_t n, int d) {
  const int64_t bytes = static_cast<int64_t>(d) * sizeof(C);
  for (int64_t i = 0; i < n; ++i) {
    const char* p = reinterpret_cast<const char*>(rows + i * stride);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// The horizontal sums of up to 16 vectors at once, each summed in vec_reduce_all's order (lane
// i with i ^ 8, then ^ 4, ^ 2, ^ 1), so each comes out to the bit as hsum's would: a pairwise
// butterfly whose every step adds two vectors' halves side by side, 2 shuffles and an add a
// step for every two vectors, where hsum spends 4 shuffles and 4 adds on each vector alone
// (30 layers of 16 rows at 450 keys, an AVX-512 EPYC: 5.8 -> 4.8 ms from cache, 9.7 -> 9.2
// from memory; the same outputs to the bit). Missing vectors (n < 16) are zeros, whose sums
// are never read; under 4 vectors hsum alone is cheaper.
inline void reduce_each(const Vec* acc, int n, float* out) {
  if (n < 4) {  // too few to pay for the tree (1 query head a KV head: 6.7 vs 6.0 ms cached)
    for (int i = 0; i < n; ++i) out[i] = hsum(acc[i]);
    return;
  }
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = i < n ? __m512(acc[i]) : _mm512_setzero_ps();
  __m512 c[8], g[4], m[2];
  for (int i = 0; i < 8; ++i)  // lane j < 8 of a vector's half: its lanes j + j ^ 8
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // a 128-bit block per vector: + lanes ^ 4
    g[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // two lanes per vector: + lanes ^ 2
    m[i] = _mm512_add_ps(_mm512_shuffle_ps(g[2 * i], g[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(g[2 * i], g[2 * i + 1], 0xEE));
  // + lanes ^ 1: lane 4b + c holds vector 4c + b's sum
  const __m512 r =
      _mm512_add_ps(_mm512_shuffle_ps(m[0], m[1], 0x88), _mm512_shuffle_ps(m[0], m[1], 0xDD));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  alignas(64) float sums[16];
  _mm512_store_ps(sums, _mm512_permutexvar_ps(order, r));
  for (int i = 0; i < n; ++i) out[i] = sums[i];
}
#else
// out[0:n] = the horizontal sums of acc[0:n].
inline void reduce_each(const Vec* acc, int n, float* out) {
  int i = 0;
#if defined(CPU_CAPABILITY_AVX2)
  // Four sums from three hadds and one add instead of four separate reductions.
  for (; i + 4 <= n; i += 4) {
    const __m256 ab = _mm256_hadd_ps(acc[i], acc[i + 1]);
    const __m256 cd = _mm256_hadd_ps(acc[i + 2], acc[i + 3]);
    const __m256 abcd = _mm256_hadd_ps(ab, cd);
    _mm_storeu_ps(out + i, _mm_add_ps(_mm256_castps256_ps128(abcd),
                                      _mm256_extractf128_ps(abcd, 1)));
  }
#endif
  for (; i < n; ++i) out[i] = hsum(acc[i]);
}
#endif

// scores[g * ctx + i] = q[g] . rows[i] for kG heads (q: [kG, d] floats) and n rows of d
// values. Each key is widened once for all kG heads, and two keys go at a time, so 2 * kG
// independent accumulators keep the FMA units busy.
template <int kG, int kD, typename C>
TANDEM_INLINE void head_dots(const float* q, const C* rows, int64_t stride, int64_t n,
                            float* scores, int64_t ctx, int d) {
  const int vecs = kD > 0 ? kD / kLanes : d / kLanes;
  Vec a[2 * kG];
  float sums[2 * kG];
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    const C* k0 = rows + i * stride;
    const C* k1 = k0 + stride;
    for (int g = 0; g < 2 * kG; ++g) a[g] = Vec(0.f);
    for (int r = 0; r < vecs; ++r) {
      const Vec x0 = widen(k0 + r * kLanes), x1 = widen(k1 + r * kLanes);
      for (int g = 0; g < kG; ++g) {
        const Vec qv = Vec::loadu(q + g * d + r * kLanes);
        a[g] = at::vec::fmadd(qv, x0, a[g]);
        a[kG + g] = at::vec::fmadd(qv, x1, a[kG + g]);
      }
    }
    reduce_each(a, 2 * kG, sums);
    for (int g = 0; g < kG; ++g) {
      scores[g * ctx + i] = sums[g];
      scores[g * ctx + i + 1] = sums[kG + g];
    }
  }
  if (i < n) {
    const C* k0 = rows + i * stride;
    for (int g = 0; g < kG; ++g) a[g] = Vec(0.f);
    for (int r = 0; r < vecs; ++r) {
      const Vec x0 = widen(k0 + r * kLanes);
      for (int g = 0; g < kG; ++g) a[g] = at::vec::fmadd(Vec::loadu(q + g * d + r * kLanes), x0, a[g]);
    }
    reduce_each(a, kG, sums);
    for (int g = 0; g < kG; ++g) scores[g * ctx + i] = sums[g];
  }
}

// acc[g * d + j] += sum_i w[g * ctx + i] * rows[i][j] for kG heads, j in [0, kRegs * kLanes):
// each value loaded and widened once for all heads, the accumulators held in registers.
template <int kG, int kRegs, typename C>
TANDEM_INLINE void head_weighted_rows_chunk(const float* w, int64_t ctx, const C* rows,
                                           int64_t stride, int64_t n, float* acc, int d) {
  Vec a[kG][kRegs];
  for (int g = 0; g < kG; ++g)
    for (int r = 0; r < kRegs; ++r) a[g][r] = Vec::loadu(acc + g * d + r * kLanes);
  for (int64_t i = 0; i < n; ++i) {
    const C* v = rows + i * stride;
    Vec wi[kG];
    for (int g = 0; g < kG; ++g) wi[g] = Vec(w[g * ctx + i]);
    for (int r = 0; r < kRegs; ++r) {
      const Vec x = widen(v + r * kLanes);
      for (int g = 0; g < kG; ++g) a[g][r] = at::vec::fmadd(wi[g], x, a[g][r]);
    }
  }
  for (int g = 0; g < kG; ++g)
    for (int r = 0; r < kRegs; ++r) a[g][r].store(acc + g * d + r * kLanes);
}

// acc[g, 0:d] += sum_i w[g, i] * rows[i] for kG heads and n rows: d in chunks whose kG x kRegs
// accumulators fit the 16 vector registers.
template <int kG, typename C>
inline void head_weighted_rows(const float* w, int64_t ctx, const C* rows, int64_t stride,
                               int64_t n, float* acc, int d) {
  constexpr int kRegs = kG == 1 ? 8 : kG == 2 ? 6 : kG == 3 ? 4 : 3;
  int j = 0;
  for (; j + kRegs * kLanes <= d; j += kRegs * kLanes) {
    head_weighted_rows_chunk<kG, kRegs>(w, ctx, rows + j, stride, n, acc + j, d);
  }
  for (; j < d; j += kLanes) head_weighted_rows_chunk<kG, 1>(w, ctx, rows + j, stride, n, acc + j, d);
}

// p = exp(s - max(s)) in place over n scores; returns sum(p).
inline float softmax_numerators(float* s, int64_t n) {
  Vec vmax(s[0]);
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) vmax = at::vec::maximum(vmax, Vec::loadu(s + t));
  float m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
  for (; t < n; ++t) m = std::max(m, s[t]);
  const Vec vm(m);
  Vec vsum(0.f);
  t = 0;
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

// Scores of kG query heads (qf: [kG, d], scaled) against a row's keys: scores [kG, ctx].
// While it reads a block's keys it prefetches the next block's keys and this block's values,
// which the value pass then finds in cache.
template <int kG, int kD, typename C>
void score_pass(const float* qf, const C* k_cache, const C* v_cache, const float* k_scales,
                const int64_t* table, int64_t ctx, int64_t kvh, const Shapes& s, int d,
                float* scores) {
  const int64_t bs = s.block_size, token_stride = s.kv_heads * d;
  for (int64_t t0 = 0; t0 < ctx; t0 += bs) {
    const int64_t block = table[t0 / bs], n = std::min(bs, ctx - t0);
    const int64_t base = (block * bs * s.kv_heads + kvh) * d;
    // the first block starts the next kAhead on their way; each later one adds the block
    // kAhead past it
    for (int64_t a = (t0 == 0 ? 1 : kAhead); a <= kAhead; ++a) {
      if (t0 + a * bs >= ctx) break;
      const int64_t next = (table[t0 / bs + a] * bs * s.kv_heads + kvh) * d;
      prefetch_rows(k_cache + next, token_stride, std::min(bs, ctx - t0 - a * bs), d);
    }
    prefetch_rows(v_cache + base, token_stride, n, d);
    head_dots<kG, kD>(qf, k_cache + base, token_stride, n, scores + t0, ctx, d);
    if (k_scales != nullptr) {
      const float* ks = k_scales + block * bs * s.kv_heads + kvh;
      for (int64_t g = 0; g < kG; ++g)
        for (int64_t i = 0; i < n; ++i) scores[g * ctx + t0 + i] *= ks[i * s.kv_heads];
    }
  }
}

// acc [kG, d] = sum_t p[g, t] v[t] for kG heads' softmax numerators p (scores, [kG, ctx]);
// with an 8-bit cache each weight is first multiplied by its value's scale, in place.
template <int kG, typename C>
void value_pass(float* p, const C* v_cache, const float* v_scales, const int64_t* table,
                int64_t ctx, int64_t kvh, const Shapes& s, int d, float* acc) {
  const int64_t bs = s.block_size, token_stride = s.kv_heads * d;
  std::fill(acc, acc + kG * d, 0.f);
  for (int64_t t0 = 0; t0 < ctx; t0 += bs) {
    const int64_t block = table[t0 / bs], n = std::min(bs, ctx - t0);
    if (v_scales != nullptr) {
      const float* vs = v_scales + block * bs * s.kv_heads + kvh;
      for (int64_t g = 0; g < kG; ++g)
        for (int64_t i = 0; i < n; ++i) p[g * ctx + t0 + i] *= vs[i * s.kv_heads];
    }
    head_weighted_rows<kG>(p + t0, ctx, v_cache + (block * bs * s.kv_heads + kvh) * d,
                           token_stride, n, acc, d);
  }
}

// kD > 0 fixes head_dim at compile time so the inner loops unroll; kD == 0 reads it at run
// time.
// An 8-bit cache (C = int8_t or Fp8) comes with float scales per (slot, kv head): a key's
// scale multiplies its scores, a value's its softmax weight.
template <int kG, typename T, typename C, int kD>
void attend_heads(int64_t row, int64_t kvh, int64_t g0, const Shapes& s, float scale,
                  const T* q, const C* k_cache, const C* v_cache, const float* k_scales,
                  const float* v_scales, const int64_t* table, int64_t ctx, T* out,
                  std::vector<float>& scratch) {
  const int d = kD > 0 ? kD : static_cast<int>(s.head_dim);
  const int64_t group = s.heads / s.kv_heads;
  // scratch: q * scale [kG, D] | acc [kG, D] | scores [kG, ctx]
  scratch.resize(2 * kG * d + kG * ctx);
  float* qf = scratch.data();
  float* acc = qf + kG * d;
  float* scores = acc + kG * d;
  for (int64_t g = 0; g < kG; ++g) {
    const T* qg = q + row * s.q_row + (kvh * group + g0 + g) * s.q_head;
    for (int j = 0; j < d; ++j) qf[g * d + j] = static_cast<float>(qg[j]) * scale;
  }
  score_pass<kG, kD>(qf, k_cache, v_cache, k_scales, table, ctx, kvh, s, d, scores);
  float inv_sum[kG];
  for (int64_t g = 0; g < kG; ++g) inv_sum[g] = 1.f / softmax_numerators(scores + g * ctx, ctx);
  value_pass<kG>(scores, v_cache, v_scales, table, ctx, kvh, s, d, acc);
  for (int64_t g = 0; g < kG; ++g) {
    T* o = out + (row * s.heads + kvh * group + g0 + g) * d;
    for (int j = 0; j < d; ++j) o[j] = static_cast<T>(acc[g * d + j] * inv_sum[g]);
  }
}

// One work item: the G = H / KVH query heads of one (row, kv head), kMaxHeads at a time.
template <typename T, typename C, int kD>
void attend_one(int64_t row, int64_t kvh, const Shapes& s, float scale, const T* q,
                const C* k_cache, const C* v_cache, const float* k_scales,
                const float* v_scales, const int64_t* tables, int64_t ctx, T* out,
                std::vector<float>& scratch) {
  const int64_t group = s.heads / s.kv_heads;
  const int64_t* table = tables + row * s.max_blocks;
  for (int64_t g0 = 0; g0 < group; g0 += kMaxHeads) {
    const auto heads = [&](auto kg) {
      attend_heads<decltype(kg)::value, T, C, kD>(row, kvh, g0, s, scale, q, k_cache, v_cache,
                                                 k_scales, v_scales, table, ctx, out, scratch);
    };
    switch (std::min<int64_t>(kMaxHeads, group - g0)) {
      case 1: heads(std::integral_constant<int, 1>{}); break;
      case 2: heads(std::integral_constant<int, 2>{}); break;
      case 3: heads(std::integral_constant<int, 3>{}); break;
      default: heads(std::integral_constant<int, 4>{}); break;
    }
  }
}

template <typename T, typename C, int kD>
void attend_all(const Shapes& s, float scale, const T* q, const C* k_cache, const C* v_cache,
                const float* k_scales, const float* v_scales, const int64_t* tables,
                const int64_t* context_lens, T* out, int64_t rows) {
  // Threads claim work one at a time from a shared counter, so ragged context lengths
  // balance across them. A claim is a whole row (its KV heads one after another) where there
  // are rows enough to balance: a block's heads are adjacent in memory, and one thread
  // reading them all streams the block where threads on different heads of one row each
  // read a third of it (30 layers of 16 rows: 4.2 vs 5.2 ms at 256 keys, 10.4 vs 13.6 at
  // 512, an AMX Xeon's 2 cores); with few rows, a (row, kv head) at a time.
  const int64_t threads = at::get_num_threads(), group = s.heads / s.kv_heads;
  const int64_t heads_per_claim = rows >= kRowsPerThread * threads ? s.kv_heads : 1;
  const int64_t items = rows * s.kv_heads / heads_per_claim;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(threads, items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (int64_t i = next++; i < items; i = next++) {
      for (int64_t j = i * heads_per_claim; j < (i + 1) * heads_per_claim; ++j) {
        const int64_t row = j / s.kv_heads, kvh = j % s.kv_heads;
        const int64_t ctx = context_lens[row];
        if (ctx > 0) {
          attend_one<T, C, kD>(row, kvh, s, scale, q, k_cache, v_cache, k_scales, v_scales,
                               tables, ctx, out, scratch);
        } else {
          T* o = out + (row * s.heads + kvh * group) * s.head_dim;
          std::fill(o, o + group * s.head_dim, static_cast<T>(0.f));
        }
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

// Causal attention for prefill chunks (bf16, CPUs with AVX512-BF16), read from the paged KV
// cache in place.
//
// The torch path (model/attention.py: gather K and V through the block tables, then two
// batched matmuls around a softmax) computes every (query, key) pair of a chunk and masks the
// later half away: a 2,000-token prompt spent 56% of its step in attention, half of it on
// pairs nobody sees, and a third more on copies (the gather, the permutes into matmul layout).
// Here each query row computes the keys it sees and no others:
//   pack     each (row, kv head)'s keys into 16-key tiles of dimension pairs, and its values
//            into key pairs, once for all query heads and positions (O(keys * D), vs the
//            O(queries * keys * D) of the products)
//   scores   a tile of up to kRows query rows (G heads x a few positions, all of one kv head)
//            against 32 keys at a time: vdpbf16ps multiplies 16 keys' dimension pairs by one
//            broadcast query pair, 2 x kRows float32 accumulators in registers
//   softmax  over each row's own keys, as masked_softmax_ (fused.cpp) computes it
//   values   the row's bf16 probabilities (key pairs) times the packed values, D / 16
//            accumulators a row
// Roundings are the torch path's: scores and outputs rounded to bf16 as its matmuls return
// them, bf16(score * scale), probabilities rounded to bf16. Sums run in another order than
// oneDNN's, so results agree with the torch path to bf16 rounding, not to the bit; each row
// depends only on its own query and keys, so any split of a chunk's rows gives the same bits.
//
// prefill_attention(q [B, Q, H, D] bf16 (heads contiguous, rows strided), k_cache, v_cache
//                   [blocks, block_size, KVH, D] bf16 (or int8 / e4m3 with k_scales, v_scales
//                   [blocks, block_size, KVH] float32: dequantized as they are packed),
//                   block_tables [B, max_blocks] long, starts [B] long, context_lens [B] long,
//                   scale)
//   -> out [B, Q, H, D]: row b has n = context_lens[b] - starts[b] queries; its query i < n at
//      position starts[b] + i sees keys [0, starts[b] + i]; rows from n on are padding and
//      come back zero.
// available() is false where the CPU or compiler lacks AVX512-BF16 (the caller then keeps the
// torch path). D must be a multiple of 16, at most 128.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>
#define TANDEM_HAVE_AVX512_BF16 1
#endif

namespace {

#if TANDEM_HAVE_AVX512_BF16

constexpr int kRows = 12;     // query rows of a score tile: 24 accumulators + 2 key vectors
constexpr int kTileKeys = 16;  // keys of a packed tile: one vector of float32 scores
constexpr int kMaxD = 128;

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// float(bf16(x)) for 16 floats: round to nearest even, as c10::BFloat16 (finite values).
inline __m512 round_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

struct ChunkShapes {
  int64_t batch, queries, heads, kv_heads, d, block_size, max_blocks;
};

// A cache slot's D values as bf16 bits: a bf16 cache's as stored; an 8-bit one's (int8, or
// e4m3 as its bits) bf16(value * the slot's scale), as kv_quant.dequantize_kv computes them.
template <typename C>
inline void slot_bf16(const C* cache, const float* scales, int64_t slot, int64_t d, uint16_t* out) {
  const C* x = cache + slot * d;
  if constexpr (std::is_same_v<C, uint16_t>) {
    std::memcpy(out, x, d * sizeof(uint16_t));
  } else {
    const float s = scales[slot];
    for (int64_t c = 0; c < d; ++c) {
      float v;
      if constexpr (std::is_same_v<C, uint8_t>)
        v = static_cast<float>(c10::Float8_e4m3fn(x[c], c10::Float8_e4m3fn::from_bits()));
      else
        v = static_cast<float>(x[c]);
      out[c] = at::BFloat16(v * s).x;
    }
  }
}

// Row b's keys of kv head h, as 32-bit words (a pair of bf16): K tiles [tiles][D/2][16] (word
// (t, p, k) = key 16t + k's dimensions 2p, 2p + 1) and V pairs [keys/2][D] (word (j, c) =
// value c of keys 2j and 2j + 1), zero past the row's keys.
template <typename C>
void pack_row(const C* k_cache, const C* v_cache, const float* k_scales, const float* v_scales,
              const int64_t* table, int64_t keys, int64_t padded, int64_t h,
              const ChunkShapes& s, uint32_t* kp, uint32_t* vp) {
  const int64_t half = s.d / 2;
  uint16_t* vp16 = reinterpret_cast<uint16_t*>(vp);
  uint16_t k[kMaxD], v[kMaxD];
  for (int64_t j = 0; j < padded; ++j) {
    uint32_t* kt = kp + (j / kTileKeys) * half * kTileKeys + j % kTileKeys;
    uint16_t* vt = vp16 + (j / 2) * s.d * 2 + j % 2;
    if (j < keys) {
      const int64_t slot = (table[j / s.block_size] * s.block_size + j % s.block_size) * s.kv_heads + h;
      slot_bf16(k_cache, k_scales, slot, s.d, k);
      slot_bf16(v_cache, v_scales, slot, s.d, v);
    } else {
      std::fill(k, k + s.d, uint16_t{0});
      std::fill(v, v + s.d, uint16_t{0});
    }
    for (int64_t p = 0; p < half; ++p) kt[p * kTileKeys] = k[2 * p] | (uint32_t{k[2 * p + 1]} << 16);
    for (int64_t c = 0; c < s.d; ++c) vt[c * 2] = v[c];
  }
}

// scores[r][16t + k] = q[r] . key(16t + k) for key tiles [0, tiles), float32.
void score_tile(const uint32_t* const* q, const uint32_t* kp, int64_t half, int64_t tiles,
                float* scores, int64_t stride) {
  const int64_t tile_words = half * kTileKeys;
  int64_t t = 0;
  for (; t + 2 <= tiles; t += 2) {
    __m512 acc[kRows][2];
    for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint32_t* k0 = kp + t * tile_words;
    const uint32_t* k1 = k0 + tile_words;
    for (int64_t p = 0; p < half; ++p) {
      const __m512bh a = as_bh(_mm512_loadu_si512(k0 + p * kTileKeys));
      const __m512bh b = as_bh(_mm512_loadu_si512(k1 + p * kTileKeys));
      for (int r = 0; r < kRows; ++r) {
        const __m512bh qr = as_bh(_mm512_set1_epi32(static_cast<int>(q[r][p])));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qr, a);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qr, b);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      _mm512_storeu_ps(scores + r * stride + t * kTileKeys, acc[r][0]);
      _mm512_storeu_ps(scores + r * stride + (t + 1) * kTileKeys, acc[r][1]);
    }
  }
  if (t < tiles) {
    __m512 acc[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
    const uint32_t* k0 = kp + t * tile_words;
    for (int64_t p = 0; p < half; ++p) {
      const __m512bh a = as_bh(_mm512_loadu_si512(k0 + p * kTileKeys));
      for (int r = 0; r < kRows; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], as_bh(_mm512_set1_epi32(static_cast<int>(q[r][p]))), a);
    }
    for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(scores + r * stride + t * kTileKeys, acc[r]);
  }
}

// at::vec's exp_u20 (vec256_float.h, the decode kernel's and masked_softmax_'s exp) on 16
// lanes: the same operations, so each lane's result is the same float.
inline __m512 exp_u20(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 lowest = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0xc2aeac50u)));
  const __m512 highest = _mm512_castsi512_ps(_mm512_set1_epi32(0x42b17218));
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lowest, _CMP_LT_OS);
  const __m512 src = _mm512_max_ps(_mm512_min_ps(x, highest), lowest);
  const __m512 fx = _mm512_roundscale_ps(
      _mm512_fmadd_ps(src, _mm512_castsi512_ps(_mm512_set1_epi32(0x3fb8aa3b)), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // floor(x * log2(e) + 0.5)
  const __m512 r = _mm512_fnmadd_ps(fx, _mm512_castsi512_ps(_mm512_set1_epi32(0x3f317218)), src);
  __m512 y = _mm512_fmadd_ps(r, _mm512_set1_ps(0.00828929059f), _mm512_set1_ps(0.0418978221f));
  y = _mm512_fmadd_ps(r, y, _mm512_set1_ps(0.166676521f));
  y = _mm512_fmadd_ps(r, y, _mm512_set1_ps(0.499991506f));
  y = _mm512_fmadd_ps(r, y, _mm512_set1_ps(0.999999701f));
  y = _mm512_fmadd_ps(r, y, one);
  const __m512i n = _mm512_cvtps_epi32(_mm512_sub_ps(fx, one));
  __m512 pow2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23));
  pow2 = _mm512_mask_blend_ps(tiny, pow2, _mm512_setzero_ps());
  return _mm512_mul_ps(_mm512_mul_ps(y, pow2), _mm512_set1_ps(2.f));
}

// 16 floats as bf16 (already rounded: the upper halves), the first `lanes` of them stored.
inline void store_bf16(uint16_t* dst, __m512 rounded, __mmask16 lanes = 0xffff) {
  _mm512_mask_cvtepi32_storeu_epi16(dst, lanes, _mm512_srli_epi32(_mm512_castps_si512(rounded), 16));
}

inline __mmask16 first(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }

// One row's probabilities from its n scores: p = bf16(softmax(bf16(bf16(s) * scale))), written
// as bf16 into probs, zero from n to `padded` (the tile's key-pair span). Three passes over
// the row, 16 lanes each: scale and max, exp and sum, normalize and narrow.
void softmax_row(float* s, int64_t n, int64_t padded, float scale, uint16_t* probs) {
  const __m512 sc = _mm512_set1_ps(scale), minus_inf = _mm512_set1_ps(-INFINITY);
  const int64_t whole = n / 16 * 16;
  const __mmask16 tail = first(n - whole);
  __m512 vmax = minus_inf;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = i < whole ? 0xffff : tail;
    const __m512 x = round_bf16(_mm512_mul_ps(round_bf16(_mm512_maskz_loadu_ps(m, s + i)), sc));
    _mm512_mask_storeu_ps(s + i, m, x);
    vmax = _mm512_mask_max_ps(vmax, m, vmax, x);
  }
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = i < whole ? 0xffff : tail;
    const __m512 p = exp_u20(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i), mx));
    _mm512_mask_storeu_ps(s + i, m, p);
    vsum = _mm512_mask_add_ps(vsum, m, vsum, p);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vsum));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = i < whole ? 0xffff : tail;
    store_bf16(probs + i, round_bf16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + i), inv)), m);
  }
  std::fill(probs + n, probs + padded, uint16_t{0});
}

// out[r] = sum over key pairs of probs[r] * values, for kNV * 16 dimensions, rounded to bf16;
// rows in passes of kR (kR * kNV accumulators), past `rows` the caller's dummies (zero
// probabilities, a scratch output) up to a whole pass.
template <int kNV>
void value_tile(const uint32_t* const* probs, const uint32_t* vp, int64_t pairs, int rows,
                at::BFloat16* const* out) {
  constexpr int kR = std::min(kRows, 24 / kNV);
  for (int r0 = 0; r0 < rows; r0 += kR) {
    __m512 acc[kR][kNV];
    for (int r = 0; r < kR; ++r)
      for (int c = 0; c < kNV; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < pairs; ++j) {
      __m512bh v[kNV];
      for (int c = 0; c < kNV; ++c) v[c] = as_bh(_mm512_loadu_si512(vp + (j * kNV + c) * 16));
      for (int r = 0; r < kR; ++r) {
        const __m512bh p = as_bh(_mm512_set1_epi32(static_cast<int>(probs[r0 + r][j])));
        for (int c = 0; c < kNV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p, v[c]);
      }
    }
    for (int r = 0; r < kR; ++r)
      for (int c = 0; c < kNV; ++c)
        store_bf16(reinterpret_cast<uint16_t*>(out[r0 + r] + c * 16), round_bf16(acc[r][c]));
  }
}

using ValueTile = void (*)(const uint32_t* const*, const uint32_t*, int64_t, int,
                           at::BFloat16* const*);

ValueTile value_tile_for(int64_t d) {
  switch (d / 16) {
    case 1: return value_tile<1>;
    case 2: return value_tile<2>;
    case 3: return value_tile<3>;
    case 4: return value_tile<4>;
    case 5: return value_tile<5>;
    case 6: return value_tile<6>;
    case 7: return value_tile<7>;
    default: return value_tile<8>;
  }
}

struct Task {
  int64_t b, h, row0, keys;  // (row, kv head), its first query row, the keys its rows see
};

#endif  // TANDEM_HAVE_AVX512_BF16

bool available() {
#if TANDEM_HAVE_AVX512_BF16
  return true;
#else
  return false;
#endif
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& starts, const at::Tensor& context_lens, double scale,
                             const std::optional<at::Tensor>& k_scales,
                             const std::optional<at::Tensor>& v_scales) {
  TORCH_CHECK(available(), "prefill_attention needs AVX512-BF16");
#if TANDEM_HAVE_AVX512_BF16
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kBFloat16 && q.stride(3) == 1 &&
                  q.stride(2) == q.size(3) && q.stride(1) % 2 == 0 && q.stride(0) % 2 == 0,
              "q must be bf16 [B, Q, H, D] with contiguous heads");
  const auto cache_type = k_cache.scalar_type();
  const bool eight_bit = cache_type == at::kChar || cache_type == at::kFloat8_e4m3fn;
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && v_cache.scalar_type() == cache_type &&
                  (cache_type == at::kBFloat16 || eight_bit),
              "caches must be contiguous bf16, int8 or float8_e4m3fn [blocks, block_size, KVH, D]");
  TORCH_CHECK(eight_bit == (k_scales.has_value() && v_scales.has_value()),
              "k_scales and v_scales are given for an 8-bit cache, and only then");
  if (eight_bit)
    for (const at::Tensor* t : {&*k_scales, &*v_scales})
      TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat &&
                      t->numel() * k_cache.size(3) == k_cache.numel(),
                  "scales must be contiguous float32 [blocks, block_size, KVH]");
  const ChunkShapes s{q.size(0), q.size(1), q.size(2), k_cache.size(2), q.size(3), k_cache.size(1),
                 block_tables.size(1)};
  TORCH_CHECK(k_cache.size(3) == s.d && s.d % 16 == 0 && s.d <= kMaxD,
              "head_dim must match the cache, a multiple of 16, at most ", kMaxD);
  TORCH_CHECK(s.heads % s.kv_heads == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == s.batch &&
                  block_tables.is_contiguous() && block_tables.scalar_type() == at::kLong,
              "block_tables must be contiguous long [B, max_blocks]");
  for (const at::Tensor* t : {&starts, &context_lens})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == s.batch && t->is_contiguous() &&
                    t->scalar_type() == at::kLong,
                "starts and context_lens must be long [B]");
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t num_blocks = k_cache.size(0), group = s.heads / s.kv_heads, half = s.d / 2;
  // where each row's packed keys start, and the work: tiles of kRows (position, head) rows
  std::vector<int64_t> offset(s.batch + 1, 0), padded(s.batch), len(s.batch);
  std::vector<Task> tasks;
  for (int64_t b = 0; b < s.batch; ++b) {
    len[b] = ctx[b] - start[b];  // the row's queries
    TORCH_CHECK(len[b] >= 0 && len[b] <= s.queries && start[b] >= 0,
                "bad starts or context_lens");
    const int64_t keys = ctx[b];
    TORCH_CHECK(keys <= s.max_blocks * s.block_size, "block table too short for row ", b);
    for (int64_t i = 0; i < (keys + s.block_size - 1) / s.block_size; ++i)
      TORCH_CHECK(tables[b * s.max_blocks + i] >= 0 && tables[b * s.max_blocks + i] < num_blocks,
                  "block id out of range");
    padded[b] = (keys + kTileKeys - 1) / kTileKeys * kTileKeys;
    offset[b + 1] = offset[b] + padded[b] * s.kv_heads * half;
    for (int64_t h = 0; h < s.kv_heads; ++h)
      for (int64_t r = 0; r < len[b] * group; r += kRows)
        tasks.push_back({b, h, r, start[b] + (std::min(r + kRows, len[b] * group) - 1) / group + 1});
  }
  // longest first, handed out as threads free up: later tiles see more keys
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.keys > b.keys; });
  const int64_t q_row = q.stride(1) / 2, q_batch = q.stride(0) / 2;  // in words
  auto out = at::empty(q.sizes(), q.options());
  auto kp = at::empty({offset.back()}, q.options().dtype(at::kInt));
  auto vp = at::empty({offset.back()}, q.options().dtype(at::kInt));
  const float* ks = eight_bit ? k_scales->data_ptr<float>() : nullptr;
  const float* vs = eight_bit ? v_scales->data_ptr<float>() : nullptr;
  auto* kpb = reinterpret_cast<uint32_t*>(kp.data_ptr());
  auto* vpb = reinterpret_cast<uint32_t*>(vp.data_ptr());
  const auto* qb = reinterpret_cast<const uint32_t*>(q.data_ptr());
  auto* ob = out.data_ptr<at::BFloat16>();
  const ValueTile values = value_tile_for(s.d);
  const float sc = static_cast<float>(scale);
  const int threads = at::get_num_threads();
  const int64_t packs = s.batch * s.kv_heads, ntasks = static_cast<int64_t>(tasks.size());
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < packs; ++i) {
      const int64_t b = i / s.kv_heads, h = i % s.kv_heads;
      const int64_t words = padded[b] * half;
      const auto pack = [&](auto* kc, auto* vc) {
        pack_row(kc, vc, ks, vs, tables + b * s.max_blocks, ctx[b], padded[b], h, s,
                 kpb + offset[b] + h * words, vpb + offset[b] + h * words);
      };
      if (cache_type == at::kBFloat16)
        pack(static_cast<const uint16_t*>(k_cache.data_ptr()), static_cast<const uint16_t*>(v_cache.data_ptr()));
      else if (cache_type == at::kChar)
        pack(static_cast<const int8_t*>(k_cache.data_ptr()), static_cast<const int8_t*>(v_cache.data_ptr()));
      else
        pack(static_cast<const uint8_t*>(k_cache.data_ptr()), static_cast<const uint8_t*>(v_cache.data_ptr()));
    }
    std::vector<float> scores;
    std::vector<uint32_t> probs, no_probs;
    const std::vector<uint32_t> zeros(half, 0);
    std::vector<at::BFloat16> no_out(s.d);
    // rows of a task, then dummies (zero query or probabilities, a scratch output) up to a
    // whole pass of the score and value tiles
    const uint32_t* qrow[kRows];
    const uint32_t* prow[2 * kRows];
    at::BFloat16* orow[2 * kRows];
#pragma omp for schedule(dynamic, 1)
    for (int64_t n = 0; n < ntasks; ++n) {
      const Task& task = tasks[n];
      const int64_t b = task.b, h = task.h, words = padded[b] * half;
      const int64_t rows = std::min<int64_t>(kRows, len[b] * group - task.row0);
      const int64_t keys = task.keys, tiles = (keys + kTileKeys - 1) / kTileKeys;
      const int64_t stride = tiles * kTileKeys;
      scores.resize(kRows * stride);
      probs.resize(kRows * stride / 2);
      no_probs.assign(stride / 2, 0);
      for (int r = 0; r < 2 * kRows; ++r) {
        const int64_t row = task.row0 + r, i = row / group, head = h * group + row % group;
        const bool real = r < rows;
        if (r < kRows) qrow[r] = real ? qb + b * q_batch + i * q_row + head * half : zeros.data();
        prow[r] = real ? probs.data() + r * stride / 2 : no_probs.data();
        orow[r] = real ? ob + ((b * s.queries + i) * s.heads + head) * s.d : no_out.data();
      }
      score_tile(qrow, kpb + offset[b] + h * words, half, tiles, scores.data(), stride);
      const int64_t span = (keys + 1) / 2 * 2;  // the tile's keys, in whole pairs
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t visible = start[b] + (task.row0 + r) / group + 1;
        softmax_row(scores.data() + r * stride, visible, span,
                    sc, reinterpret_cast<uint16_t*>(probs.data() + r * stride / 2));
      }
      values(prow, vpb + offset[b] + h * words, span / 2, static_cast<int>(rows), orow);
    }
  }
  // padding rows (past a row's length) come back zero
  for (int64_t b = 0; b < s.batch; ++b)
    if (len[b] < s.queries)
      std::memset(static_cast<void*>(ob + (b * s.queries + len[b]) * s.heads * s.d), 0,
                  (s.queries - len[b]) * s.heads * s.d * sizeof(at::BFloat16));
  return out;
#else
  return at::Tensor();
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build has the AVX512-BF16 kernel");
  m.def("prefill_attention", &prefill_attention,
        "causal attention of prefill chunks from the paged KV cache (CPU, bf16)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("starts"),
        py::arg("context_lens"), py::arg("scale"), py::arg("k_scales") = py::none(),
        py::arg("v_scales") = py::none());
}

// Weight-only quantized weights back to bfloat16, for the steps with many rows (prefills,
// large decode batches), where torch's int4/int8 kernels (which dequantize per row of the
// input) are 2-3x slower than one dequantization followed by a bf16 matmul.
//
// dequant_int4_t(out, [packed...], [scales_zeros...], group, row_begin, row_end): out =
//   W[rows]^T for W the sum of one or two int4 terms (GGUF's Q8_0 is two),
//   [k, row_end - row_begin] bfloat16, for a range of whole 64-row blocks. The caller goes
//   through a big weight a cache-sized slice at a time, each slice's matmul reading it while
//   it is still in cache, into one reused buffer (a fresh allocation this large is mapped
//   anew each time, and its page faults cost as much as the work).
//   packed: torch's CPU int4 layout (aten::_convert_weight_to_int4pack_for_cpu), [n, k/2]
//     uint8, read as blocks of 64 rows: [n/64, k, 32], byte j of (block, column) holding row
//     j in its low nibble and row j + 32 in its high one.
//   scales_zeros: [k/group, n, 2] bfloat16; w = (q - 8) * scale + zero.
// The transposed result is written in the packed layout's own order (64 consecutive rows per
// column), and a matmul reads W^T as fast as W.
//
// dequant_int8(out, q, scales): out = W, [n, k] bfloat16, w = q * scale[row] (the caller
//   passes a slice of rows, contiguous in this layout).
//
// int4_gemm(out, x, [packed...], [scales_zeros...], group): out = x W^T, [m, n_out] bfloat16
//   (n_out <= W's padded rows), where the CPU has AMX (gemm_path() is "amx"). Each 64-row block of W
//   is dequantized into a buffer that stays in L2, in the VNNI order AMX reads (pairs of
//   columns interleaved: B[k][j] at ((k / 2) * 64 + j) * 2 + k % 2), and multiplied there by
//   oneDNN's brgemm ukernel (ATen's cpublas::brgemm), 32 input rows at a time; up to 16 rows
//   (decode steps), 32 columns at a time into L1, multiplied there by AMX tile instructions
//   (gemm_terms_tiles). A bf16 matmul on a plain dequantized slice instead reorders the slice
//   into that order on every call, and oneDNN builds a kernel for every new row count: on an
//   AMX Xeon the two cost more than the matmul. Where the CPU has AVX512-BF16 but no AMX
//   (gemm_path() is "dot"), the block in L2 is multiplied by vdpbf16ps instead, 6 input rows
//   a pass with their sums in registers (gemm_terms with dot).
//   With int8_activations (where int8_activations_here(): the dot path, and AVX512-VNNI) the
//   weight is instead multiplied as llama.cpp multiplies GGUF's blocks: x's rows quantized to
//   int8 a 32 columns at a time, the block's weights kept as bytes (one term's q, or two
//   terms' 16 q_hi + q_lo: Q8_0), and the products summed by vpdpbusd, 64 multiplies an
//   instruction where vdpbf16ps does 32 (gemm_int8_activations).
//   With rows_invariant (--batch-invariant; where rows_invariant_here()) every row count takes
//   one order of sums for a row: bf16 activations the few-row path's (gemv_invariant), int8
//   ones their own path, so a row's output never depends on the rows beside it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/utils/pybind.h>

#include <cstring>
#include <string>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

#ifdef __AVX512F__
// 16 floats to bfloat16 bits, rounded to nearest even as c10::BFloat16 does (finite inputs).
inline __m256i bf16_bits(__m512 x) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(x);
#else
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}

inline void store_bf16(at::BFloat16* dst, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), bf16_bits(x));
}

#endif

// Per-row scale of each term and summed zero point of 64-row block b over group g:
// (q - 8) * scale + zero = q * scale + (zero - 8 scale).
template <int terms>
inline void block_params(float (&scale)[terms][64], float (&zero)[64],
                         const at::BFloat16* const* szs, int64_t n, int64_t b, int64_t g) {
  for (int j = 0; j < 64; ++j) zero[j] = 0.f;
  for (int t = 0; t < terms; ++t) {
    const at::BFloat16* s = szs[t] + (g * n + b * 64) * 2;
    for (int j = 0; j < 64; ++j) {
      scale[t][j] = static_cast<float>(s[2 * j]);
      zero[j] += static_cast<float>(s[2 * j + 1]) - 8.f * scale[t][j];
    }
  }
}

#ifdef __AVX512F__
// Column c of block b: its 64 weights as four vectors of 16 rows.
template <int terms>
inline void column(__m512 (&w)[4], const __m512 (&vs)[terms][4], const __m512 (&vz)[4],
                   const uint8_t* const* ps, int64_t k, int64_t b, int64_t c) {
  const __m256i low4 = _mm256_set1_epi8(15);
  for (int v = 0; v < 4; ++v) w[v] = vz[v];
  for (int t = 0; t < terms; ++t) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ps[t] + (b * k + c) * 32));
    const __m256i lo = _mm256_and_si256(bytes, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
    const __m128i parts[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                              _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
    for (int v = 0; v < 4; ++v) {  // rows 16v .. 16v + 15 of the block
      const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(parts[v]));
      w[v] = _mm512_fmadd_ps(q, vs[t][v], w[v]);
    }
  }
}

// Block b's scales and summed zero points over group g, straight from scales_zeros: its 64
// (scale, zero) bf16 pairs are 4 x 16 dwords, the scale in each one's low half, the zero in
// its high half (block_params' numbers, 16 rows an instruction).
template <int terms>
inline void load_params(__m512 (&vs)[terms][4], __m512 (&vz)[4], const at::BFloat16* const* szs,
                        int64_t n, int64_t b, int64_t g) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const __m512 eight = _mm512_set1_ps(8.f);
  for (int v = 0; v < 4; ++v) vz[v] = _mm512_setzero_ps();
  for (int t = 0; t < terms; ++t) {
    const at::BFloat16* s = szs[t] + (g * n + b * 64) * 2;
    for (int v = 0; v < 4; ++v) {
      const __m512i pairs = _mm512_loadu_si512(s + 32 * v);
      vs[t][v] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
      vz[v] = _mm512_add_ps(vz[v], _mm512_sub_ps(zero, _mm512_mul_ps(eight, vs[t][v])));
    }
  }
}

// The rounded bf16 bits of 16 floats, each in the low half of a 32-bit lane.
inline __m512i bf16_lanes(__m512 x) { return _mm512_cvtepu16_epi32(bf16_bits(x)); }
#else
template <int terms>
inline void column(float (&w)[64], const float (&scale)[terms][64], const float (&zero)[64],
                   const uint8_t* const* ps, int64_t k, int64_t b, int64_t c) {
  for (int j = 0; j < 64; ++j) w[j] = zero[j];
  for (int t = 0; t < terms; ++t) {
    const uint8_t* src = ps[t] + (b * k + c) * 32;
    for (int j = 0; j < 32; ++j) {
      w[j] += static_cast<float>(src[j] & 15) * scale[t][j];
      w[j + 32] += static_cast<float>(src[j] >> 4) * scale[t][j + 32];
    }
  }
}
#endif

// The sum of `terms` int4 terms (GGUF's Q8_0 is two), rows [row_begin, row_begin + rows).
template <int terms>
void dequant_terms(at::BFloat16* o, const uint8_t* const* ps, const at::BFloat16* const* szs,
                   int64_t n, int64_t k, int64_t group, int64_t row_begin, int64_t rows) {
  const int64_t blocks = rows / 64, groups = k / group, first = row_begin / 64;
  at::parallel_for(0, blocks * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / groups + first, g = i % groups;
#ifdef __AVX512F__
      __m512 vs[terms][4], vz[4], w[4];
      load_params<terms>(vs, vz, szs, n, b, g);
      for (int64_t c = g * group; c < (g + 1) * group; ++c) {
        column<terms>(w, vs, vz, ps, k, b, c);
        at::BFloat16* dst = o + c * rows + (b - first) * 64;
        for (int v = 0; v < 4; ++v) store_bf16(dst + 16 * v, w[v]);
      }
#else
      float scale[terms][64], zero[64], w[64];
      block_params<terms>(scale, zero, szs, n, b, g);
      for (int64_t c = g * group; c < (g + 1) * group; ++c) {
        column<terms>(w, scale, zero, ps, k, b, c);
        at::BFloat16* dst = o + c * rows + (b - first) * 64;
        for (int j = 0; j < 64; ++j) dst[j] = w[j];
      }
#endif
    }
  });
}

// Bytes of packed weights fetched ahead of the column being dequantized.
constexpr int64_t kPrefetchBytes = 1024;

// The next 64-row block's packed bytes (every term's) toward L2, a share of them issued at
// each step of a pass over this block: a pass of few rows is too short for the column
// prefetches above to cover memory's latency (at 16 rows, blocks read from memory cost the
// model's matmuls 11.6 vs 8.6 ms with the same weights hot in cache), and a burst of them at a
// block's start was dropped (no faster). Pass i of P over block b takes lines [i L / P,
// (i + 1) L / P) of block b + 1's L lines.
struct Lookahead {
  const uint8_t* base[2] = {};
  int64_t lines = 0;      // a term's lines in a block
  int64_t next = 0, end = 0;  // this pass's share, in lines over all the terms
  int64_t per = 0;            // lines a step

  Lookahead(const uint8_t* const* ps, int terms, int64_t k, int64_t b, int64_t blocks,
            int64_t pass, int64_t passes, int64_t steps)
      : lines(k * 32 / 64) {
    if (b + 1 >= blocks) return;
    for (int t = 0; t < terms; ++t) base[t] = ps[t] + (b + 1) * k * 32;
    next = terms * lines * pass / passes;
    end = terms * lines * (pass + 1) / passes;
    per = (end - next + steps - 1) / std::max<int64_t>(1, steps);
  }
  inline void step() {
    for (int64_t i = 0; i < per && next < end; ++i, ++next) {
      const int t = next >= lines;
      __builtin_prefetch(base[t] + (next - t * lines) * 64, 0, 2);
    }
  }
};

#if defined(__AVX512VBMI__) && defined(__AVX512BF16__)
// Columns c and c + 1 of a block are 64 consecutive bytes. One byte permute puts, in dword
// lane L, byte e, the byte of row 8e + L / 2 (and 32 + 8e + L / 2 in its high nibble) of
// column c + L % 2: then a shift leaves in each lane's low 4 bits a weight of pairs of
// columns interleaved, which a float table lookup (vpermps reads 4 index bits) widens, and
// cvtne2ps_pbh rounds two such vectors into 16 rows of AMX's VNNI pairs, in order: by count
// about half the port-5 shuffles of widening each column by itself (cvtepu8 / cvtepu16 per 16
// rows); the model's matmuls at 16 rows 15.4 -> 10.9 ms with the buffer below.
inline __m512i interleave_pairs_index() {
  alignas(64) uint8_t idx[64];
  for (int lane = 0; lane < 16; ++lane)
    for (int e = 0; e < 4; ++e) idx[4 * lane + e] = (lane % 2) * 32 + 8 * e + lane / 2;
  return _mm512_load_si512(idx);
}

// The scales and zeros of extraction x = 4h + e in lane order: row 32h + 8e + L / 2 in lane L,
// from the block's four vectors of 16 rows.
template <int terms>
inline void lane_params(__m512 (&ls)[terms][8], __m512 (&lz)[8], const __m512 (&vs)[terms][4],
                        const __m512 (&vz)[4]) {
  const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  for (int h = 0; h < 2; ++h)
    for (int e = 0; e < 4; ++e) {
      const int x = 4 * h + e, v = 2 * h + e / 2;
      const __m512i idx = e % 2 ? hi : lo;
      for (int t = 0; t < terms; ++t) ls[t][x] = _mm512_permutexvar_ps(idx, vs[t][v]);
      lz[x] = _mm512_permutexvar_ps(idx, vz[v]);
    }
}

// Columns c and c + 1 of block b, dequantized into dst (64 rows x 2 columns, VNNI pairs).
template <int terms>
inline void dequant_pair(at::BFloat16* dst, const uint8_t* const* ps, int64_t k, int64_t b,
                         int64_t c, const __m512i order, const __m512 table,
                         const __m512 (&ls)[terms][8], const __m512 (&lz)[8]) {
  __m512i bytes[terms];
  for (int t = 0; t < terms; ++t) {
    const uint8_t* src = ps[t] + (b * k + c) * 32;
    // the next columns' bytes toward L1 (a block is read once a step, from memory or L3)
    __builtin_prefetch(src + kPrefetchBytes);
    bytes[t] = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(src));
  }
  __m512 w[8];
  for (int x = 0; x < 8; ++x) {  // x = 4h + e: rows 32h + 8e .. + 7, both columns
    w[x] = lz[x];
    for (int t = 0; t < terms; ++t) {
      const __m512i q = x ? _mm512_srli_epi32(bytes[t], 8 * (x % 4) + 4 * (x / 4)) : bytes[t];
      w[x] = _mm512_fmadd_ps(_mm512_permutexvar_ps(q, table), ls[t][x], w[x]);
    }
  }
  for (int v = 0; v < 4; ++v)  // rows 16v .. 16v + 15 at 32v
    _mm512_storeu_si512(dst + 32 * v, (__m512i)_mm512_cvtne2ps_pbh(w[2 * v + 1], w[2 * v]));
}

inline __m512 nibble_table() {
  return _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
}

template <int terms>
void dequant_block_vnni(at::BFloat16* o, const uint8_t* const* ps, const at::BFloat16* const* szs,
                        int64_t n, int64_t k, int64_t group, int64_t b) {
  const __m512i order = interleave_pairs_index();
  const __m512 table = nibble_table();
  for (int64_t g = 0; g < k / group; ++g) {
    __m512 vs[terms][4], vz[4], ls[terms][8], lz[8];
    load_params<terms>(vs, vz, szs, n, b, g);
    lane_params<terms>(ls, lz, vs, vz);
    for (int64_t c = g * group; c < (g + 1) * group; c += 2)
      dequant_pair<terms>(o + c * 64, ps, k, b, c, order, table, ls, lz);  // (c / 2) * 64 * 2
  }
}
#else
// Block b of W (64 rows, every column) into o, [k / 2][64][2] bfloat16: AMX's VNNI order.
// (Every CPU with AMX has VBMI and AVX512-BF16, so int4_gemm takes the pass above; this one
// keeps the file building for others.)
template <int terms>
void dequant_block_vnni(at::BFloat16* o, const uint8_t* const* ps, const at::BFloat16* const* szs,
                        int64_t n, int64_t k, int64_t group, int64_t b) {
  for (int64_t g = 0; g < k / group; ++g) {
#ifdef __AVX512F__
    __m512 vs[terms][4], vz[4], w0[4], w1[4];
    load_params<terms>(vs, vz, szs, n, b, g);
    for (int64_t c = g * group; c < (g + 1) * group; c += 2) {
      column<terms>(w0, vs, vz, ps, k, b, c);
      column<terms>(w1, vs, vz, ps, k, b, c + 1);
      at::BFloat16* dst = o + c * 64;  // = (c / 2) * 64 * 2
      for (int v = 0; v < 4; ++v) {
        const __m512i pair = _mm512_or_si512(bf16_lanes(w0[v]), _mm512_slli_epi32(bf16_lanes(w1[v]), 16));
        _mm512_storeu_si512(dst + 32 * v, pair);
      }
    }
#else
    float scale[terms][64], zero[64], w0[64], w1[64];
    block_params<terms>(scale, zero, szs, n, b, g);
    for (int64_t c = g * group; c < (g + 1) * group; c += 2) {
      column<terms>(w0, scale, zero, ps, k, b, c);
      column<terms>(w1, scale, zero, ps, k, b, c + 1);
      for (int j = 0; j < 64; ++j) {
        o[c * 64 + 2 * j] = w0[j];
        o[c * 64 + 2 * j + 1] = w1[j];
      }
    }
#endif
  }
}
#endif

// Input rows a brgemm call: one kernel for all calls but the tail. (32, 64 and 128 rows, and
// 2 or 4 blocks of W a call, measured within noise of each other on an AMX Xeon.)
constexpr int64_t GEMM_ROWS = 32;

// This thread's buffer number `slot` of at least `bytes`, kept between calls (a fresh one each
// call was zero-filled, and, past glibc's mmap threshold, page-faulted in, for every
// projection of every step), aligned to 64 bytes for whole-vector loads.
template <int slot>
uint8_t* thread_bytes(int64_t bytes) {
  static thread_local std::vector<uint8_t> buffer;
  if (static_cast<int64_t>(buffer.size()) < bytes + 64) buffer.resize(bytes + 64);
  const auto p = reinterpret_cast<uintptr_t>(buffer.data());
  return reinterpret_cast<uint8_t*>((p + 63) & ~uintptr_t(63));
}

// Rows [0, rows) of a block's float products (acc: 64 floats a row) into out's columns
// [col, col + cols), rounded to bf16.
inline void store_rows(at::BFloat16* out, int64_t n_out, int64_t col, int64_t cols,
                       const float* acc, int64_t rows) {
  for (int64_t i = 0; i < rows; ++i) {
    at::BFloat16* dst = out + i * n_out + col;
    int64_t j = 0;
#ifdef __AVX512F__
    for (; j + 16 <= cols; j += 16) store_bf16(dst + j, _mm512_load_ps(acc + i * 64 + j));
#endif
    for (; j < cols; ++j) dst[j] = acc[i * 64 + j];
  }
}

#if defined(__AVX512VBMI__) && defined(__AVX512BF16__)
#define TANDEM_DOT_GEMM 1
// Input rows a pass over a block: 4 accumulators a row, W's 4 vectors and x's pair in 29 of 32 zmm.
constexpr int64_t kDotRowGroup = 6;
// Steps of a pass over a block (pairs of columns) between two Lookahead::step calls.
constexpr int64_t kLookaheadEvery = 16;

// acc[R][64] = x[R rows] . W's block wb (every column, [k / 2][64 rows][2] bf16: the VNNI
// order dequant_block_vnni writes, which is vdpbf16ps's: a lane's two bf16 are a row's pair),
// the sums in registers for all of k.
template <int R>
inline void dot_block_rows(float* acc, const at::BFloat16* x, int64_t k, const at::BFloat16* wb,
                           Lookahead& ahead) {
  __m512 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) a[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k / 2; ++p) {
    if (p % kLookaheadEvery == 0) ahead.step();
    __m512bh w[4];
    for (int v = 0; v < 4; ++v) w[v] = (__m512bh)_mm512_load_si512(wb + p * 128 + 32 * v);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * k + 2 * p, sizeof(pair));
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < 4; ++v) a[r][v] = _mm512_dpbf16_ps(a[r][v], xr, w[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm512_store_ps(acc + r * 64 + 16 * v, a[r][v]);
}

// acc[rows][64] = x[rows] . wb for up to kDotRowGroup rows.
inline void dot_rows(float* acc, const at::BFloat16* x, int64_t k, const at::BFloat16* wb,
                     int64_t rows, Lookahead& ahead) {
  switch (rows) {
    case 1: return dot_block_rows<1>(acc, x, k, wb, ahead);
    case 2: return dot_block_rows<2>(acc, x, k, wb, ahead);
    case 3: return dot_block_rows<3>(acc, x, k, wb, ahead);
    case 4: return dot_block_rows<4>(acc, x, k, wb, ahead);
    case 5: return dot_block_rows<5>(acc, x, k, wb, ahead);
    default: return dot_block_rows<6>(acc, x, k, wb, ahead);
  }
}
#endif

#ifdef TANDEM_DOT_GEMM
// Rows up to which the dot path multiplies W straight from its packed bytes (gemv_terms), by
// terms: one term up to 8, whose sums fit in registers in two passes over a group (the model's
// matmuls 9.0 ms at 8 rows, the block-buffer path 11.9 at 9); two up to 2, past which the
// block buffer's dequantization, paid once for every 6 rows, wins (the Q8_0 head 2.60 vs 2.38
// ms at 3 rows)
constexpr int64_t kGemvRows[3] = {0, 8, 2};

// vpermb's index for two columns' 64 packed bytes (32 a column, byte j: row j's nibble low,
// row j + 32's high): word 2L + e of the result holds column e's bytes of rows L (low byte)
// and L + 16 (high byte), so that its four nibbles are rows L, L + 16, L + 32 and L + 48 of
// that column, in the lane vdpbf16ps pairs the two columns in.
inline __m512i gemv_index() {
  alignas(64) uint8_t idx[64];
  for (int lane = 0; lane < 16; ++lane)
    for (int e = 0; e < 2; ++e) {
      idx[4 * lane + 2 * e] = static_cast<uint8_t>(32 * e + lane);
      idx[4 * lane + 2 * e + 1] = static_cast<uint8_t>(32 * e + lane + 16);
    }
  return _mm512_load_si512(idx);
}

// bf16 of 0..15, twice: vpermw reads a word's low 5 bits, the top one another nibble's.
inline __m512i nibble_bf16_table() {
  alignas(64) uint16_t table[32];
  for (int i = 0; i < 32; ++i) table[i] = c10::BFloat16(static_cast<float>(i % 16)).x;
  return _mm512_load_si512(table);
}

// The shift that brings rows 16v .. 16v + 15's nibble to the bottom of gemv_index's words.
constexpr int kNibbleShift[4] = {0, 8, 4, 12};

// acc[R][64] = x's R rows . block b of W, read straight from the packed bytes: each two
// columns' 64 bytes become the integers q as bf16 (exact) by one byte permute, a shift and a
// word lookup per 16 rows, and vdpbf16ps sums x q per term over a group; the group's scale and
// summed zero point are applied once, in float: sum_t s_t (x . q_t) + z (sum of x). At a few
// rows this is what a step spends (dequant_block_vnni's fma and rounding per weight, and the
// buffer between them, cost more than the multiplies), and no bf16 rounding of W enters. V of
// the block's 4 vectors of 16 rows a pass over it: all 4 while the sums fit in registers
// (terms * R * 4 <= 16), else 2 (the bytes permuted again for the second pass, from L1).
//
// With `words` (gemv_widen's buffer of the block) the bf16 integers are read from there instead
// of converted again: the same numbers in the same sums, for a block that many passes of rows
// multiply.
template <int terms, int R, int V>
void gemv_block(float* acc, const at::BFloat16* x, const float* xsum, const uint8_t* const* ps,
                const at::BFloat16* const* szs, int64_t n, int64_t k, int64_t group, int64_t b,
                __m512i index, __m512i table, const __m512i* words = nullptr) {
  for (int i = 0; i < R * 64; ++i) acc[i] = 0.f;
  const int64_t groups = k / group;
  for (int64_t g = 0; g < groups; ++g) {
#pragma GCC unroll 4
    for (int v0 = 0; v0 < 4; v0 += V) {  // (unrolled: the shifts are immediates)
      __m512 d[terms][R][V];
      for (int t = 0; t < terms; ++t)
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < V; ++v) d[t][r][v] = _mm512_setzero_ps();
      for (int64_t c = g * group; c < (g + 1) * group; c += 2) {
        __m512bh xr[R];
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, x + r * k + c, sizeof(pair));
          xr[r] = (__m512bh)_mm512_set1_epi32(pair);
        }
        for (int t = 0; t < terms; ++t) {
          if (words) {
            const __m512i* wt = words + (t * (k / 2) + c / 2) * 4 + v0;
            for (int v = 0; v < V; ++v) {
              const __m512bh w = (__m512bh)_mm512_load_si512(wt + v);
              for (int r = 0; r < R; ++r) d[t][r][v] = _mm512_dpbf16_ps(d[t][r][v], xr[r], w);
            }
            continue;
          }
          const uint8_t* src = ps[t] + (b * k + c) * 32;
          if (v0 == 0) __builtin_prefetch(src + kPrefetchBytes);
          const __m512i bytes = _mm512_permutexvar_epi8(index, _mm512_loadu_si512(src));
          for (int v = 0; v < V; ++v) {
            const int shift = kNibbleShift[v0 + v];
            const __m512i nibbles = shift ? _mm512_srli_epi16(bytes, shift) : bytes;
            const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(nibbles, table);
            for (int r = 0; r < R; ++r) d[t][r][v] = _mm512_dpbf16_ps(d[t][r][v], xr[r], w);
          }
        }
      }
      __m512 vs[terms][4], vz[4];  // (loaded here, not held in registers through the sums)
      load_params<terms>(vs, vz, szs, n, b, g);
      for (int r = 0; r < R; ++r) {
        const __m512 sum = _mm512_set1_ps(xsum[r * groups + g]);
        for (int v = 0; v < V; ++v) {
          float* a = acc + r * 64 + 16 * (v0 + v);
          __m512 f = _mm512_fmadd_ps(vz[v0 + v], sum, _mm512_load_ps(a));
          for (int t = 0; t < terms; ++t) f = _mm512_fmadd_ps(d[t][r][v], vs[t][v0 + v], f);
          _mm512_store_ps(a, f);
        }
      }
    }
  }
}

// Block b's integers q as bf16, as gemv_block converts them: [terms][k / 2 column pairs][4
// vectors of 16 rows], each vector 16 lanes of two columns' bf16 (vdpbf16ps's pairs).
template <int terms>
void gemv_widen(__m512i* words, const uint8_t* const* ps, int64_t k, int64_t b, __m512i index,
                __m512i table) {
  for (int t = 0; t < terms; ++t)
    for (int64_t c = 0; c < k; c += 2) {
      const uint8_t* src = ps[t] + (b * k + c) * 32;
      __builtin_prefetch(src + kPrefetchBytes);
      const __m512i bytes = _mm512_permutexvar_epi8(index, _mm512_loadu_si512(src));
      __m512i* dst = words + (t * (k / 2) + c / 2) * 4;
      for (int v = 0; v < 4; ++v) {
        const int shift = kNibbleShift[v];
        const __m512i nibbles = shift ? _mm512_srli_epi16(bytes, shift) : bytes;
        _mm512_store_si512(dst + v, _mm512_permutexvar_epi16(nibbles, table));
      }
    }
}

// x W^T for m <= kGemvRows[terms] rows, a block at a time (gemv_block), the blocks split
// between threads.
template <int terms, int R>
void gemv_terms(at::BFloat16* out, const at::BFloat16* x, const uint8_t* const* ps,
                const at::BFloat16* const* szs, int64_t n, int64_t n_out, int64_t k,
                int64_t group) {
  const int64_t groups = k / group, blocks = (n_out + 63) / 64;
  float* xsum = reinterpret_cast<float*>(thread_bytes<3>(R * groups * sizeof(float)));
  for (int r = 0; r < R; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.f;
      for (int64_t c = g * group; c < (g + 1) * group; ++c) sum += static_cast<float>(x[r * k + c]);
      xsum[r * groups + g] = sum;
    }
  constexpr int V = terms * R * 4 <= 16 ? 4 : 2;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    const __m512i index = gemv_index(), table = nibble_bf16_table();
    alignas(64) float acc[R * 64];
    for (int64_t b = begin; b < end; ++b) {
      gemv_block<terms, R, V>(acc, x, xsum, ps, szs, n, k, group, b, index, table);
      store_rows(out, n_out, b * 64, std::min<int64_t>(64, n_out - b * 64), acc, R);
    }
  });
}

template <int terms>
void gemv(at::BFloat16* out, const at::BFloat16* x, const uint8_t* const* ps,
          const at::BFloat16* const* szs, int64_t m, int64_t n, int64_t n_out, int64_t k,
          int64_t group) {
  switch (m) {
    case 1: return gemv_terms<terms, 1>(out, x, ps, szs, n, n_out, k, group);
    case 2: return gemv_terms<terms, 2>(out, x, ps, szs, n, n_out, k, group);
  }
  if constexpr (terms == 1) {
    switch (m) {
      case 3: return gemv_terms<1, 3>(out, x, ps, szs, n, n_out, k, group);
      case 4: return gemv_terms<1, 4>(out, x, ps, szs, n, n_out, k, group);
      case 5: return gemv_terms<1, 5>(out, x, ps, szs, n, n_out, k, group);
      case 6: return gemv_terms<1, 6>(out, x, ps, szs, n, n_out, k, group);
      case 7: return gemv_terms<1, 7>(out, x, ps, szs, n, n_out, k, group);
      case 8: return gemv_terms<1, 8>(out, x, ps, szs, n, n_out, k, group);
    }
  }
  TORCH_CHECK(false, "gemv: ", m, " rows of ", terms, " terms, past kGemvRows");
}

// gemv_block for a pass of R rows, its V as gemv_terms picks it.
template <int terms, int R>
inline void gemv_pass(float* acc, const at::BFloat16* x, const float* xsum,
                      const uint8_t* const* ps, const at::BFloat16* const* szs, int64_t n,
                      int64_t k, int64_t group, int64_t b, __m512i index, __m512i table,
                      const __m512i* words) {
  gemv_block<terms, R, (terms * R * 4 <= 16 ? 4 : 2)>(acc, x, xsum, ps, szs, n, k, group, b, index,
                                                      table, words);
}

// Rows a pass over a widened block (all 4 vectors at once: 6 rows' 24 sums in registers).
constexpr int64_t kWideRows[3] = {0, 6, 2};

// x W^T for any number of rows with each row's sums in gemv_block's order, whatever the rows
// beside it (rows_invariant): a row's products are summed per group in column order, then
// scaled, the same instructions on the same numbers in a pass of 1 row or of 8, so a row
// gets the same bits alone, in a batch of 16 or in a prompt of 512. Past one pass, each
// 64-row block's integers are widened once into this thread's buffer (in L2) and every pass
// of rows reads them there. (The other paths sum in other orders by row count: the block
// buffer's dequantized bf16 weights past kGemvRows, with sums over all of k.) The default
// model's projections, against those paths (an AVX-512 EPYC): the same time up to 9 rows,
// 1.2x at 16, 1.4x from 64 to 512: the price of the scale applied per group.
template <int terms>
void gemv_invariant(at::BFloat16* out, const at::BFloat16* x, const uint8_t* const* ps,
                    const at::BFloat16* const* szs, int64_t m, int64_t n, int64_t n_out,
                    int64_t k, int64_t group) {
  constexpr int64_t R = kGemvRows[terms];
  const int64_t groups = k / group, blocks = (n_out + 63) / 64;
  float* xsum = reinterpret_cast<float*>(thread_bytes<3>(m * groups * sizeof(float)));
  for (int64_t r = 0; r < m; ++r)  // (gemv_terms' loop, row by row)
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.f;
      for (int64_t c = g * group; c < (g + 1) * group; ++c) sum += static_cast<float>(x[r * k + c]);
      xsum[r * groups + g] = sum;
    }
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    const __m512i index = gemv_index(), table = nibble_bf16_table();
    alignas(64) float acc[R * 64];
    // past one pass, the block's integers widened once for all its passes
    __m512i* words = m > R ? reinterpret_cast<__m512i*>(thread_bytes<0>(terms * k * 128)) : nullptr;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t cols = std::min<int64_t>(64, n_out - b * 64);
      if (words) gemv_widen<terms>(words, ps, k, b, index, table);
      for (int64_t m0 = 0; m0 < m; m0 += words ? kWideRows[terms] : R) {
        const int64_t rows = std::min(words ? kWideRows[terms] : R, m - m0);
        const at::BFloat16* xr = x + m0 * k;
        const float* sr = xsum + m0 * groups;
        if (words) {  // all 4 vectors of the block a pass: a row's x broadcast once per pair
          if constexpr (terms == 2) {
            if (rows == 1) gemv_block<2, 1, 4>(acc, xr, sr, ps, szs, n, k, group, b, index, table, words);
            else gemv_block<2, 2, 4>(acc, xr, sr, ps, szs, n, k, group, b, index, table, words);
          } else {
            switch (rows) {
              case 1: gemv_block<1, 1, 4>(acc, xr, sr, ps, szs, n, k, group, b, index, table, words); break;
              case 2: gemv_block<1, 2, 4>(acc, xr, sr, ps, szs, n, k, group, b, index, table, words); break;
              case 3: gemv_block<1, 3, 4>(acc, xr, sr, ps, szs, n, k, group, b, index, table, words); break;
              case 4: gemv_block<1, 4, 4>(acc, xr, sr, ps, szs, n, k, group, b, index, table, words); break;
              case 5: gemv_block<1, 5, 4>(acc, xr, sr, ps, szs, n, k, group, b, index, table, words); break;
              default: gemv_block<1, 6, 4>(acc, xr, sr, ps, szs, n, k, group, b, index, table, words); break;
            }
          }
        } else if constexpr (terms == 2) {
          if (rows == 1) gemv_pass<2, 1>(acc, xr, sr, ps, szs, n, k, group, b, index, table, nullptr);
          else gemv_pass<2, 2>(acc, xr, sr, ps, szs, n, k, group, b, index, table, nullptr);
        } else {
          switch (rows) {
            case 1: gemv_pass<1, 1>(acc, xr, sr, ps, szs, n, k, group, b, index, table, nullptr); break;
            case 2: gemv_pass<1, 2>(acc, xr, sr, ps, szs, n, k, group, b, index, table, nullptr); break;
            case 3: gemv_pass<1, 3>(acc, xr, sr, ps, szs, n, k, group, b, index, table, nullptr); break;
            case 4: gemv_pass<1, 4>(acc, xr, sr, ps, szs, n, k, group, b, index, table, nullptr); break;
            case 5: gemv_pass<1, 5>(acc, xr, sr, ps, szs, n, k, group, b, index, table, nullptr); break;
            case 6: gemv_pass<1, 6>(acc, xr, sr, ps, szs, n, k, group, b, index, table, nullptr); break;
            case 7: gemv_pass<1, 7>(acc, xr, sr, ps, szs, n, k, group, b, index, table, nullptr); break;
            default: gemv_pass<1, 8>(acc, xr, sr, ps, szs, n, k, group, b, index, table, nullptr); break;
          }
        }
        store_rows(out + m0 * n_out, n_out, b * 64, cols, acc, rows);
      }
    }
  });
}
#endif

// x W^T a block at a time: each 64-row block of W dequantized into this thread's buffer (in
// L2, VNNI order), then multiplied there by oneDNN's brgemm (AMX), GEMM_ROWS input rows a
// call, or, with `dot` (AVX512-BF16 without AMX), by vdpbf16ps, kDotRowGroup rows a pass with
// their sums in registers for all of k. The dot path against torch's int4 kernel, which
// dequantizes every 4 rows again: the default model's projections 12.8 vs 26.8 ms at 16 rows;
// against the slices (dequantize + oneDNN's bf16 matmul, bound by the same vdpbf16ps) 132 vs
// 186 at 256, 1,033 vs 1,140 at 2,048 (an AVX-512 EPYC; the model's prefill steps drew level
// past ~1,000 rows: Int4Linear.GEMM_MAX_ROWS). (32 columns at a time through L1, as the tiles
// go, with the sums in memory between them: 15.5, 154 and 1,264 ms.)
template <int terms>
void gemm_terms(at::BFloat16* out, const at::BFloat16* x, const uint8_t* const* ps,
                const at::BFloat16* const* szs, int64_t m, int64_t n, int64_t n_out, int64_t k,
                int64_t group, bool dot) {
  const int64_t blocks = (n_out + 63) / 64;
#ifdef TANDEM_DOT_GEMM
  const int64_t step = dot ? kDotRowGroup : GEMM_ROWS;
#else
  const int64_t step = GEMM_ROWS;
#endif
  // Work items are (block, pass of rows), a thread's a contiguous run of them: a block whose
  // passes two threads share is dequantized by both, and threads even out where whole blocks
  // would not (the default model's 9-block projections split 5/4 between 2 threads; the
  // model's matmuls on the dot path 15.4 -> 14.9 ms at 16 rows, 45.9 -> 43.9 at 64, 168 -> 159
  // at 256, 331 -> 315 at 512 on an AVX-512 EPYC; each output the same bits).
  const int64_t passes = (m + step - 1) / step;
  at::parallel_for(0, blocks * passes, 1, [&](int64_t begin, int64_t end) {
    auto* w = reinterpret_cast<at::BFloat16*>(thread_bytes<0>(k * 64 * sizeof(at::BFloat16)));
    alignas(64) float acc[GEMM_ROWS * 64];
    for (int64_t item = begin, held = -1; item < end; ++item) {
      const int64_t b = item / passes, m0 = (item % passes) * step;
      if (b != held) dequant_block_vnni<terms>(w, ps, szs, n, k, group, held = b);
      const int64_t cols = std::min<int64_t>(64, n_out - b * 64);
      const int64_t rows = std::min(step, m - m0);
#ifdef TANDEM_DOT_GEMM
      if (dot) {
        Lookahead ahead(ps, terms, k, b, blocks, item % passes, passes, k / 2 / kLookaheadEvery);
        dot_rows(acc, x + m0 * k, k, w, rows, ahead);
      }
      else
#endif
        at::native::cpublas::brgemm(rows, 64, k, k, 64, 64, false, x + m0 * k, w, acc);
      store_rows(out + m0 * n_out, n_out, b * 64, cols, acc, rows);
    }
    if (!dot) at::native::cpublas::brgemm_release();
  });
}

#if defined(TANDEM_DOT_GEMM) && defined(__AVX512VNNI__)
#define TANDEM_INT8_ACTIVATIONS 1
// x W^T with x's rows quantized to int8, as llama.cpp computes GGUF's 4-bit blocks against its
// Q8_1 activations: each row's 32-column blocks x ~ s a, s = absmax / 127, a = round(x / s)
// in [-127, 127], with the block's sum taken as s sum(a) (the quantized sum, not the exact
// one: the zero point's term then errs with the weights' own sign, centred, instead of
// with q's, all positive; random rows' relative error 1.3% -> 0.6%, bf16 rows' 0.3%). Per
// output, per block: scale s_w s_x sum(q a) + zero_w s_x sum(a), sum(q a) by vpdpbusd (q the
// unsigned byte, a the signed one). The default model's matmuls on an AVX-512 EPYC against
// the bf16 dot path (both with the lookahead): 11.6 vs 15.7 ms at 16 rows, 32.3 vs 44.4 at
// 64, 120 vs 160 at 256; real text's perplexity 6.614 -> 6.609 (benchmarks/quant_linear.py,
// benchmarks/kv_perplexity.py). About a fifth of the time is the per-block float work (the
// convert, the multiply and the two fused multiply-adds a row a block: without the multiply
// and the zero's term, 99.8 -> 78.8 ms at 256 rows; wrong numbers, measured to know). Keeping
// the float sums in memory to run all 4 vectors of a block a pass was 1.4-1.9x slower.

// Columns a block of activations: GGUF's block, and the int32 sums' span.
constexpr int64_t kActBlock = 32;
// Input rows a pass: each row's 2 int32 and 2 float accumulators a half-block, 28 zmm at 6.
constexpr int64_t kInt8RowGroup = 6;

// Rows of x (bf16 [m, k]) into q (int8 [m, k]), scale and sum ([m, k / 32] floats).
void quantize_activations(int8_t* q, float* scale, float* sum, const at::BFloat16* x, int64_t m,
                          int64_t k) {
  const int64_t nb = k / kActBlock;
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t first = r * k + b * kActBlock;
        __m512 v[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + first + 16 * h));
          v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        const float s = amax / 127.f;
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        __m512i total = _mm512_setzero_si512();
        for (int h = 0; h < 2; ++h) {
          const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], inv));  // to nearest even
          total = _mm512_add_epi32(total, a);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q + first + 16 * h), _mm512_cvtsepi32_epi8(a));
        }
        scale[r * nb + b] = s;
        sum[r * nb + b] = s * static_cast<float>(_mm512_reduce_add_epi32(total));
      }
  });
}

// vpermi2b's index for 16 rows (from `row`) of 4 consecutive columns: byte 4j + t of the
// result is row + j of column t, out of the columns' 4 x 32 packed bytes.
inline __m512i quad_index(int row) {
  alignas(64) uint8_t idx[64];
  for (int j = 0; j < 16; ++j)
    for (int t = 0; t < 4; ++t) idx[4 * j + t] = t * 32 + row + j;
  return _mm512_load_si512(idx);
}

// Block b of W into o, [k / 4][64 rows][4 columns] bytes (vpdpbusd's order: a dword lane
// holds a row's 4 consecutive columns), and its parameters into params, [k / 32][64 scales,
// 64 zeros] floats, w = byte * scale + zero, repeated for each 32 columns of a larger group.
// One term: the byte is q. Two (GGUF's Q8_0, Q5_0, Q5_1, Q5_K; the 8-bit head of HF int4/8):
// the byte is 16 q_hi + q_lo, which is exact where the high term's scale is 16 times the low
// one's, as those formats' terms are (Int4Linear.use_int8_activations checks it): then
// (q_hi - 8) 16 s + z_hi + (q_lo - 8) s + z_lo = (16 q_hi + q_lo) s + (z_hi - 128 s + z_lo - 8 s).
template <int terms>
void block_bytes(uint8_t* o, float* params, const uint8_t* const* ps,
                 const at::BFloat16* const* szs, int64_t n, int64_t k, int64_t group, int64_t b) {
  for (int64_t g = 0; g < k / group; ++g) {
    __m512 vs[terms][4], vz[4];
    load_params<terms>(vs, vz, szs, n, b, g);
    for (int64_t a = g * group / kActBlock; a < (g + 1) * group / kActBlock; ++a)
      for (int v = 0; v < 4; ++v) {
        _mm512_store_ps(params + a * 128 + 16 * v, vs[terms - 1][v]);
        _mm512_store_ps(params + a * 128 + 64 + 16 * v, vz[v]);
      }
  }
  const __m512i first = quad_index(0), second = quad_index(16);
  const __m512i low4 = _mm512_set1_epi8(15), high4 = _mm512_set1_epi8(static_cast<char>(0xf0));
  for (int64_t c = 0; c < k; c += 4) {  // a byte holds row j low, row j + 32 high
    __m512i r0[terms], r16[terms];
    for (int t = 0; t < terms; ++t) {
      const uint8_t* src = ps[t] + (b * k + c) * 32;
      __builtin_prefetch(src + kPrefetchBytes);
      __builtin_prefetch(src + kPrefetchBytes + 64);
      const __m512i lo = _mm512_loadu_si512(src), hi = _mm512_loadu_si512(src + 64);
      r0[t] = _mm512_permutex2var_epi8(lo, first, hi);    // rows 0-15 | 32-47
      r16[t] = _mm512_permutex2var_epi8(lo, second, hi);  // rows 16-31 | 48-63
    }
    uint8_t* dst = o + c * 64;
    for (int h = 0; h < 2; ++h) {
      const __m512i x = h ? r16[0] : r0[0];
      __m512i low, high;  // rows 16h .. 16h + 15, and 32 rows on
      if constexpr (terms == 1) {
        low = _mm512_and_si512(x, low4);
        high = _mm512_and_si512(_mm512_srli_epi16(x, 4), low4);
      } else {
        const __m512i y = h ? r16[1] : r0[1];
        low = _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi16(x, 4), high4), _mm512_and_si512(y, low4));
        high = _mm512_or_si512(_mm512_and_si512(x, high4), _mm512_and_si512(_mm512_srli_epi16(y, 4), low4));
      }
      _mm512_store_si512(dst + 64 * h, low);
      _mm512_store_si512(dst + 128 + 64 * h, high);
    }
  }
}

// acc[R][64] = x's R quantized rows . the block's bytes wb, half a block (32 rows of W) at a
// time with the sums in registers: int32 over each 32 columns, then float.
template <int R>
inline void int8_block_rows(float* acc, const int8_t* xq, const float* xs, const float* xsum,
                            int64_t k, const uint8_t* wb, const float* params, Lookahead& ahead) {
  const int64_t nb = k / kActBlock;
  for (int h = 0; h < 2; ++h) {
    __m512 f[R][2];
    for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm512_setzero_ps();
    for (int64_t a = 0; a < nb; ++a) {
      ahead.step();
      __m512i s[R][2];
      for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_setzero_si512();
      for (int p = 0; p < kActBlock / 4; ++p) {
        const uint8_t* wp = wb + (a * (kActBlock / 4) + p) * 256 + h * 128;
        const __m512i w0 = _mm512_load_si512(wp), w1 = _mm512_load_si512(wp + 64);
        for (int r = 0; r < R; ++r) {
          int32_t quad;
          std::memcpy(&quad, xq + r * k + a * kActBlock + 4 * p, sizeof(quad));
          const __m512i xr = _mm512_set1_epi32(quad);
          s[r][0] = _mm512_dpbusd_epi32(s[r][0], w0, xr);
          s[r][1] = _mm512_dpbusd_epi32(s[r][1], w1, xr);
        }
      }
      const float* pa = params + a * 128 + 32 * h;
      const __m512 sc0 = _mm512_load_ps(pa), sc1 = _mm512_load_ps(pa + 16);
      const __m512 z0 = _mm512_load_ps(pa + 64), z1 = _mm512_load_ps(pa + 80);
      for (int r = 0; r < R; ++r) {
        const __m512 sx = _mm512_set1_ps(xs[r * nb + a]), sum = _mm512_set1_ps(xsum[r * nb + a]);
        f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][0]), _mm512_mul_ps(sc0, sx), _mm512_fmadd_ps(z0, sum, f[r][0]));
        f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][1]), _mm512_mul_ps(sc1, sx), _mm512_fmadd_ps(z1, sum, f[r][1]));
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_store_ps(acc + r * 64 + 32 * h, f[r][0]);
      _mm512_store_ps(acc + r * 64 + 32 * h + 16, f[r][1]);
    }
  }
}

inline void int8_rows(float* acc, const int8_t* xq, const float* xs, const float* xsum, int64_t k,
                      const uint8_t* wb, const float* params, int64_t rows, Lookahead& ahead) {
  switch (rows) {
    case 1: return int8_block_rows<1>(acc, xq, xs, xsum, k, wb, params, ahead);
    case 2: return int8_block_rows<2>(acc, xq, xs, xsum, k, wb, params, ahead);
    case 3: return int8_block_rows<3>(acc, xq, xs, xsum, k, wb, params, ahead);
    case 4: return int8_block_rows<4>(acc, xq, xs, xsum, k, wb, params, ahead);
    case 5: return int8_block_rows<5>(acc, xq, xs, xsum, k, wb, params, ahead);
    default: return int8_block_rows<6>(acc, xq, xs, xsum, k, wb, params, ahead);
  }
}

// gemm_terms with x's rows quantized to int8 first: the same (block, pass of rows) items,
// each block's weights widened to bytes (not to bf16) in this thread's buffer.
template <int terms>
void gemm_int8_activations(at::BFloat16* out, const at::BFloat16* x, const uint8_t* const* ps,
                           const at::BFloat16* const* szs, int64_t m, int64_t n, int64_t n_out,
                           int64_t k, int64_t group) {
  const int64_t nb = k / kActBlock, blocks = (n_out + 63) / 64, step = kInt8RowGroup;
  // the caller's buffers (fresh vectors here: memset 1.6% of an offline run's samples, 0.07%
  // with these)
  int8_t* xq = reinterpret_cast<int8_t*>(thread_bytes<2>(m * k));
  float* xs = reinterpret_cast<float*>(thread_bytes<3>(m * nb * sizeof(float)));
  float* xsum = reinterpret_cast<float*>(thread_bytes<4>(m * nb * sizeof(float)));
  quantize_activations(xq, xs, xsum, x, m, k);
  const int64_t passes = (m + step - 1) / step;
  at::parallel_for(0, blocks * passes, 1, [&](int64_t begin, int64_t end) {
    uint8_t* w = thread_bytes<0>(k * 64);  // the block buffer gemm_terms' dot path uses too
    float* params = reinterpret_cast<float*>(thread_bytes<1>(nb * 128 * sizeof(float)));
    alignas(64) float acc[kInt8RowGroup * 64];
    for (int64_t item = begin, held = -1; item < end; ++item) {
      const int64_t b = item / passes, m0 = (item % passes) * step;
      if (b != held) block_bytes<terms>(w, params, ps, szs, n, k, group, held = b);
      const int64_t rows = std::min(step, m - m0);
      Lookahead ahead(ps, terms, k, b, blocks, item % passes, passes, 2 * nb);
      int8_rows(acc, xq + m0 * k, xs + m0 * nb, xsum + m0 * nb, k, w, params, rows, ahead);
      store_rows(out + m0 * n_out, n_out, b * 64, std::min<int64_t>(64, n_out - b * 64), acc, rows);
    }
  });
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BF16__)
#define TANDEM_AMX_TILES 1
// Rows up to which gemm_terms_tiles runs a step (one tile of rows).
constexpr int64_t kTileRows = 16;

// AMX's tile configuration, as ldtilecfg reads it (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// gemm_terms for m <= kTileRows, with AMX's tile instructions in place of oneDNN's brgemm:
// each 32 columns of a block (4 KB of bf16 VNNI pairs, in L1) are dequantized and multiplied
// into four accumulator tiles at once, where the brgemm path dequantizes the whole block into
// L2 first and then makes a call that reads it back. At decode sizes the brgemm call cost as
// much as the dequantization (perf, 16 rows: 30% of a projection's samples each).
// Tiles: 0-3 the [m, 64] float accumulators, 16 columns each; 4 x's [m, 32] bf16; 5-7 W's
// [32, 16] in VNNI pairs, in turn. (int4_gemm's amx() check, oneDNN's, has asked Linux for
// the process's AMX state before any of this runs: without it the first tile op faults.)
template <int terms>
void gemm_terms_tiles(at::BFloat16* out, const at::BFloat16* x, const uint8_t* const* ps,
                      const at::BFloat16* const* szs, int64_t m, int64_t n, int64_t n_out,
                      int64_t k, int64_t group) {
  const int64_t blocks = (n_out + 63) / 64;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    // oneDNN tracks the tile configuration it last loaded on this thread: release it, so its
    // next brgemm call loads its own again
    at::native::cpublas::brgemm_release();
    TileConfig cfg;
    for (int t = 0; t < 5; ++t) cfg.rows[t] = static_cast<uint8_t>(m), cfg.colsb[t] = 64;
    for (int t = 5; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    const __m512i order = interleave_pairs_index();
    const __m512 table = nibble_table();
    alignas(64) at::BFloat16 w[2][32 * 64];
    alignas(64) float acc[kTileRows * 64];
    const int64_t x_stride = k * static_cast<int64_t>(sizeof(at::BFloat16));
    for (int64_t b = begin; b < end; ++b) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t g = 0; g < k / group; ++g) {
        __m512 vs[terms][4], vz[4], ls[terms][8], lz[8];
        load_params<terms>(vs, vz, szs, n, b, g);
        lane_params<terms>(ls, lz, vs, vz);
        for (int64_t c0 = g * group; c0 < (g + 1) * group; c0 += 32) {
          at::BFloat16* wc = w[(c0 / 32) % 2];  // two buffers: the next chunk's stores need not
                                                 // wait for this one's tile loads
          for (int64_t c = 0; c < 32; c += 2)
            dequant_pair<terms>(wc + c * 64, ps, k, b, c0 + c, order, table, ls, lz);
          _tile_loadd(4, x + c0, x_stride);
          _tile_loadd(5, wc, 256);
          _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(6, wc + 32, 256);
          _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(7, wc + 64, 256);
          _tile_dpbf16ps(2, 4, 7);
          _tile_loadd(5, wc + 96, 256);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      _tile_stored(0, acc, 256);
      _tile_stored(1, acc + 16, 256);
      _tile_stored(2, acc + 32, 256);
      _tile_stored(3, acc + 48, 256);
      store_rows(out, n_out, b * 64, std::min<int64_t>(64, n_out - b * 64), acc, m);
    }
    _tile_release();
  });
}
#endif

// One or two int4 terms of one weight, checked, as the kernels take them.
struct Terms {
  int64_t n, k, count;  // W's padded rows, its columns, its terms
  const uint8_t* ps[2];
  const at::BFloat16* szs[2];
};

Terms checked_terms(const std::vector<at::Tensor>& packed,
                    const std::vector<at::Tensor>& scales_zeros, int64_t group) {
  TORCH_CHECK(!packed.empty() && packed.size() <= 2 && packed.size() == scales_zeros.size(),
              "one or two terms, one scales_zeros a term");
  Terms terms{scales_zeros[0].size(1), scales_zeros[0].size(0) * group,
              static_cast<int64_t>(packed.size()), {}, {}};
  const int64_t n = terms.n, k = terms.k;
  for (size_t t = 0; t < packed.size(); ++t) {
    TORCH_CHECK(packed[t].is_contiguous() && packed[t].scalar_type() == at::kByte &&
                    packed[t].numel() == n * k / 2 && n % 64 == 0,
                "packed: uint8 [n, k / 2], n % 64 == 0");
    TORCH_CHECK(scales_zeros[t].is_contiguous() && scales_zeros[t].scalar_type() == at::kBFloat16 &&
                    scales_zeros[t].size(1) == n && scales_zeros[t].size(0) * group == k,
                "scales_zeros: contiguous bfloat16 [k / group, n, 2], alike for every term");
    terms.ps[t] = packed[t].data_ptr<uint8_t>();
    terms.szs[t] = scales_zeros[t].data_ptr<at::BFloat16>();
  }
  return terms;
}

void dequant_int4_t(at::Tensor& out, const std::vector<at::Tensor>& packed,
                    const std::vector<at::Tensor>& scales_zeros, int64_t group, int64_t row_begin,
                    int64_t row_end) {
  const Terms w = checked_terms(packed, scales_zeros, group);
  const int64_t rows = row_end - row_begin;
  TORCH_CHECK(row_begin % 64 == 0 && rows % 64 == 0 && 0 <= row_begin && row_end <= w.n,
              "rows: a range of whole 64-row blocks");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kBFloat16 && out.numel() >= w.k * rows,
              "out: contiguous bfloat16, room for [k, rows]");
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  if (w.count == 1) dequant_terms<1>(o, w.ps, w.szs, w.n, w.k, group, row_begin, rows);
  else dequant_terms<2>(o, w.ps, w.szs, w.n, w.k, group, row_begin, rows);
}

void dequant_int8(at::Tensor& out, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(q.is_contiguous() && q.scalar_type() == at::kChar && q.dim() == 2, "q: int8 [n, k]");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kBFloat16, "scales: bf16");
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(scales.numel() == n, "scales: one per row");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kBFloat16 && out.numel() >= n * k,
              "out: contiguous bfloat16, room for [n, k]");
  const int8_t* src = q.data_ptr<int8_t>();
  const at::BFloat16* s = scales.data_ptr<at::BFloat16>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float scale = static_cast<float>(s[r]);
      for (int64_t c = 0; c < k; ++c) o[r * k + c] = static_cast<float>(src[r * k + c]) * scale;
    }
  });
}

// TANDEM_NO_AMX: built below the CPU's level (TANDEM_CPU_ISA=avx512_bf16 on an AMX CPU).
bool amx() {
#ifdef TANDEM_NO_AMX
  return false;
#else
  return at::native::cpublas::could_pack(at::kBFloat16);
#endif
}

// Which int4_gemm runs here: "amx" (tiles up to 16 rows, oneDNN's brgemm past them), "dot"
// (AVX512-BF16's vdpbf16ps, no AMX), or "" (none: int4_gemm refuses).
std::string gemm_path() {
  if (amx()) return "amx";
#ifdef TANDEM_DOT_GEMM
  return "dot";
#else
  return "";
#endif
}

// Rows up to which int4_gemm multiplies a weight of `terms` int4 terms straight from its
// packed bytes here (gemv_terms, bf16 activations whatever int8_activations says); 0: never.
int64_t gemv_rows(int64_t terms) {
#ifdef TANDEM_DOT_GEMM
  return gemm_path() == "dot" && (terms == 1 || terms == 2) ? kGemvRows[terms] : 0;
#else
  return 0;
#endif
}

// Whether int4_gemm takes rows_invariant here: its few-row path is built (AVX512-BF16 and
// VBMI), which on AMX CPUs then runs every step instead of the tiles.
bool rows_invariant_here() {
#ifdef TANDEM_DOT_GEMM
  return true;
#else
  return false;
#endif
}

// Whether int4_gemm takes int8_activations here: the dot path, on a CPU with AVX512-VNNI.
// (With AMX its bf16 tiles are the faster path; without AVX512-BF16 there is no int4_gemm.)
bool int8_activations_here() {
#ifdef TANDEM_INT8_ACTIVATIONS
  return gemm_path() == "dot";
#else
  return false;
#endif
}

void int4_gemm(at::Tensor& out, const at::Tensor& x, const std::vector<at::Tensor>& packed,
               const std::vector<at::Tensor>& scales_zeros, int64_t group,
               bool int8_activations = false, bool rows_invariant = false) {
  const std::string path = gemm_path();
  TORCH_CHECK(!path.empty(), "int4_gemm needs AMX or AVX512-BF16 (gemm_path() is empty here)");
  const Terms w = checked_terms(packed, scales_zeros, group);
  TORCH_CHECK(group % 2 == 0, "group: even");
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == w.k,
              "x: contiguous bfloat16 [m, k]");
  const int64_t m = x.size(0), n_out = out.size(1);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kBFloat16 && out.dim() == 2 &&
                  out.size(0) == m && n_out <= w.n,
              "out: contiguous bfloat16 [m, n_out], n_out <= n");
  if (m == 0) return;  // (a tile configuration of no rows is invalid: the CPU faults on it)
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  const bool dot = path == "dot";
  TORCH_CHECK(!rows_invariant || rows_invariant_here(), "rows_invariant needs AVX512-BF16 and VBMI");
#ifdef TANDEM_DOT_GEMM
  // rows_invariant: one order of sums for a row whatever the step's rows (int8 activations
  // have it on their own path: a row's quantization and int32 sums are its own)
  if (rows_invariant && !int8_activations) {
    if (w.count == 1) gemv_invariant<1>(o, xp, w.ps, w.szs, m, w.n, n_out, w.k, group);
    else gemv_invariant<2>(o, xp, w.ps, w.szs, m, w.n, n_out, w.k, group);
    return;
  }
  // (int8 activations too: at these rows the bytes' conversion, not the multiplies, is the
  // cost, and bf16 activations lose nothing)
  if (dot && m <= kGemvRows[w.count] && !rows_invariant) {
    if (w.count == 1) gemv<1>(o, xp, w.ps, w.szs, m, w.n, n_out, w.k, group);
    else gemv<2>(o, xp, w.ps, w.szs, m, w.n, n_out, w.k, group);
    return;
  }
#endif
  if (int8_activations) {
    TORCH_CHECK(int8_activations_here(), "int8_activations needs AVX512-VNNI and the dot path");
    TORCH_CHECK(group % 32 == 0, "int8_activations: groups of a multiple of 32 columns");
#ifdef TANDEM_INT8_ACTIVATIONS
    if (w.count == 1) return gemm_int8_activations<1>(o, xp, w.ps, w.szs, m, w.n, n_out, w.k, group);
    return gemm_int8_activations<2>(o, xp, w.ps, w.szs, m, w.n, n_out, w.k, group);
#endif
  }
#ifdef TANDEM_AMX_TILES
  if (!dot && m <= kTileRows && group % 32 == 0) {
    if (w.count == 1) gemm_terms_tiles<1>(o, xp, w.ps, w.szs, m, w.n, n_out, w.k, group);
    else gemm_terms_tiles<2>(o, xp, w.ps, w.szs, m, w.n, n_out, w.k, group);
    return;
  }
#endif
  if (w.count == 1) gemm_terms<1>(o, xp, w.ps, w.szs, m, w.n, n_out, w.k, group, dot);
  else gemm_terms<2>(o, xp, w.ps, w.szs, m, w.n, n_out, w.k, group, dot);
}

}  // namespace

#ifndef TANDEM_DEQUANT_NO_MODULE  // fused.cpp includes this file for its decode stack
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dequant_int4_t", &dequant_int4_t, "int4 (torch CPU layout) -> W^T bfloat16, into out");
  m.def("dequant_int8", &dequant_int8, "int8 per-row -> W bfloat16, into out");
  m.def("amx", &amx, "whether the CPU has AMX");
  m.def("gemm_path", &gemm_path, "which int4_gemm runs here: amx, dot, or none ('')");
  m.def("int4_gemm", &int4_gemm, "x W^T for int4 (torch CPU layout) W, into out: AMX or AVX512-BF16",
        py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("scales_zeros"), py::arg("group"),
        py::arg("int8_activations") = false, py::arg("rows_invariant") = false);
  m.def("rows_invariant_here", &rows_invariant_here,
        "whether int4_gemm takes rows_invariant here (AVX512-BF16, AMX or not)");
  m.def("gemv_rows", &gemv_rows, "rows up to which int4_gemm reads W's packed bytes directly");
  m.def("int8_activations_here", &int8_activations_here,
        "whether int4_gemm takes int8_activations here (AVX512-VNNI, the dot path)");
}
#endif

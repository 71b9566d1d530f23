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

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

#ifdef __AVX512F__
// 16 floats to bfloat16, rounded to nearest even as c10::BFloat16 does (finite inputs).
inline void store_bf16(at::BFloat16* dst, __m512 x) {
#ifdef __AVX512BF16__
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(x));
#else
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
#endif
}

#endif

// The sum of `terms` int4 terms (GGUF's Q8_0 is two), rows [row_begin, row_begin + rows).
template <int terms>
void dequant_terms(at::BFloat16* o, const uint8_t* const* ps, const at::BFloat16* const* szs,
                   int64_t n, int64_t k, int64_t group, int64_t row_begin, int64_t rows) {
  const int64_t blocks = rows / 64, groups = k / group, first = row_begin / 64;
  at::parallel_for(0, blocks * groups, 1, [&](int64_t begin, int64_t end) {
    float scale[terms][64], zero[64];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / groups + first, g = i % groups;
      for (int j = 0; j < 64; ++j) zero[j] = 0.f;
      for (int t = 0; t < terms; ++t) {  // (q - 8) * scale + zero = q * scale + (zero - 8 scale)
        const at::BFloat16* s = szs[t] + (g * n + b * 64) * 2;
        for (int j = 0; j < 64; ++j) {
          scale[t][j] = static_cast<float>(s[2 * j]);
          zero[j] += static_cast<float>(s[2 * j + 1]) - 8.f * scale[t][j];
        }
      }
#ifdef __AVX512F__
      __m512 vs[terms][4], vz[4];
      for (int v = 0; v < 4; ++v) {
        for (int t = 0; t < terms; ++t) vs[t][v] = _mm512_loadu_ps(scale[t] + 16 * v);
        vz[v] = _mm512_loadu_ps(zero + 16 * v);
      }
      const __m256i low4 = _mm256_set1_epi8(15);
      for (int64_t c = g * group; c < (g + 1) * group; ++c) {
        __m512 w[4] = {vz[0], vz[1], vz[2], vz[3]};
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
        at::BFloat16* dst = o + c * rows + (b - first) * 64;
        for (int v = 0; v < 4; ++v) store_bf16(dst + 16 * v, w[v]);
      }
#else
      for (int64_t c = g * group; c < (g + 1) * group; ++c) {
        float w[64];
        for (int j = 0; j < 64; ++j) w[j] = zero[j];
        for (int t = 0; t < terms; ++t) {
          const uint8_t* src = ps[t] + (b * k + c) * 32;
          for (int j = 0; j < 32; ++j) {
            w[j] += static_cast<float>(src[j] & 15) * scale[t][j];
            w[j + 32] += static_cast<float>(src[j] >> 4) * scale[t][j + 32];
          }
        }
        at::BFloat16* dst = o + c * rows + (b - first) * 64;
        for (int j = 0; j < 64; ++j) dst[j] = w[j];
      }
#endif
    }
  });
}

void dequant_int4_t(at::Tensor& out, const std::vector<at::Tensor>& packed,
                    const std::vector<at::Tensor>& scales_zeros, int64_t group, int64_t row_begin,
                    int64_t row_end) {
  TORCH_CHECK(!packed.empty() && packed.size() == scales_zeros.size(), "one scales_zeros a term");
  const int64_t n = scales_zeros[0].size(1), k = scales_zeros[0].size(0) * group;
  const int64_t rows = row_end - row_begin;
  for (size_t t = 0; t < packed.size(); ++t) {
    TORCH_CHECK(packed[t].is_contiguous() && packed[t].scalar_type() == at::kByte, "packed: uint8");
    TORCH_CHECK(scales_zeros[t].is_contiguous() && scales_zeros[t].scalar_type() == at::kBFloat16 &&
                    scales_zeros[t].size(1) == n && scales_zeros[t].size(0) * group == k,
                "scales_zeros: contiguous bfloat16 [k / group, n, 2], alike for every term");
    TORCH_CHECK(n % 64 == 0 && packed[t].numel() == n * k / 2, "packed: [n, k / 2], n % 64 == 0");
  }
  TORCH_CHECK(row_begin % 64 == 0 && rows % 64 == 0 && 0 <= row_begin && row_end <= n,
              "rows: a range of whole 64-row blocks");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kBFloat16 && out.numel() >= k * rows,
              "out: contiguous bfloat16, room for [k, rows]");
  TORCH_CHECK(packed.size() <= 2, "at most two terms");
  const uint8_t* ps[2];
  const at::BFloat16* szs[2];
  for (size_t t = 0; t < packed.size(); ++t) {
    ps[t] = packed[t].data_ptr<uint8_t>();
    szs[t] = scales_zeros[t].data_ptr<at::BFloat16>();
  }
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  if (packed.size() == 1) dequant_terms<1>(o, ps, szs, n, k, group, row_begin, rows);
  else dequant_terms<2>(o, ps, szs, n, k, group, row_begin, rows);
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dequant_int4_t", &dequant_int4_t, "int4 (torch CPU layout) -> W^T bfloat16, into out");
  m.def("dequant_int8", &dequant_int8, "int8 per-row -> W bfloat16, into out");
}

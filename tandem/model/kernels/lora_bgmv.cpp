// Batched gather matrix-vector LoRA update (BGMV, as Punica's): for each token t whose slot
// s = slots[t] is not -1,
//   h      = A[s] x[t]                       A: [slots, shards * R, in]
//   y[t]  += concat_i(h[i*R : (i+1)*R] Bt_i[s])   Bt_i: [slots, R, out_i], y: [T, sum out_i]
// reading each token's own adapter in place: no gathered copies, no scatter. Weights stay in
// the model's dtype (bf16 halves the bytes read, which is what a step of many adapters waits
// on); everything accumulates in float32. Vectorized with at::vec::Vectorized<float>.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/csrc/utils/pybind.h>

#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

template <typename T>
inline Vec widen(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float(p, out);
    return out;
  }
}

template <typename T>
void run(T* y, const T* x, const T* a, const std::vector<const T*>& bt,
         const std::vector<int64_t>& outs, const int64_t* slots, int64_t tokens, int64_t in,
         int64_t rank, int64_t y_stride, int64_t x_stride) {
  const int64_t shards = static_cast<int64_t>(outs.size());
  const int64_t rows = shards * rank;
  int64_t widest = 0;
  for (int64_t o : outs) widest = std::max(widest, o);
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(rows), acc(widest + kLanes);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = slots[t];
      if (s < 0) continue;
      const T* xt = x + t * x_stride;
      const T* as = a + s * rows * in;
      for (int64_t r = 0; r < rows; ++r) {
        const T* ar = as + r * in;
        Vec sum(0.f);
        int64_t i = 0;
        for (; i + kLanes <= in; i += kLanes) sum = at::vec::fmadd(widen(ar + i), widen(xt + i), sum);
        float tail = 0.f;
        for (; i < in; ++i) tail += to_f(ar[i]) * to_f(xt[i]);
        h[r] = at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return p + q; }, sum) + tail;
      }
      T* yt = y + t * y_stride;
      int64_t offset = 0;
      for (int64_t k = 0; k < shards; ++k) {
        const int64_t out = outs[k];
        const T* bs = bt[k] + s * rank * out;
        std::fill(acc.begin(), acc.begin() + out, 0.f);
        for (int64_t r = 0; r < rank; ++r) {
          const float hr = h[k * rank + r];
          if (hr == 0.f) continue;  // a zero rank (an adapter of lower rank, or no weights)
          const Vec hv(hr);
          const T* br = bs + r * out;
          int64_t c = 0;
          for (; c + kLanes <= out; c += kLanes) {
            at::vec::fmadd(widen(br + c), hv, Vec::loadu(acc.data() + c)).store(acc.data() + c);
          }
          for (; c < out; ++c) acc[c] += hr * to_f(br[c]);
        }
        for (int64_t c = 0; c < out; ++c) yt[offset + c] = static_cast<T>(to_f(yt[offset + c]) + acc[c]);
        offset += out;
      }
    }
  });
}

void lora_bgmv(at::Tensor y, const at::Tensor& x, const at::Tensor& a,
               const std::vector<at::Tensor>& bt, const at::Tensor& slots) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && a.dim() == 3, "y, x: [T, d]; a: [slots, rows, in]");
  TORCH_CHECK(y.stride(1) == 1 && x.stride(1) == 1 && a.is_contiguous(), "rows must be contiguous");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && x.scalar_type() == a.scalar_type(),
              "y, x and a must share a dtype");
  const at::Tensor idx = slots.to(at::kLong).contiguous();
  const int64_t tokens = x.size(0), in = x.size(1), rank = bt.at(0).size(1);
  TORCH_CHECK(idx.numel() == tokens && y.size(0) == tokens && a.size(2) == in, "shapes differ");
  std::vector<int64_t> outs;
  int64_t total = 0;
  for (const auto& b : bt) {
    TORCH_CHECK(b.is_contiguous() && b.scalar_type() == a.scalar_type() && b.size(1) == rank,
                "each bt: contiguous [slots, R, out] in a's dtype");
    outs.push_back(b.size(2));
    total += b.size(2);
  }
  TORCH_CHECK(total == y.size(1) && a.size(1) == rank * static_cast<int64_t>(bt.size()),
              "y's width must be the shards' outputs, a's rows shards * R");
  const auto go = [&](auto zero) {
    using T = decltype(zero);
    std::vector<const T*> bps;
    for (const auto& b : bt) bps.push_back(b.data_ptr<T>());
    run<T>(y.data_ptr<T>(), x.data_ptr<T>(), a.data_ptr<T>(), bps, outs, idx.data_ptr<int64_t>(),
           tokens, in, rank, y.stride(0), x.stride(0));
  };
  switch (x.scalar_type()) {
    case at::kFloat: go(float{}); break;
    case at::kBFloat16: go(at::BFloat16{}); break;
    default: TORCH_CHECK(false, "float32 or bfloat16 only, got ", x.scalar_type());
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_bgmv", &lora_bgmv, "Per-token LoRA update from adapter slots (CPU)",
        py::call_guard<py::gil_scoped_release>());
}

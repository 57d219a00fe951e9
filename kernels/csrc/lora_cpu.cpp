// Multi-LoRA shrink and expand for CPU, fp32: each token may use a different adapter slot.
//
// The torch reference groups tokens by slot and runs two small GEMMs per adapter present in a step:
// with many adapters mixed in a decode batch that is hundreds of tiny ops per layer, dominated by
// dispatch overhead. Here the tokens are walked in slot order (the caller passes that order), so
// consecutive tokens reuse their adapter's rows from cache, each adapter's rows are read at its own
// rank (not the slot table's padded one), and there is no per-adapter op at all.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace

// h[t, :rank[s]] = x[t] @ a[s, :rank[s]].T for the tokens in `order` (slot s = slots[t] >= 0); the
// other entries of h are left as the caller made them (zeros).
void lora_shrink_cpu(torch::Tensor x, torch::Tensor a, torch::Tensor slots, torch::Tensor order, torch::Tensor ranks,
                     torch::Tensor h) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && a.dtype() == torch::kFloat32 && h.dtype() == torch::kFloat32,
              "fp32 only");
  TORCH_CHECK(x.stride(1) == 1 && a.is_contiguous() && h.is_contiguous(), "row-major x, contiguous a and h");
  const int64_t in = x.size(1), max_rank = a.size(1), n = order.size(0);
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  const int32_t* sp = slots.data_ptr<int32_t>();
  const int64_t* op = order.data_ptr<int64_t>();
  const int32_t* rp = ranks.data_ptr<int32_t>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = op[i];
      const int32_t s = sp[t];
      const float* xt = xp + t * xs;
      const float* as = ap + (int64_t)s * max_rank * in;
      for (int32_t r = 0; r < rp[s]; ++r) hp[t * max_rank + r] = dot(as + r * in, xt, in);
    }
  });
}

// y[t, o] += scale[s] * h[t, :rank[s]] . b[s, o, :rank[s]] for the tokens in `order`; y may be a
// column slice (row stride honoured, unit column stride).
void lora_expand_cpu(torch::Tensor y, torch::Tensor h, torch::Tensor b, torch::Tensor scales, torch::Tensor slots,
                     torch::Tensor order, torch::Tensor ranks) {
  TORCH_CHECK(y.dtype() == torch::kFloat32 && h.dtype() == torch::kFloat32 && b.dtype() == torch::kFloat32,
              "fp32 only");
  TORCH_CHECK(y.stride(1) == 1 && h.is_contiguous() && b.is_contiguous() && scales.is_contiguous(),
              "unit column stride for y; contiguous h, b and scales");
  const int64_t out = y.size(1), max_rank = b.size(2), n = order.size(0);
  float* yp = y.data_ptr<float>();
  const float* hp = h.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  const float* scp = scales.data_ptr<float>();
  const int32_t* sp = slots.data_ptr<int32_t>();
  const int64_t* op = order.data_ptr<int64_t>();
  const int32_t* rp = ranks.data_ptr<int32_t>();
  const int64_t ys = y.stride(0);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = op[i];
      const int32_t s = sp[t];
      const int32_t rank = rp[s];
      const float* ht = hp + t * max_rank;
      const float* bs = bp + (int64_t)s * out * max_rank;
      const float scale = scp[s];
      float* yt = yp + t * ys;
      for (int64_t o = 0; o < out; ++o) yt[o] += scale * dot(ht, bs + o * max_rank, rank);
    }
  });
}

// The elementwise work of a decoder layer on CPU, fp32: residual add + RMSNorm, SiLU-and-mul, rotary.
//
// The torch references spell each of these as 4-8 small ops (pow, mean, rsqrt, mul, cat, ...). At
// decode batch sizes every op is a few microseconds of dispatch and a pass over a small tensor, and a
// step runs about 400 of them: some 8% of a decode step on the 2-core machine (docs/adr/0003). One
// pass per token here, parallel over tokens; the math is the reference's, in the same order where it
// matters (the sum of squares accumulates in double, then rounds once).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

// out[t] = weight * norm(x[t] + residual[t]) and residual_out[t] = x[t] + residual[t]; without a
// residual (empty tensors), out[t] = weight * norm(x[t]). Inputs are never modified (the reference's
// contract). All tensors fp32 with contiguous rows.
void rms_norm_cpu(torch::Tensor x, torch::Tensor weight, double eps, torch::Tensor residual,
                  torch::Tensor residual_out, torch::Tensor out) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && weight.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32,
              "fp32 only");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && out.is_contiguous(), "contiguous tensors");
  const bool add = residual.numel() > 0;
  TORCH_CHECK(!add || (residual.dtype() == torch::kFloat32 && residual.is_contiguous() &&
                       residual_out.dtype() == torch::kFloat32 && residual_out.is_contiguous()),
              "fp32 contiguous residual and residual_out");
  const int64_t d = x.size(-1), n = x.numel() / d;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* rp = add ? residual.data_ptr<float>() : nullptr;
  float* rop = add ? residual_out.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xt = xp + t * d;
      float* ot = op + t * d;
      const float* h = xt;
      if (add) {
        const float* rt = rp + t * d;
        float* sum = rop + t * d;
        for (int64_t i = 0; i < d; ++i) sum[i] = xt[i] + rt[i];
        h = sum;
      }
      double ss = 0.0;
      for (int64_t i = 0; i < d; ++i) ss += (double)h[i] * (double)h[i];
      const float inv = 1.0f / std::sqrt((float)(ss / (double)d) + (float)eps);
      for (int64_t i = 0; i < d; ++i) ot[i] = wp[i] * (h[i] * inv);
    }
  });
}

// out[t, i] = silu(x[t, i]) * x[t, d + i] for x [n, 2d].
void silu_and_mul_cpu(torch::Tensor x, torch::Tensor out) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32, "fp32 only");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "contiguous tensors");
  const int64_t d = out.size(-1), n = out.numel() / d;
  TORCH_CHECK(x.size(-1) == 2 * d, "x must be [n, 2 * d]");
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = xp + t * 2 * d;
      const float* u = g + d;
      float* ot = op + t * d;
      for (int64_t i = 0; i < d; ++i) ot[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  });
}

// Rotate q [n, hq, hd] and k [n, hk, hd] in place by positions [n] (int32 or int64), rotate-halves
// layout; cos_sin [max_positions, hd]: cosines then sines. The heads' rows may be strided (views of
// the fused qkv projection); the last dimension is contiguous.
void rotary_cpu(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos_sin) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k.dtype() == torch::kFloat32 && cos_sin.dtype() == torch::kFloat32,
              "fp32 only");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && cos_sin.is_contiguous(), "unit stride in head_dim");
  const auto pos = positions.to(torch::kInt64).contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t n = q.size(0), hd = q.size(2), half = hd / 2;
  const float* cs = cos_sin.data_ptr<float>();
  struct Heads {
    float* data;
    int64_t heads, token_stride, head_stride;
  };
  const Heads both[2] = {{q.data_ptr<float>(), q.size(1), q.stride(0), q.stride(1)},
                         {k.data_ptr<float>(), k.size(1), k.stride(0), k.stride(1)}};
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cs + pp[t] * hd;
      const float* s = c + half;
      for (const Heads& x : both) {
        for (int64_t h = 0; h < x.heads; ++h) {
          float* v = x.data + t * x.token_stride + h * x.head_stride;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = v[i], x2 = v[i + half];
            v[i] = x1 * c[i] - x2 * s[i];
            v[i + half] = x2 * c[i] + x1 * s[i];
          }
        }
      }
    }
  });
}

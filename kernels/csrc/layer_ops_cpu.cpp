// The elementwise work of a decoder layer on CPU: residual add + RMSNorm, SiLU-and-mul, rotary.
//
// The torch references spell each of these as 4-8 small ops (pow, mean, rsqrt, mul, cat, ...). At
// decode batch sizes every op is a few microseconds of dispatch and a pass over a small tensor, and a
// step runs about 400 of them: some 8% of a decode step on the 2-core machine (docs/adr/0003). One
// pass per token here, parallel over tokens; the math is the reference's, in the same order where it
// matters (the sum of squares accumulates in double, then rounds once).
//
// fp32 and bf16 tensors. bf16 values are read into fp32, computed there, and rounded back (to nearest
// even) exactly where the bf16 reference rounds: after the residual add, after the normalization and
// after the weight multiply; after SiLU and after the product; after the rotation. So a bf16 result
// differs from the reference's only where fp32 evaluation order differs, by at most one bf16 ulp.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <type_traits>

namespace {

template <typename T>
inline float load(T v) {
  return static_cast<float>(v);
}

// A float as the tensor's dtype stores it, read back as float (fp32: unchanged; bf16: rounded).
template <typename T>
inline float round_to(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return static_cast<float>(static_cast<T>(v));
  }
}

template <typename T>
void rms_norm_impl(const torch::Tensor& x, const torch::Tensor& weight, double eps, const torch::Tensor& residual,
                   torch::Tensor& residual_out, torch::Tensor& out) {
  const bool add = residual.numel() > 0;
  const int64_t d = x.size(-1), n = x.numel() / d;
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  const T* rp = add ? residual.data_ptr<T>() : nullptr;
  T* rop = add ? residual_out.data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(d);
    for (int64_t t = begin; t < end; ++t) {
      const T* xt = xp + t * d;
      T* ot = op + t * d;
      if (add) {
        const T* rt = rp + t * d;
        T* sum = rop + t * d;
        for (int64_t i = 0; i < d; ++i) {
          const float s = round_to<T>(load(xt[i]) + load(rt[i]));
          sum[i] = static_cast<T>(s);
          h[i] = s;
        }
      } else {
        for (int64_t i = 0; i < d; ++i) h[i] = load(xt[i]);
      }
      double ss = 0.0;
      for (int64_t i = 0; i < d; ++i) ss += (double)h[i] * (double)h[i];
      const float inv = 1.0f / std::sqrt((float)(ss / (double)d) + (float)eps);
      for (int64_t i = 0; i < d; ++i) ot[i] = static_cast<T>(load(wp[i]) * round_to<T>(h[i] * inv));
    }
  });
}

template <typename T>
void silu_and_mul_impl(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t d = out.size(-1), n = out.numel() / d;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = xp + t * 2 * d;
      const T* u = g + d;
      T* ot = op + t * d;
      for (int64_t i = 0; i < d; ++i) {
        const float gi = load(g[i]);
        ot[i] = static_cast<T>(round_to<T>(gi / (1.0f + std::exp(-gi))) * load(u[i]));
      }
    }
  });
}

template <typename T>
void rotary_impl(const int64_t* pp, torch::Tensor& q, torch::Tensor& k, const float* cs) {
  const int64_t n = q.size(0), hd = q.size(2), half = hd / 2;
  struct Heads {
    T* data;
    int64_t heads, token_stride, head_stride;
  };
  const Heads both[2] = {{q.data_ptr<T>(), q.size(1), q.stride(0), q.stride(1)},
                         {k.data_ptr<T>(), k.size(1), k.stride(0), k.stride(1)}};
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cs + pp[t] * hd;
      const float* s = c + half;
      for (const Heads& x : both) {
        for (int64_t h = 0; h < x.heads; ++h) {
          T* v = x.data + t * x.token_stride + h * x.head_stride;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = load(v[i]), x2 = load(v[i + half]);
            v[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
            v[i + half] = static_cast<T>(x2 * c[i] + x1 * s[i]);
          }
        }
      }
    }
  });
}

void check_float_type(const torch::Tensor& t, c10::ScalarType want, const char* name) {
  TORCH_CHECK(t.scalar_type() == want, name, " must be ", c10::toString(want), ", got ",
              c10::toString(t.scalar_type()));
}

}  // namespace

// out[t] = weight * norm(x[t] + residual[t]) and residual_out[t] = x[t] + residual[t]; without a
// residual (empty tensors), out[t] = weight * norm(x[t]). Inputs are never modified (the reference's
// contract). All tensors of one dtype (fp32 or bf16) with contiguous rows.
void rms_norm_cpu(torch::Tensor x, torch::Tensor weight, double eps, torch::Tensor residual, torch::Tensor residual_out,
                  torch::Tensor out) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == torch::kFloat32 || dt == torch::kBFloat16, "fp32 or bf16 only");
  check_float_type(weight, dt, "weight");
  check_float_type(out, dt, "out");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && out.is_contiguous(), "contiguous tensors");
  if (residual.numel() > 0) {
    check_float_type(residual, dt, "residual");
    check_float_type(residual_out, dt, "residual_out");
    TORCH_CHECK(residual.is_contiguous() && residual_out.is_contiguous(), "contiguous residual tensors");
  }
  if (dt == torch::kFloat32) {
    rms_norm_impl<float>(x, weight, eps, residual, residual_out, out);
  } else {
    rms_norm_impl<c10::BFloat16>(x, weight, eps, residual, residual_out, out);
  }
}

// out[t, i] = silu(x[t, i]) * x[t, d + i] for x [n, 2d], fp32 or bf16.
void silu_and_mul_cpu(torch::Tensor x, torch::Tensor out) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == torch::kFloat32 || dt == torch::kBFloat16, "fp32 or bf16 only");
  check_float_type(out, dt, "out");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "contiguous tensors");
  TORCH_CHECK(x.size(-1) == 2 * out.size(-1), "x must be [n, 2 * d]");
  if (dt == torch::kFloat32) {
    silu_and_mul_impl<float>(x, out);
  } else {
    silu_and_mul_impl<c10::BFloat16>(x, out);
  }
}

// Rotate q [n, hq, hd] and k [n, hk, hd] (fp32 or bf16, one dtype) in place by positions [n] (int32 or
// int64), rotate-halves layout; cos_sin [max_positions, hd] fp32: cosines then sines. The heads' rows
// may be strided (views of the fused qkv projection); the last dimension is contiguous.
void rotary_cpu(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos_sin) {
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == torch::kFloat32 || dt == torch::kBFloat16, "fp32 or bf16 only");
  check_float_type(k, dt, "k");
  check_float_type(cos_sin, torch::kFloat32, "cos_sin");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && cos_sin.is_contiguous(), "unit stride in head_dim");
  const auto pos = positions.to(torch::kInt64).contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* cs = cos_sin.data_ptr<float>();
  if (dt == torch::kFloat32) {
    rotary_impl<float>(pp, q, k, cs);
  } else {
    rotary_impl<c10::BFloat16>(pp, q, k, cs);
  }
}

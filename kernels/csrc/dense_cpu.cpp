// fp32 projections y = x @ W.T (+ b) for CPU, AVX-512: the decode step's GEMMs at 1-256 rows.
//
// At decode batch sizes a projection is a stream of its weights: at 1-16 rows oneDNN's prepacked
// linear read them at 13-20 GB/s of the ~26-28 a copy reaches (docs/adr/0003). Here the weight is
// packed once into panels of 32 output columns, each panel K rows of 32 contiguous floats, so a
// thread walks one sequential stream per panel (what the hardware prefetcher follows best) and a
// software prefetch runs a few KB ahead of it. A micro-kernel keeps up to 12 rows x 32 columns of
// accumulators in registers (24 of the 32 zmm): per k it loads the two weight vectors once and
// broadcasts one x value per row. With more rows than a tile holds, the tiles of a panel reread it
// from L2, and the last of them prefetches the next panel, so DRAM works while the FMAs do.
//
// Each output is one fp32 FMA chain over k in order, as a naive GEMM sums (no split-K), so it
// differs from oneDNN's or MKL's result only by rounding order, far inside the fp32 tests' 1e-5.
// Built for AVX-512 only; on other CPUs `dense_available()` is false and Loom keeps oneDNN.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int64_t kPanel = 32;       // output columns per panel: two zmm
constexpr int kMaxRows = 12;         // rows per register tile: 24 accumulators
constexpr int64_t kPrefetchRows = 48;  // k rows (48 x 128 B) the single-tile stream prefetches ahead

enum Prefetch { kNone = 0, kAhead = 1, kNextPanel = 2 };

// y[r, 0:ncols] = x[r] . panel (+ bias) for the tile's MR rows.
template <int MR, int PF>
void tile(const float* x, int64_t ldx, const float* p, int64_t K, float* y, int64_t ldy, int64_t ncols,
          const float* bias, const float* pf) {
  __m512 lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) {
    lo[r] = _mm512_setzero_ps();
    hi[r] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    if (PF == kAhead) {  // into L1: this tile is the panel's only reader
      _mm_prefetch(reinterpret_cast<const char*>(pf + k * kPanel), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(pf + k * kPanel + 16), _MM_HINT_T0);
    } else if (PF == kNextPanel) {  // into L2: the next panel's first tile reads it from there
      _mm_prefetch(reinterpret_cast<const char*>(pf + k * kPanel), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(pf + k * kPanel + 16), _MM_HINT_T1);
    }
    const __m512 w0 = _mm512_loadu_ps(p + k * kPanel), w1 = _mm512_loadu_ps(p + k * kPanel + 16);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      lo[r] = _mm512_fmadd_ps(xb, w0, lo[r]);
      hi[r] = _mm512_fmadd_ps(xb, w1, hi[r]);
    }
  }
  const __mmask16 m0 = ncols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << ncols) - 1);
  const __mmask16 m1 = ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0 : static_cast<__mmask16>((1u << (ncols - 16)) - 1);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
  for (int r = 0; r < MR; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, _mm512_add_ps(lo[r], b0));
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, _mm512_add_ps(hi[r], b1));
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, const float*,
                        const float*);

template <int PF, int... MR>
constexpr std::array<TileFn, kMaxRows + 1> tiles_for(std::integer_sequence<int, MR...>) {
  return {nullptr, &tile<MR + 1, PF>...};
}

constexpr auto kRows = std::make_integer_sequence<int, kMaxRows>{};
const std::array<TileFn, kMaxRows + 1> kTiles[3] = {tiles_for<kNone>(kRows), tiles_for<kAhead>(kRows),
                                                    tiles_for<kNextPanel>(kRows)};

}  // namespace

bool dense_available() { return true; }

// W [N, K] -> [ceil(N / 32), K, 32]: panel p holds output columns 32p..32p+31, k-major, zero padded.
torch::Tensor dense_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.dtype() == torch::kFloat32, "dense_pack takes a 2-d fp32 weight");
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({panels, kPanel, K}).transpose(1, 2).contiguous();
}

// out[M, N] = x[M, K] @ W.T (+ bias), W given as dense_pack packed it.
void dense_cpu(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, torch::Tensor out) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && packed.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32,
              "fp32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous() && packed.is_contiguous(),
              "contiguous 2-d x and out");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && packed.size(2) == kPanel && panels * kPanel >= N && out.size(0) == M,
              "shapes disagree");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.is_contiguous() && bias.dtype() == torch::kFloat32),
              "bias: empty or N contiguous fp32");
  if (M == 0) return;
  const float* xp = x.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  const int64_t row_tiles = (M + kMaxRows - 1) / kMaxRows;
  at::parallel_for(0, (N + kPanel - 1) / kPanel, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pn = begin; pn < end; ++pn) {
      const int64_t c0 = pn * kPanel, ncols = std::min<int64_t>(kPanel, N - c0);
      const float* p = pp + pn * K * kPanel;
      for (int64_t t = 0, m = 0; t < row_tiles; ++t) {
        const int rows = static_cast<int>((M - m) / (row_tiles - t));  // balanced: 16 rows -> 8 + 8
        const int mode = row_tiles == 1 ? kAhead : (t == row_tiles - 1 && pn + 1 < end) ? kNextPanel : kNone;
        const float* pf = mode == kAhead ? p + kPrefetchRows * kPanel : p + K * kPanel;
        kTiles[mode][rows](xp + m * K, K, p, K, yp + m * N + c0, N, ncols, bp ? bp + c0 : nullptr, pf);
        m += rows;
      }
    }
  });
}

#else  // no AVX-512: oneDNN serves the projections (worker/dense.py asks dense_available() first)

bool dense_available() { return false; }

torch::Tensor dense_pack(torch::Tensor) { TORCH_CHECK(false, "dense_pack needs AVX-512"); }

void dense_cpu(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor) {
  TORCH_CHECK(false, "dense_cpu needs AVX-512");
}

#endif

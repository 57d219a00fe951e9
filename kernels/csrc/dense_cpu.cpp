// fp32 projections y = x @ W.T (+ b) for CPU: the decode step's GEMMs at 1-256 rows.
//
// At decode batch sizes a projection is a stream of its weights: at 1-16 rows oneDNN's prepacked
// linear read them at 13-20 GB/s of the ~26-28 a copy reaches (docs/adr/0003). Here the weight is
// packed once into panels of two vectors' worth of output columns (32 on AVX-512, 16 on AVX2), each
// panel K rows of contiguous floats, so a thread walks one sequential stream per panel (what the
// hardware prefetcher follows best) and a software prefetch runs a few KB ahead of it. A micro-kernel
// keeps a tile of rows x the panel's columns of accumulators in registers (12 x 32 on AVX-512: 24 of
// the 32 zmm; 6 x 16 on AVX2: 12 of the 16 ymm): per k it loads the panel's two weight vectors once
// and broadcasts one x value per row. With more rows than a tile holds, the tiles of a panel reread it
// from L2, and each of them prefetches its share of the next panel, so DRAM works while the FMAs do.
// (When only the last tile prefetched, memory idled through the others: 16 rows on a Zen 5 took
// 18.8 ms for SmolLM2's projections and LM head, against 14.6 with the shares.)
//
// Each output is one fp32 FMA chain over k in order, as a naive GEMM sums (no split-K), so it
// differs from oneDNN's or MKL's result only by rounding order, far inside the fp32 tests' 1e-5.
// Built for AVX-512 and for AVX2 with FMA; elsewhere `dense_available()` is false and Loom keeps
// oneDNN.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <utility>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

namespace {

// The ISA's vector, and the few operations the micro-kernel needs, with stores and bias loads
// limited to the first n lanes (a ragged last panel).
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
constexpr int kMaxRows = 12;  // 24 accumulators of 32 zmm
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vset1(float v) { return _mm512_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline __mmask16 lanes(int64_t n) {
  return n >= kLanes ? static_cast<__mmask16>(0xFFFF) : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}
inline Vec vload_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(lanes(n), p); }
inline void vstore_first(float* p, Vec v, int64_t n) { _mm512_mask_storeu_ps(p, lanes(n), v); }
#else
using Vec = __m256;
constexpr int kLanes = 8;
constexpr int kMaxRows = 6;  // 12 accumulators of 16 ymm, leaving two for the weights, one broadcast
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vset1(float v) { return _mm256_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline __m256i lanes(int64_t n) {
  const int64_t k = std::clamp<int64_t>(n, 0, kLanes);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(k)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Vec vload_first(const float* p, int64_t n) { return _mm256_maskload_ps(p, lanes(n)); }
inline void vstore_first(float* p, Vec v, int64_t n) { _mm256_maskstore_ps(p, lanes(n), v); }
#endif

constexpr int64_t kPanel = 2 * kLanes;                  // output columns per panel: two vectors
constexpr int64_t kLine = 64 / sizeof(float);           // floats per cache line
constexpr int64_t kPrefetchRows = 6144 / (kPanel * 4);  // the single-tile stream prefetches 6 KB ahead

enum Prefetch { kNone = 0, kAhead = 1, kNextPanel = 2 };

// What a tile stores. kPlain: y[r, 0:ncols] = x[r] . panel (+ bias). The other two serve a gated
// MLP's gate and up projections packed in pairs (dense_pack_gated: a panel's first vector of columns
// is gate columns, its second the same up columns): kSplit stores them apart, the gate's at y and the
// up's `aux` columns further on (the plain [gate | up] output); kGated stores silu(gate) * up, the
// activation the down projection reads, so the [rows, 2 x intermediate] product is never written.
enum Epilogue { kPlain = 0, kSplit = 1, kGated = 2 };

template <int MR, int PF>
void tile(const float* x, int64_t ldx, const float* p, int64_t K, float* y, int64_t ldy, int64_t ncols,
          const float* bias, const float* pf, int64_t pf_rows, int epi, int64_t aux) {
  Vec lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) {
    lo[r] = vzero();
    hi[r] = vzero();
  }
  // kNextPanel: this tile's share of the next panel (pf_rows of its k rows from pf), one every
  // `every` k steps, so the memory streams the whole time the panel's tiles compute. With K not a
  // multiple of the share, the last few run past it (into the next share, or past the buffer's end:
  // a prefetch never faults).
  const int64_t every = PF == kNextPanel ? K / std::max<int64_t>(1, pf_rows) : 0;
  int64_t countdown = 1;
  for (int64_t k = 0; k < K; ++k) {
    if (PF == kAhead) {  // into L1: this tile is the panel's only reader
      for (int64_t c = 0; c < kPanel; c += kLine)
        _mm_prefetch(reinterpret_cast<const char*>(pf + k * kPanel + c), _MM_HINT_T0);
    } else if (PF == kNextPanel && --countdown == 0) {  // into L2, for the next panel
      countdown = every;
      for (int64_t c = 0; c < kPanel; c += kLine) _mm_prefetch(reinterpret_cast<const char*>(pf + c), _MM_HINT_T1);
      pf += kPanel;
    }
    const Vec w0 = vload(p + k * kPanel), w1 = vload(p + k * kPanel + kLanes);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const Vec xb = vset1(x[r * ldx + k]);
      lo[r] = vfma(xb, w0, lo[r]);
      hi[r] = vfma(xb, w1, hi[r]);
    }
  }
  if (epi == kPlain) {  // once per tile: a runtime switch costs nothing beside the k loop
    const Vec b0 = bias ? vload_first(bias, ncols) : vzero();
    const Vec b1 = bias ? vload_first(bias + kLanes, ncols - kLanes) : vzero();
    for (int r = 0; r < MR; ++r) {
      vstore_first(y + r * ldy, vadd(lo[r], b0), ncols);
      vstore_first(y + r * ldy + kLanes, vadd(hi[r], b1), ncols - kLanes);
    }
  } else if (epi == kSplit) {
    for (int r = 0; r < MR; ++r) {
      vstore_first(y + r * ldy, lo[r], kLanes);
      vstore_first(y + r * ldy + aux, hi[r], kLanes);
    }
  } else {
    // The same expression as silu_and_mul (layer_ops_cpu.cpp), over a whole vector of lanes so the
    // compiler vectorizes its exp.
    alignas(64) float gate[MR * kLanes], up[MR * kLanes];
    for (int r = 0; r < MR; ++r) {
      vstore_first(gate + r * kLanes, lo[r], kLanes);
      vstore_first(up + r * kLanes, hi[r], kLanes);
    }
    for (int j = 0; j < MR * kLanes; ++j) gate[j] = gate[j] / (1.0f + std::exp(-gate[j])) * up[j];
    for (int r = 0; r < MR; ++r) vstore_first(y + r * ldy, vload(gate + r * kLanes), kLanes);
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, const float*,
                        const float*, int64_t, int, int64_t);

template <int PF, int... MR>
constexpr std::array<TileFn, kMaxRows + 1> tiles_for(std::integer_sequence<int, MR...>) {
  return {nullptr, &tile<MR + 1, PF>...};
}

constexpr auto kRows = std::make_integer_sequence<int, kMaxRows>{};
const std::array<TileFn, kMaxRows + 1> kTiles[3] = {tiles_for<kNone>(kRows), tiles_for<kAhead>(kRows),
                                                    tiles_for<kNextPanel>(kRows)};

// out = x @ panels for every panel, in balanced row tiles, panels dealt out over the threads. Panel
// pn writes its columns from out + pn * cols_per_panel: kPanel of them for kPlain (the last one
// ragged at the row width ldy), kLanes for the paired epilogues.
void run_panels(int epi, const float* xp, int64_t M, int64_t K, const float* pp, int64_t panels, const float* bp,
                float* yp, int64_t ldy, int64_t cols_per_panel, int64_t aux) {
  const int64_t row_tiles = (M + kMaxRows - 1) / kMaxRows;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pn = begin; pn < end; ++pn) {
      const int64_t c0 = pn * cols_per_panel, ncols = std::min<int64_t>(kPanel, ldy - c0);
      const float* p = pp + pn * K * kPanel;
      for (int64_t t = 0, m = 0; t < row_tiles; ++t) {
        const int rows = static_cast<int>((M - m) / (row_tiles - t));  // balanced: 16 rows -> 8 + 8
        // One tile: it streams its panel from memory, prefetching ahead into L1. Several: each
        // prefetches an equal share of the next panel's k rows into L2 (the last tile of a thread's
        // range has none to fetch).
        const int mode = row_tiles == 1 ? kAhead : pn + 1 < end ? kNextPanel : kNone;
        const int64_t lo = K * t / row_tiles, hi = K * (t + 1) / row_tiles;
        const float* pf = mode == kAhead ? p + kPrefetchRows * kPanel : p + (K + lo) * kPanel;
        kTiles[mode][rows](xp + m * K, K, p, K, yp + m * ldy + c0, ldy, ncols, bp ? bp + c0 : nullptr, pf, hi - lo, epi,
                           aux);
        m += rows;
      }
    }
  });
}

}  // namespace

bool dense_available() { return true; }

// W [N, K] -> [ceil(N / P), K, P] for the ISA's panel width P: panel p holds output columns
// P*p..P*p+P-1, k-major, zero padded.
torch::Tensor dense_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.dtype() == torch::kFloat32, "dense_pack takes a 2-d fp32 weight");
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({panels, kPanel, K}).transpose(1, 2).contiguous();
}

static void check_operands(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& out) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && packed.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32,
              "fp32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous() && packed.is_contiguous(),
              "contiguous 2-d x and out");
}

// out[M, N] = x[M, K] @ W.T (+ bias), W given as dense_pack packed it.
void dense_cpu(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, torch::Tensor out) {
  check_operands(x, packed, out);
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && packed.size(2) == kPanel && panels * kPanel >= N && out.size(0) == M,
              "shapes disagree");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.is_contiguous() && bias.dtype() == torch::kFloat32),
              "bias: empty or N contiguous fp32");
  if (M == 0) return;
  run_panels(kPlain, x.data_ptr<float>(), M, K, packed.data_ptr<float>(), panels,
             bias.numel() ? bias.data_ptr<float>() : nullptr, out.data_ptr<float>(), N, kPanel, 0);
}

int64_t dense_gate_width() { return kLanes; }

// A gated MLP's [gate; up] weight [2 I, K] (I a multiple of kLanes) -> [I / kLanes, K, kPanel]:
// panel p holds gate columns kLanes*p.. in its first vector and the same up columns in its second.
torch::Tensor dense_pack_gated(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.dtype() == torch::kFloat32, "dense_pack_gated takes a 2-d fp32 weight");
  const int64_t N = w.size(0), K = w.size(1), inter = N / 2;
  TORCH_CHECK(N % 2 == 0 && inter % kLanes == 0, "dense_pack_gated needs 2 x a multiple of ", kLanes, " rows");
  auto halves = w.contiguous().view({2, inter / kLanes, kLanes, K});  // [gate|up, panel, lane, K]
  return halves.permute({1, 3, 0, 2}).contiguous().view({inter / kLanes, K, kPanel});
}

// From a dense_pack_gated weight: out [M, I] = silu(x @ gate.T) * (x @ up.T), or with split the
// product itself, out [M, 2 I] = [x @ gate.T | x @ up.T].
void dense_gated_cpu(torch::Tensor x, torch::Tensor packed, torch::Tensor out, bool split) {
  check_operands(x, packed, out);
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0), inter = panels * kLanes;
  const int64_t width = split ? 2 * inter : inter;
  TORCH_CHECK(packed.size(1) == K && packed.size(2) == kPanel && out.size(0) == M && out.size(1) == width,
              "shapes disagree");
  if (M == 0) return;
  run_panels(split ? kSplit : kGated, x.data_ptr<float>(), M, K, packed.data_ptr<float>(), panels, nullptr,
             out.data_ptr<float>(), width, kLanes, split ? inter : 0);
}

#else  // neither AVX-512 nor AVX2: oneDNN serves the projections (worker/dense.py asks dense_available())

bool dense_available() { return false; }

torch::Tensor dense_pack(torch::Tensor) { TORCH_CHECK(false, "dense_pack needs AVX-512 or AVX2"); }

void dense_cpu(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor) {
  TORCH_CHECK(false, "dense_cpu needs AVX-512 or AVX2");
}

int64_t dense_gate_width() { return 0; }

torch::Tensor dense_pack_gated(torch::Tensor) { TORCH_CHECK(false, "dense_pack_gated needs AVX-512 or AVX2"); }

void dense_gated_cpu(torch::Tensor, torch::Tensor, torch::Tensor, bool) {
  TORCH_CHECK(false, "dense_gated_cpu needs AVX-512 or AVX2");
}

#endif

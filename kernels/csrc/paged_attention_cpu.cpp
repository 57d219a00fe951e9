// Paged attention for CPU, one query row at a time over a prefix of its sequence's keys, read in
// place from the paged cache through the block table (no gathered copies), fp32 accumulation. Decode
// tokens are such rows, and so are the rows of prefill chunks (kernels/attention_cpu.py).
//
// The torch reference gathers each sequence's keys into a padded buffer and runs batched GEMMs: three
// passes over the KV bytes plus tiny-GEMM overhead. Here each (row, KV head) work item reads its keys
// and values exactly once, for all the query heads of its group, which is what a decode step is
// bound by.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define LOOM_KV_HEAD_KERNEL 1  // the register-blocked path below exists in this build
#endif

namespace {

template <typename T>
inline float to_f(T x) {
  return static_cast<float>(x);
}

#if defined(__AVX512F__)
// 16 cache values as fp32 lanes: bf16 is the high half of an fp32 (widen, shift), fp16 converts.
template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}
#endif

// dot(q, k) over n values, fp32 math; 16 lanes at a time where the CPU has AVX-512 (head dims are
// multiples of 16), whatever the cache dtype: a scalar bf16 loop cost as much as the fp32 one's
// memory traffic saved.
template <typename T>
inline float dot_any(const float* q, const T* k, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(k + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float dot = 0.f;
  for (int64_t i = 0; i < n; ++i) dot += q[i] * to_f(k[i]);
  return dot;
}

// acc += w * v over n values.
template <typename T>
inline void axpy_any(float* acc, float w, const T* v, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    const __m512 wv = _mm512_set1_ps(w);
    for (int64_t i = 0; i < n; i += 16)
      _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(wv, load16(v + i), _mm512_loadu_ps(acc + i)));
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) acc[i] += w * to_f(v[i]);
}

// fn(position, slot) for each of a sequence's len cache rows, walking its block table; base points at
// the head's first value in block 0 of the cache.
//
// Blocks sit anywhere in the cache, so the hardware prefetcher loses the stream at every block edge
// and each block began with a DRAM miss: while one block is read, the same rows (row_bytes from
// each slot's pointer) of the next block are prefetched, into L2 (an L1 hint measured 10-40% slower
// on cold caches; prefetching whole slots, or the values during the pass over keys, was no faster).
template <typename T, typename Fn>
inline void for_each_slot(const T* base, const int32_t* table, int64_t len, int64_t block_size, int64_t block_stride,
                          int64_t slot_stride, int64_t row_bytes, Fn&& fn) {
  for (int64_t b = 0, p0 = 0; p0 < len; ++b, p0 += block_size) {
    const T* block = base + table[b] * block_stride;
    const int64_t n = std::min(block_size, len - p0);
    const bool more = p0 + block_size < len;
    const char* next = more ? reinterpret_cast<const char*>(base + table[b + 1] * block_stride) : nullptr;
    const int64_t next_n = more ? std::min(block_size, len - p0 - block_size) : 0;
    for (int64_t o = 0; o < n; ++o) {
      if (o < next_n) {
        const char* row = next + o * slot_stride * static_cast<int64_t>(sizeof(T));
        for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(row + off, 0, 2);
      }
      fn(p0 + o, block + o * slot_stride);
    }
  }
}

// Softmax over each of `rows` rows of `len` scores, fp32, in place; with inv_sums the rows are left
// unnormalised (exp(s - max)) and 1 / sum is written there, for a caller that scales its output once.
inline void softmax_rows(float* scores, int64_t rows, int64_t len, float* inv_sums = nullptr) {
  for (int64_t j = 0; j < rows; ++j) {
    float* sj = scores + j * len;
    const float m = *std::max_element(sj, sj + len);
    float sum = 0.f;
    for (int64_t p = 0; p < len; ++p) {
      sj[p] = std::exp(sj[p] - m);
      sum += sj[p];
    }
    const float inv = 1.f / sum;
    if (inv_sums != nullptr) {
      inv_sums[j] = inv;
    } else {
      for (int64_t p = 0; p < len; ++p) sj[p] *= inv;
    }
  }
}

#if defined(__AVX512F__)
// One cache row of 16 * C values as C fp32 vectors. bf16 rows are read 32 values per load and split
// into even and odd values (shift, mask) instead of widened 16 at a time: half the instructions, in
// a kernel whose bf16 loop was instruction-bound. Lanes are then in row_lane order, not value order.
template <typename T, int C>
inline void load_row(const T* p, __m512 (&x)[C]) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    static_assert(C % 2 == 0, "bf16 rows are split 32 values at a time");
    const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    for (int j = 0; j < C / 2; ++j) {
      const __m512i raw = _mm512_loadu_si512(p + 32 * j);
      x[2 * j] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));       // values 32j + 2i
      x[2 * j + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, high));  // values 32j + 2i + 1
    }
  } else {
    for (int c = 0; c < C; ++c) x[c] = load16(p + 16 * c);
  }
}

// Where load_row puts value d of a row (flat index over its C vectors of 16 lanes).
template <typename T>
inline int64_t row_lane(int64_t d) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const int64_t r = d % 32;
    return (d / 32 * 2 + r % 2) * 16 + r / 2;
  } else {
    return d;
  }
}

// The 16 horizontal sums of v[0..15], as one vector (lane i = sum of v[i]): a transpose-and-add tree,
// about 3 instructions per sum where a full reduction of each vector took 8.
inline __m512 sum16(const __m512 (&v)[16]) {
  __m512 two[8], four[4];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    two[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: [a, b, c, d] partial sums
    const __m512d x = _mm512_castps_pd(two[2 * k]), y = _mm512_castps_pd(two[2 * k + 1]);
    four[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // four[k] holds slots 4k..4k+3 in each of its four 128-bit lanes; add the lanes together.
  const __m512 lo =
      _mm512_add_ps(_mm512_shuffle_f32x4(four[0], four[1], 0x88), _mm512_shuffle_f32x4(four[0], four[1], 0xDD));
  const __m512 hi =
      _mm512_add_ps(_mm512_shuffle_f32x4(four[2], four[3], 0x88), _mm512_shuffle_f32x4(four[2], four[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, 0x88), _mm512_shuffle_f32x4(lo, hi, 0xDD));
}

// One sequence's G query heads that share one KV head, head_dim 16 * C, in registers: each key and
// value slot is loaded once and used by all G heads, and the G output rows accumulate in registers
// across the whole sequence. The generic loop below re-read every slot per query head and kept its
// accumulators in memory: instruction-bound, not memory-bound, at 2-5x the bytes' time.
template <typename T, int G, int C>
void decode_one_kv_head(const float* q, float scale, const T* k0, const T* v0, const int32_t* table, int64_t len,
                        int64_t block_size, int64_t block_stride, int64_t slot_stride, float* scores, float* out) {
  constexpr int D = 16 * C;
  alignas(64) float buf[G * D];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) buf[g * D + row_lane<T>(d)] = q[g * D + d] * scale;
  __m512 qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = _mm512_load_ps(buf + g * D + c * 16);
  // Pass 1: scores [G, len]. Each slot's G dot products stay as 16-lane partial sums until 16 slots
  // are gathered, then sum16 reduces them together.
  __m512 part[G][16];
  int filled = 0;
  auto flush = [&](int64_t p_end) {
    for (int i = filled; i < 16; ++i)
      for (int g = 0; g < G; ++g) part[g][i] = _mm512_setzero_ps();
    const __mmask16 mask = static_cast<__mmask16>((1u << filled) - 1u);
    for (int g = 0; g < G; ++g) _mm512_mask_storeu_ps(scores + g * len + p_end - filled, mask, sum16(part[g]));
    filled = 0;
  };
  for_each_slot(k0, table, len, block_size, block_stride, slot_stride, D * sizeof(T), [&](int64_t p, const T* k) {
    __m512 kv[C];
    load_row<T, C>(k, kv);
    for (int g = 0; g < G; ++g) {
      __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
      for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[g][c], kv[c], a);
      part[g][filled] = a;
    }
    if (++filled == 16) flush(p + 1);
  });
  if (filled) flush(len);
  float inv_sums[G];
  softmax_rows(scores, G, len, inv_sums);
  // Pass 2: out [G, D] = probabilities @ values, scaled by 1 / sum at the end.
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for_each_slot(v0, table, len, block_size, block_stride, slot_stride, D * sizeof(T), [&](int64_t p, const T* v) {
    __m512 vv[C];
    load_row<T, C>(v, vv);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(scores[g * len + p]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(w, vv[c], acc[g][c]);
    }
  });
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_store_ps(buf + g * D + c * 16, acc[g][c]);
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) out[g * D + d] = buf[g * D + row_lane<T>(d)] * inv_sums[g];
}

// `heads` consecutive KV heads of one row, one after the other.
template <typename T, int G, int C>
void decode_kv_head(const float* q, float scale, const T* k0, const T* v0, const int32_t* table, int64_t len,
                    int64_t heads, int64_t block_size, int64_t block_stride, int64_t slot_stride, float* scores,
                    float* out) {
  constexpr int D = 16 * C;
  for (int64_t h = 0; h < heads; ++h)
    decode_one_kv_head<T, G, C>(q + h * G * D, scale, k0 + h * D, v0 + h * D, table, len, block_size, block_stride,
                                slot_stride, scores, out + h * G * D);
}

constexpr int kLanes = 16;
constexpr bool kRowItems = false;  // work items of one KV head (measured on AVX-512 CPUs)

#elif defined(LOOM_KV_HEAD_KERNEL)  // AVX2 with FMA: 16 ymm registers of 8 lanes

constexpr int kLanes = 8;

// 8 cache values as fp32 lanes: bf16 is the high half of an fp32 (widen, shift), fp16 converts.
template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Output vectors per walk over one KV head's values: G heads x CC vectors of accumulators stay within
// 12 of the 16 registers (the rest hold the value row and the weights).
constexpr int value_chunk(int G, int C) {
  int cc = C;
  while (G * cc > 12 && cc > 1) cc /= 2;
  return cc;
}

// The AVX-512 kernel's shape with half the registers, and half as wide, over `heads` consecutive KV
// heads of one row: one head per work item where rows share their keys (prefill chunks) or are too
// few to occupy the threads, else all of them. A slot's keys and values for all heads are contiguous,
// so a whole-row item reads whole slots front to back: on the AVX2 Zen 3 a decode batch's KV streamed
// at ~19 GB/s that way against ~15-16 one head's slice of each slot at a time. Each head's key is
// loaded once for its G query heads (the query rows are read from L1), each dot product reduced on the
// spot.
template <typename T, int G, int C>
void decode_kv_head(const float* q, float scale, const T* k0, const T* v0, const int32_t* table, int64_t len,
                    int64_t heads, int64_t block_size, int64_t block_stride, int64_t slot_stride, float* scores,
                    float* out) {
  constexpr int D = 8 * C, CC = value_chunk(G, C);
  const int64_t rows = heads * G;  // query heads of this work item
  alignas(32) float qs[8 * G * D];
  const int64_t slot_bytes = (heads * D) * sizeof(T);
  for (int64_t h0 = 0; h0 < heads; h0 += 8) {  // at most 8 KV heads' queries on the stack at a time
    const int64_t hn = std::min<int64_t>(8, heads - h0);
    for (int64_t i = 0; i < hn * G * D; ++i) qs[i] = q[h0 * G * D + i] * scale;
    for_each_slot(k0 + h0 * D, table, len, block_size, block_stride, slot_stride, slot_bytes,
                  [&](int64_t p, const T* k) {
                    for (int64_t h = 0; h < hn; ++h) {
                      __m256 a[G];
                      for (int g = 0; g < G; ++g) a[g] = _mm256_setzero_ps();
                      for (int c = 0; c < C; ++c) {
                        const __m256 kv = load8(k + h * D + 8 * c);
                        for (int g = 0; g < G; ++g)
                          a[g] = _mm256_fmadd_ps(_mm256_load_ps(qs + (h * G + g) * D + 8 * c), kv, a[g]);
                      }
                      for (int g = 0; g < G; ++g) scores[((h0 + h) * G + g) * len + p] = hsum8(a[g]);
                    }
                  });
  }
  softmax_rows(scores, rows, len, nullptr);
  if (heads == 1) {
    // One KV head (prefill rows, small batches): its G output rows in registers, CC columns per walk
    // over the values. Keys and values a chunk's rows share are read from cache, so this is
    // compute-bound, where registers beat the L1 accumulators below (1.3x on a 512-token chunk).
    for (int c0 = 0; c0 < C; c0 += CC) {
      __m256 acc[G][CC];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < CC; ++c) acc[g][c] = _mm256_setzero_ps();
      for_each_slot(v0 + 8 * c0, table, len, block_size, block_stride, slot_stride, (D - 8 * c0) * sizeof(T),
                    [&](int64_t p, const T* v) {
                      for (int c = 0; c < CC; ++c) {
                        const __m256 vv = load8(v + 8 * c);
                        for (int g = 0; g < G; ++g)
                          acc[g][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(scores + g * len + p), vv, acc[g][c]);
                      }
                    });
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < CC; ++c) _mm256_storeu_ps(out + g * D + 8 * (c0 + c), acc[g][c]);
    }
    return;
  }
  // Whole rows (decode batches, DRAM-bound): one walk over whole slots, the accumulators in L1.
  for (int64_t i = 0; i < rows * D; ++i) out[i] = 0.f;
  for_each_slot(v0, table, len, block_size, block_stride, slot_stride, slot_bytes, [&](int64_t p, const T* v) {
    for (int64_t h = 0; h < heads; ++h) {
      __m256 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = load8(v + h * D + 8 * c);
      for (int g = 0; g < G; ++g) {
        const __m256 w = _mm256_broadcast_ss(scores + (h * G + g) * len + p);
        float* o = out + (h * G + g) * D;
        for (int c = 0; c < C; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_fmadd_ps(w, vv[c], _mm256_loadu_ps(o + 8 * c)));
      }
    }
  });
}

constexpr bool kRowItems = true;  // work items of a whole row (all KV heads) where rows outnumber threads

#endif

#if defined(LOOM_KV_HEAD_KERNEL)
template <typename T>
using KvHeadFn = void (*)(const float*, float, const T*, const T*, const int32_t*, int64_t, int64_t, int64_t, int64_t,
                          int64_t, float*, float*);

template <typename T, int C>
KvHeadFn<T> kv_head_fn_for_group(int64_t group) {
  switch (group) {
    case 1:
      return &decode_kv_head<T, 1, C>;
    case 2:
      return &decode_kv_head<T, 2, C>;
    case 3:
      return &decode_kv_head<T, 3, C>;
    case 4:
      return &decode_kv_head<T, 4, C>;
    case 8:
      return &decode_kv_head<T, 8, C>;
    default:
      return nullptr;
  }
}

// The register-blocked path for this shape (head_dim 64 or 128; 1, 2, 3, 4 or 8 query heads per KV
// head, which covers the Llama, Qwen and SmolLM families), or null for the generic loop.
template <typename T>
KvHeadFn<T> kv_head_fn(int64_t group, int64_t head_dim) {
  if (head_dim == 64) return kv_head_fn_for_group<T, 64 / kLanes>(group);
  if (head_dim == 128) return kv_head_fn_for_group<T, 128 / kLanes>(group);
  return nullptr;
}
#endif

// The i-th of n rows in the order work items take them: first, last, second, second to last, ...
// at::parallel_for hands each thread a contiguous range, and a prefill chunk's rows grow longer one
// by one; in this order every range holds short and long rows alike.
inline int64_t zigzag(int64_t i, int64_t n) { return i % 2 == 0 ? i / 2 : n - 1 - i / 2; }

// T: the cache dtype; Q: q's and out's, fp32 or T (a half-precision model's own activations, read and
// written here so that no fp32 copy of q or of the output is made around the call).
template <typename T, typename Q>
void decode_kernel(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& block_tables, const torch::Tensor& key_lens, const torch::Tensor& seqs,
                   const torch::Tensor& rows, torch::Tensor& out, double scale) {
  const int64_t num_decodes = seqs.size(0);
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;  // query heads per KV head
  const int64_t table_width = block_tables.size(1);

  const Q* qp = q.data_ptr<Q>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* lens = key_lens.data_ptr<int32_t>();
  const int64_t* seq_idx = seqs.data_ptr<int64_t>();
  const int64_t* row_idx = rows.data_ptr<int64_t>();
  Q* op = out.data_ptr<Q>();

  // Strides of the contiguous cache [blocks, block_size, kv_heads, head_dim].
  const int64_t slot_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * slot_stride;

#if defined(LOOM_KV_HEAD_KERNEL)
  if (const auto fn = kv_head_fn<T>(group, head_dim)) {
    // One work item per (row, KV head), so that there are more items than threads even at small
    // batches; or, where the build reads whole slots faster and rows alone outnumber the threads,
    // one per row.
    // Whole rows only where the build prefers them and every row is its own sequence (a decode
    // batch, no prefill chunk); the scan is skipped where they are not preferred.
    bool distinct = kRowItems;
    for (int64_t i = 1; i < num_decodes && distinct; ++i) distinct = seq_idx[i] != seq_idx[i - 1];
    const int64_t span = distinct && num_decodes >= 2 * at::get_num_threads() ? num_kv_heads : 1;
    const int64_t items_per_row = num_kv_heads / span, width = span * group * head_dim;
    at::parallel_for(0, num_decodes * items_per_row, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, qf(width), of(width);
      for (int64_t w = begin; w < end; ++w) {
        const int64_t d = zigzag(w / items_per_row, num_decodes), h = w % items_per_row * span;
        const int64_t s = seq_idx[d], row = row_idx[d], len = lens[d];
        scores.resize(span * group * len);
        const int64_t first = (row * num_heads + h * group) * head_dim;  // query head h * group
        const float* qrow;
        float* orow;
        if constexpr (std::is_same_v<Q, float>) {
          qrow = qp + first;
          orow = op + first;
        } else {
          for (int64_t i = 0; i < width; ++i) qf[i] = to_f(qp[first + i]);
          qrow = qf.data();
          orow = of.data();
        }
        fn(qrow, static_cast<float>(scale), kp + h * head_dim, vp + h * head_dim, bt + s * table_width, len, span,
           block_size, block_stride, slot_stride, scores.data(), orow);
        if constexpr (!std::is_same_v<Q, float>) {
          for (int64_t i = 0; i < width; ++i) op[first + i] = static_cast<Q>(of[i]);
        }
      }
    });
    return;
  }
#endif
  // One work item per sequence, all its heads at once: each block's slots are read front to back,
  // every byte once, which streams far better than one head's strided slice at a time.
  at::parallel_for(0, num_decodes, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qs(num_heads * head_dim), acc(num_heads * head_dim);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t d = zigzag(i, num_decodes);
      const int64_t s = seq_idx[d], row = row_idx[d];
      const int64_t len = lens[d];
      scores.assign(num_heads * len, 0.f);
      const Q* src = qp + row * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) qs[i] = to_f(src[i]) * static_cast<float>(scale);
      const int32_t* table = bt + s * table_width;
      // Pass 1: the score of every key for every query head (head j uses KV head j / group).
      for_each_slot(kp, table, len, block_size, block_stride, slot_stride, slot_stride * sizeof(T),
                    [&](int64_t p, const T* slot) {
                      for (int64_t j = 0; j < num_heads; ++j)
                        scores[j * len + p] =
                            dot_any(qs.data() + j * head_dim, slot + (j / group) * head_dim, head_dim);
                    });
      softmax_rows(scores.data(), num_heads, len);
      // Pass 2: probability-weighted values.
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_slot(vp, table, len, block_size, block_stride, slot_stride, slot_stride * sizeof(T),
                    [&](int64_t p, const T* slot) {
                      for (int64_t j = 0; j < num_heads; ++j)
                        axpy_any(acc.data() + j * head_dim, scores[j * len + p], slot + (j / group) * head_dim,
                                 head_dim);
                    });
      Q* dst = op + row * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) dst[i] = static_cast<Q>(acc[i]);
    }
  });
}

}  // namespace

// q [T, H, D] and out: fp32, or both the caches' dtype; caches [NB, BS, KVH, D] fp32/bf16/fp16
// contiguous; block_tables int32 [S, MB]; seqs/rows int64 and key_lens int32 [num_decodes]: each
// query row's sequence, its row in q and how many of the sequence's first keys it attends to (a
// decode: all of them; row i of a prefill chunk after ctx cached tokens: ctx + i + 1, which is causal
// attention row by row). Math in fp32 whatever the dtypes.
void paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                     torch::Tensor key_lens, torch::Tensor seqs, torch::Tensor rows, torch::Tensor out, double scale) {
  TORCH_CHECK(q.dtype() == out.dtype(), "q and out must share a dtype");
  TORCH_CHECK(q.dtype() == torch::kFloat32 || q.dtype() == k_cache.dtype(), "q must be float32 or the caches' dtype");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q, out and the caches must be contiguous");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && key_lens.dtype() == torch::kInt32, "int32 metadata");
  TORCH_CHECK(block_tables.is_contiguous() && key_lens.is_contiguous(), "contiguous metadata");
  TORCH_CHECK(key_lens.numel() == seqs.numel() && rows.numel() == seqs.numel(), "one key count and row per decode");
  TORCH_CHECK(seqs.dtype() == torch::kInt64 && rows.dtype() == torch::kInt64, "int64 seqs and rows");
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype(), "K and V caches must share a dtype");
  const bool f32q = q.dtype() == torch::kFloat32;
  if (k_cache.dtype() == torch::kFloat32) {
    decode_kernel<float, float>(q, k_cache, v_cache, block_tables, key_lens, seqs, rows, out, scale);
  } else if (k_cache.dtype() == torch::kBFloat16) {
    if (f32q) {
      decode_kernel<c10::BFloat16, float>(q, k_cache, v_cache, block_tables, key_lens, seqs, rows, out, scale);
    } else {
      decode_kernel<c10::BFloat16, c10::BFloat16>(q, k_cache, v_cache, block_tables, key_lens, seqs, rows, out, scale);
    }
  } else if (k_cache.dtype() == torch::kFloat16) {
    if (f32q) {
      decode_kernel<c10::Half, float>(q, k_cache, v_cache, block_tables, key_lens, seqs, rows, out, scale);
    } else {
      decode_kernel<c10::Half, c10::Half>(q, k_cache, v_cache, block_tables, key_lens, seqs, rows, out, scale);
    }
  } else {
    TORCH_CHECK(false, "unsupported cache dtype");
  }
}

// Grammar masks on CPU: the greedy pick among a row's allowed tokens, and a row's disallowed logits set
// to -inf for sampling.
//
// A mask has one bit per token (bit b of 32-bit word w: token 32 * w + b), as llguidance writes it. In
// a JSON or regex state most words are 0, so the greedy pick reads only the few cache lines that hold
// allowed tokens, and leaves the logits as they are (a row that asked for log-probabilities reports
// the model's own). Expanding the bits with torch costs 11 ms for 64 rows of a 49k vocabulary on a
// Zen 5; these loops cost what reading (or writing) the touched logits costs.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace {

void check(const torch::Tensor& logits, const torch::Tensor& rows, const torch::Tensor& bitmask,
           const torch::Tensor& any) {
  TORCH_CHECK(logits.dim() == 2 && logits.dtype() == torch::kFloat32 && logits.is_contiguous(),
              "token masks take contiguous 2-d fp32 logits");
  TORCH_CHECK(rows.dtype() == torch::kInt64 && rows.dim() == 1 && rows.is_contiguous(), "rows: [k] int64");
  TORCH_CHECK(bitmask.dtype() == torch::kInt32 && bitmask.dim() == 2 && bitmask.is_contiguous() &&
                  bitmask.size(0) == rows.size(0),
              "bitmask: [k, words] int32");
  TORCH_CHECK(any.dtype() == torch::kBool && any.numel() == rows.size(0) && any.is_contiguous(), "any: [k] bool");
  const int64_t n = logits.size(0);
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i) TORCH_CHECK(r[i] >= 0 && r[i] < n, "row out of range");
}

}  // namespace

// ids[i] = the first allowed token of row rows[i] with the largest logit; any[i] = some token is allowed.
void masked_argmax_cpu(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask, torch::Tensor ids,
                       torch::Tensor any) {
  check(logits, rows, bitmask, any);
  TORCH_CHECK(ids.dtype() == torch::kInt64 && ids.numel() == rows.size(0) && ids.is_contiguous(), "ids: [k] int64");
  const int64_t vocab = logits.size(1), words = bitmask.size(1);
  const int64_t last_word = std::min(words, (vocab + 31) / 32);
  const float* x = logits.data_ptr<float>();
  const int64_t* r = rows.data_ptr<int64_t>();
  const uint32_t* m = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  int64_t* id = ids.data_ptr<int64_t>();
  bool* ok = any.data_ptr<bool>();
  at::parallel_for(0, rows.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* row = x + r[i] * vocab;
      const uint32_t* mask = m + i * words;
      float best = -std::numeric_limits<float>::infinity();
      int64_t best_at = -1;
      for (int64_t w = 0; w < last_word; ++w) {
        uint32_t bits = mask[w];
        while (bits) {
          const int64_t t = w * 32 + __builtin_ctz(bits);
          bits &= bits - 1;
          if (t >= vocab) break;
          if (best_at < 0 || row[t] > best) {  // strictly greater: the first maximum stays
            best = row[t];
            best_at = t;
          }
        }
      }
      ok[i] = best_at >= 0;
      id[i] = best_at < 0 ? 0 : best_at;
    }
  });
}

// logits[rows[i], t] = -inf for every token t that bitmask[i] does not allow; any[i] = some token is allowed.
void apply_token_bitmask_cpu(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask, torch::Tensor any) {
  check(logits, rows, bitmask, any);
  const int64_t vocab = logits.size(1), words = bitmask.size(1);
  float* x = logits.data_ptr<float>();
  const int64_t* r = rows.data_ptr<int64_t>();
  const uint32_t* m = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  bool* ok = any.data_ptr<bool>();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = x + r[i] * vocab;
      const uint32_t* mask = m + i * words;
      bool allowed = false;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const int64_t base = w * 32, len = std::min<int64_t>(32, vocab - base);
        const uint32_t bits = w < words ? mask[w] : 0u;
        const uint32_t live = len == 32 ? bits : bits & ((1u << len) - 1u);
        allowed |= live != 0;
        if (bits == 0xffffffffu) continue;
        if (bits == 0) {
          std::fill(row + base, row + base + len, kNegInf);
          continue;
        }
        for (int64_t b = 0; b < len; ++b)
          if (!((bits >> b) & 1u)) row[base + b] = kNegInf;
      }
      ok[i] = allowed;
    }
  });
}

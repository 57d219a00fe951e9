// Writes a step's new keys and values into the paged caches on CPU: one row copy per token and cache.
//
// The torch reference is five ops per layer (the slots as int64, a check for skipped slots, two
// index_copy_ and their dtype casts): some 15 us of dispatch a layer at decode batch sizes, for a few
// KiB of data.
#include <torch/extension.h>

#include <cstring>

// key/value [n, kv_heads, head_dim]: rows may be strided (views of the fused qkv projection), each
// row's heads contiguous; caches [blocks, block_size, kv_heads, head_dim] contiguous, of the same
// dtype as key and value; slots [n] int32 or int64, block * block_size + offset, -1 to skip a token.
void write_kv_cpu(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor slots) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key and value must be [n, kv_heads, head_dim]");
  TORCH_CHECK(key.dtype() == k_cache.dtype() && value.dtype() == v_cache.dtype() && key.dtype() == value.dtype(),
              "key, value and the caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  const int64_t n = key.size(0), row = key.size(1) * key.size(2);
  TORCH_CHECK(k_cache.numel() > 0 && k_cache.numel() % row == 0 && v_cache.numel() == k_cache.numel(),
              "caches must hold whole rows of kv_heads * head_dim");
  for (const auto* t : {&key, &value})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "each token's heads must be contiguous");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == n, "one slot per token");
  const auto s64 = slots.to(torch::kInt64).contiguous();
  const int64_t* sp = s64.data_ptr<int64_t>();
  const int64_t capacity = k_cache.numel() / row;
  const int64_t bytes = row * key.element_size();
  const auto* kp = static_cast<const char*>(key.data_ptr());
  const auto* vp = static_cast<const char*>(value.data_ptr());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size(), v_stride = value.stride(0) * value.element_size();
  for (int64_t t = 0; t < n; ++t) {
    const int64_t slot = sp[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < capacity, "slot ", slot, " is outside the cache (", capacity, " slots)");
    std::memcpy(kc + slot * bytes, kp + t * k_stride, bytes);
    std::memcpy(vc + slot * bytes, vp + t * v_stride, bytes);
  }
}

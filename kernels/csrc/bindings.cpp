// The Python module of Loom's compiled CPU kernels (kernels/cpu_kernels.py builds it).
#include <torch/extension.h>

void paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                     torch::Tensor key_lens, torch::Tensor seqs, torch::Tensor rows, torch::Tensor out, double scale);
void lora_shrink_cpu(torch::Tensor x, torch::Tensor a, torch::Tensor slots, torch::Tensor order, torch::Tensor ranks,
                     torch::Tensor h);
void lora_expand_cpu(torch::Tensor y, torch::Tensor h, torch::Tensor b, torch::Tensor scales, torch::Tensor slots,
                     torch::Tensor order, torch::Tensor ranks);
void rms_norm_cpu(torch::Tensor x, torch::Tensor weight, double eps, torch::Tensor residual, torch::Tensor residual_out,
                  torch::Tensor out);
void silu_and_mul_cpu(torch::Tensor x, torch::Tensor out);
void rotary_cpu(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos_sin);
bool dense_available();
torch::Tensor dense_pack(torch::Tensor w);
void dense_cpu(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, torch::Tensor out);
int64_t dense_gate_width();
torch::Tensor dense_pack_gated(torch::Tensor w);
void dense_gated_cpu(torch::Tensor x, torch::Tensor packed, torch::Tensor out, bool split);
void argmax_rows_cpu(torch::Tensor logits, torch::Tensor ids, torch::Tensor finite);
void masked_argmax_cpu(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask, torch::Tensor ids,
                       torch::Tensor any);
void apply_token_bitmask_cpu(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask, torch::Tensor any);
void write_kv_cpu(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor slots);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels compute without the GIL, as torch's own operators do: in a served replica the event
  // loop and Ray's threads share the process with the engine thread, and a kernel holding the GIL for
  // its whole matmul left them waiting, then the engine waiting on them, with the cores idle.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_attention", &paged_attention, nogil, "paged attention over every query row (CPU)");
  m.def("write_kv", &write_kv_cpu, nogil, "store a step's keys and values in the paged caches (CPU)");
  m.def("lora_shrink", &lora_shrink_cpu, nogil, "multi-LoRA shrink (CPU, fp32)");
  m.def("lora_expand", &lora_expand_cpu, nogil, "multi-LoRA expand, added in place (CPU, fp32)");
  m.def("rms_norm", &rms_norm_cpu, nogil, "residual add + RMSNorm (CPU, fp32 or bf16)");
  m.def("silu_and_mul", &silu_and_mul_cpu, nogil, "SiLU-and-mul (CPU, fp32 or bf16)");
  m.def("dense_available", &dense_available, "whether dense_pack / dense_cpu were built (AVX-512)");
  m.def("dense_pack", &dense_pack, nogil, "pack an fp32 weight [N, K] into 32-column panels for dense_cpu");
  m.def("dense_cpu", &dense_cpu, nogil, "out = x @ W.T (+ bias) from a packed fp32 weight (CPU, AVX-512)");
  m.def("argmax_rows", &argmax_rows_cpu, nogil, "each row's first maximum and whether it is all finite (CPU, fp32)");
  m.def("masked_argmax", &masked_argmax_cpu, nogil, "each masked row's first maximum among its allowed tokens (CPU)");
  m.def("apply_token_bitmask", &apply_token_bitmask_cpu, nogil, "disallowed tokens of masked rows to -inf (CPU)");
  m.def("dense_gate_width", &dense_gate_width, "gate (and up) columns per paired panel; 0 without the kernel");
  m.def("dense_pack_gated", &dense_pack_gated, nogil, "pack a gated MLP's [gate; up] fp32 weight into paired panels");
  m.def("dense_gated_cpu", &dense_gated_cpu, nogil, "silu(x @ gate.T) * (x @ up.T), or with split [gate | up] (CPU)");
  m.def("rotary", &rotary_cpu, nogil, "rotary embedding in place, rotate-halves layout (CPU, fp32 or bf16 q/k)");
}

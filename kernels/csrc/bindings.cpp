// The Python module of Loom's compiled CPU kernels (kernels/cpu_kernels.py builds it).
#include <torch/extension.h>

void paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                  torch::Tensor seq_lens, torch::Tensor seqs, torch::Tensor rows, torch::Tensor out, double scale);
void lora_shrink_cpu(torch::Tensor x, torch::Tensor a, torch::Tensor slots, torch::Tensor order,
                     torch::Tensor ranks, torch::Tensor h);
void lora_expand_cpu(torch::Tensor y, torch::Tensor h, torch::Tensor b, torch::Tensor scales,
                     torch::Tensor slots, torch::Tensor order, torch::Tensor ranks);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)");
  m.def("lora_shrink", &lora_shrink_cpu, "multi-LoRA shrink (CPU, fp32)");
  m.def("lora_expand", &lora_expand_cpu, "multi-LoRA expand, added in place (CPU, fp32)");
}

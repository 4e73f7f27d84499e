// The CPU extension's Python module: the functions of bgmv_cpu.cpp and paged_attention_cpu.cpp.
#include <torch/extension.h>

#include <vector>

bool avx512_available();
bool avx512_bf16_available();
void bgmv(at::Tensor y, at::Tensor x, at::Tensor order, at::Tensor sid, std::vector<at::Tensor> A,
          std::vector<at::Tensor> BT, std::vector<at::Tensor> ranks, std::vector<int64_t> offsets, int64_t page,
          bool vec);
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                     at::Tensor tiles, int64_t block_size, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bgmv", &bgmv, "Multi-adapter LoRA, one adapter per row, in place on y (see bgmv_cpu.cpp)");
  m.def("avx512_available", &avx512_available, "Whether this CPU runs the AVX-512 path");
  m.def("avx512_bf16_available", &avx512_bf16_available, "Whether its bf16 shrink multiplies bf16 pairs");
  m.def("paged_attention", &paged_attention,
        "Attention of each row over its request's K/V read through the block table (see paged_attention_cpu.cpp)");
}

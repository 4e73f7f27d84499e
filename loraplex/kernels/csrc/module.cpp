// The CPU extension's Python module: the functions of bgmv_cpu.cpp, paged_attention_cpu.cpp,
// packed_gemm_cpu.cpp, gemm_cpu.cpp, greedy_head_cpu.cpp, first_max_cpu.cpp, rope_cpu.cpp,
// norm_act_cpu.cpp and layer_cpu.cpp.
//
// Every function that computes on tensors runs without the GIL (NOGIL below; bgmv and paged_attention let
// it go themselves, after their checks): under `loraplex serve` the engine thread shares its process with
// the server's event loop, which would otherwise wait out each kernel before it could read a request or
// write a token's SSE event. Arguments are converted and results returned with the GIL held; an error
// (TORCH_CHECK) takes it back before it becomes a Python exception.
#include "entry_points.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto NOGIL = py::call_guard<py::gil_scoped_release>();
  m.def("bgmv", &bgmv, "Multi-adapter LoRA, one adapter per row, in place on y (see bgmv_cpu.cpp)");
  m.def("avx512_available", &avx512_available, "Whether this CPU runs the AVX-512 path");
  m.def("bgmv_lanes", &bgmv_lanes, "The lanes of the path bgmv takes for fp32 or not, capped at max_lanes: 16, 8 or 0");
  m.def("avx2_available", &avx2_available, "Whether this CPU has AVX2 + FMA (the fp32 AVX2 paths of bgmv and gemm_linear)");
  m.def("avx512_bf16_available", &avx512_bf16_available, "Whether its bf16 shrink multiplies bf16 pairs");
  m.def("paged_attention", &paged_attention,
        "Attention of each row over its request's K/V read through the block table, after writing k and v "
        "(if given) to their slots (see paged_attention_cpu.cpp)",
        py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("tiles"), py::arg("block_size"), py::arg("scale"), py::arg("k") = py::none(),
        py::arg("v") = py::none(), py::arg("slot_mapping") = py::none());
  m.def("rope_inplace", &rope_inplace, NOGIL, "RoPE in place on the first heads of each row, fp32 or bf16 (see rope_cpu.cpp)");
  m.def("add_rms_norm", &add_rms_norm, NOGIL, "x += r in place, then RMSNorm of x, fp32 or bf16 (see norm_act_cpu.cpp)");
  m.def("silu_mul", &silu_mul, NOGIL, "silu(gate) * up of a fused [T, 2I] gate/up output, fp32 or bf16 (see norm_act_cpu.cpp)");
  m.def("gemm_floats", &gemm_floats, "Floats of gemm_pack's result for an [N, K] weight and isa (avx2 or avx512)",
        py::arg("n"), py::arg("k"), py::arg("isa"));
  m.def("gemm_pack", &gemm_pack, NOGIL,
        "An fp32 [N, K] weight packed in panels for gemm_linear's isa (avx2 or avx512); glu = I: a [gate; up] "
        "weight with its panels interleaved",
        py::arg("weight"), py::arg("isa"), py::arg("glu") = 0);
  m.def("gemm_linear", &gemm_linear, NOGIL,
        "x @ weight^T (+ bias) on a weight packed for isa; act (glu only): silu(gate) x up (see gemm_cpu.cpp)",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("isa"), py::arg("bias") = py::none(),
        py::arg("glu") = 0, py::arg("act") = false);
  m.def("greedy_head_pack", &greedy_head_pack, NOGIL, "An fp32 [V, K] lm_head weight as bf16 pairs in greedy_head's panels");
  m.def("greedy_head", &greedy_head, NOGIL,
        "(tokens, candidates): each row's argmax of x @ weight^T by a bf16 screen and an exact fp32 recheck, "
        "-1 where the row is left to the caller (see greedy_head_cpu.cpp)",
        py::arg("x"), py::arg("packed"), py::arg("norms"), py::arg("weight"));
  m.def("first_max", &first_max, NOGIL,
        "Each row's first largest value's index of fp32 logits [B, V] (logits.max(dim=-1).indices), -1 for a "
        "row holding a NaN; path: auto, avx512, avx2 or scalar (see first_max_cpu.cpp)",
        py::arg("logits"), py::arg("path") = "auto");
  m.def("packed_gemm_available", &packed_gemm_available, "Whether this PyTorch's MKL has the packed GEMM");
  m.def("packed_gemm_pack", &packed_gemm_pack, NOGIL, "An fp32 [N, K] weight packed for packed_gemm_linear");
  m.def("packed_gemm_bytes", &packed_gemm_bytes, "Bytes of a packed [N, K] weight");
  m.def("packed_gemm_linear", &packed_gemm_linear, NOGIL, "x @ weight^T (+ bias) on a packed weight (see packed_gemm_cpu.cpp)",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  // lets the GIL go itself around its kernels (paged_attention checks its indices with it held)
  m.def("decoder_layer", &decoder_layer,
        "One Llama decoder layer on packed fp32 weights in one call: the same kernels as the Python layer, in "
        "its order (see layer_cpu.cpp)");
}

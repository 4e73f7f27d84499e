// The CPU extension's entry points: the functions module.cpp binds for Python, declared once for it and
// for the files that call one another's (layer_cpu.cpp calls the GEMM, RoPE, attention and norm kernels).
// Each is defined, with its documentation, in the .cpp file module.cpp names for it.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

bool avx512_available();
bool avx512_bf16_available();
bool avx2_available();
void bgmv(at::Tensor y, at::Tensor x, at::Tensor order, at::Tensor sid, std::vector<at::Tensor> A,
          std::vector<at::Tensor> BT, std::vector<at::Tensor> ranks, std::vector<int64_t> offsets, int64_t page,
          int64_t max_lanes);
int64_t bgmv_lanes(bool fp32, int64_t max_lanes);
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                     at::Tensor tiles, int64_t block_size, double scale, const c10::optional<at::Tensor>& k,
                     const c10::optional<at::Tensor>& v, c10::optional<at::Tensor> slot_mapping);
void rope_inplace(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim);
at::Tensor add_rms_norm(at::Tensor x, const at::Tensor& r, const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
int64_t gemm_floats(int64_t n, int64_t k, const std::string& isa);
at::Tensor gemm_pack(const at::Tensor& weight, const std::string& isa, int64_t glu);
at::Tensor gemm_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::string& isa,
                       const c10::optional<at::Tensor>& bias, int64_t glu, bool act);
at::Tensor greedy_head_pack(const at::Tensor& weight);
std::vector<at::Tensor> greedy_head(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& norms,
                                    const at::Tensor& weight);
at::Tensor first_max(const at::Tensor& logits, const std::string& path);
bool packed_gemm_available();
at::Tensor packed_gemm_pack(const at::Tensor& weight);
int64_t packed_gemm_bytes(int64_t n, int64_t k);
at::Tensor packed_gemm_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                              const c10::optional<at::Tensor>& bias);
at::Tensor decoder_layer(at::Tensor x, const at::Tensor& h, const at::Tensor& qkv_w,
                         const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& o_w, const at::Tensor& gate_up_w,
                         const at::Tensor& down_w, const std::string& isa, int64_t inter, const at::Tensor& cos,
                         const at::Tensor& sin, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                         const at::Tensor& tiles, int64_t block_size, const at::Tensor& slot_mapping,
                         const at::Tensor& post_norm_w, double post_eps, const at::Tensor& next_norm_w,
                         double next_eps);

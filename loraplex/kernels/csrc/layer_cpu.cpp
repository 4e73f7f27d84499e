// One decoder layer of the default model's architecture (Llama: pre-norm attention and SwiGLU MLP) in one
// call, from the kernels the Python layer calls one by one: the q/k/v GEMM, RoPE in place, the K/V write
// and the attention, the o GEMM, residual add + RMSNorm, the gate/up GEMM with SiLU x up, the down GEMM and
// the next norm's residual add + RMSNorm. The same functions in the same order on the same tensors, so
// the same bits as engine/model.py's DecoderLayer.forward takes through them (tested).
//
// Letters: T rows of the step, H hidden size, nH and nKV query and kv heads, D head dim, I intermediate
// size.
//
// Why: the Python between those nine calls (module calls, the checks that choose each kernel, views)
// took about 8 ms of a 187 ms 64-row decode step of the vllm preset on a Zen 4 EPYC, though under 2 ms
// when timed alone: after each kernel has streamed its weights or K/V through the caches, the
// interpreter's own code and objects are cold. vLLM's CUDA path captures the whole forward in CUDA graphs
// for the same reason; SGLang's CPU backend fuses the projections and RoPE into one op.
//
// The GIL is let go for the GEMMs and elementwise kernels, as module.cpp does for each of them;
// paged_attention checks its indices with the GIL held and then lets it go itself.
#include "entry_points.h"

#include <cmath>

// x [T, H] fp32, the residual stream (updated in place); h [T, H] = the layer's input norm of x. Weights
// packed by gemm_pack for `isa`: qkv [nH D + 2 nKV D, H] (bias: [nH D + 2 nKV D] or None), o [H, nH D],
// gate_up [2I, H] packed with glu = I, down [H, I]. cos, sin [T, D]: RoPE at each row's position. The
// caches, block tables, tiles and slot mapping as paged_attention takes them. Returns next_norm(x after
// the layer) [T, H]. Raises (TORCH_CHECK) where a kernel does: shapes, dtypes, indices out of range.
at::Tensor decoder_layer(at::Tensor x, const at::Tensor& h, const at::Tensor& qkv_w,
                         const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& o_w, const at::Tensor& gate_up_w,
                         const at::Tensor& down_w, const std::string& isa, int64_t inter, const at::Tensor& cos,
                         const at::Tensor& sin, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                         const at::Tensor& tiles, int64_t block_size, const at::Tensor& slot_mapping,
                         const at::Tensor& post_norm_w, double post_eps, const at::Tensor& next_norm_w,
                         double next_eps) {
  const int64_t rows = x.size(0), hidden = x.size(1), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  at::Tensor qkv;
  {
    pybind11::gil_scoped_release no_gil;
    qkv = gemm_linear(h, qkv_w, q_size + 2 * kv_size, isa, qkv_bias, 0, false);  // [T, nH D + 2 nKV D]
    rope_inplace(qkv, cos, sin, heads + kv_heads, head_dim);
  }
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({rows, heads, head_dim});
  const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, kv_heads, head_dim});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, kv_heads, head_dim});
  at::Tensor out = at::empty({rows, heads, head_dim}, qkv.options());
  // the scale as Python's head_dim ** -0.5 computes it (C's pow), so the same float reaches the kernel
  paged_attention(out, q, k_cache, v_cache, block_tables, tiles, block_size, std::pow(double(head_dim), -0.5), k, v,
                  slot_mapping);
  pybind11::gil_scoped_release no_gil;
  const at::Tensor a = gemm_linear(out.view({rows, q_size}), o_w, hidden, isa, c10::nullopt, 0, false);
  const at::Tensor h2 = add_rms_norm(x, a, post_norm_w, post_eps);
  const at::Tensor m = gemm_linear(h2, gate_up_w, 2 * inter, isa, c10::nullopt, inter, true);  // [T, I]
  return add_rms_norm(x, gemm_linear(m, down_w, hidden, isa, c10::nullopt, 0, false), next_norm_w, next_eps);
}

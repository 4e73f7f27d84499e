// fp32 linear layers on weights packed once for MKL's GEMM (cblas_sgemm_pack / cblas_sgemm_compute).
//
// Letters: M rows of x, K in features, N out features.
//
// Why: for a decode batch (M of 2 to a few hundred) an sgemm on a plain weight spends much of its time
// packing that weight into the kernel's blocked layout, every call; with the weight packed at load time
// the call only computes. On a 2-core AVX-512 Xeon, one thread, the default model's 30 layers of
// q/k/v, o, gate/up and down weights, cold in cache: 1.5x at 8-32 rows, 1.3-1.4x at 64, 1.1x at 256,
// none at 512 (docs/performance.md). vLLM prepacks its CPU linear weights for the same reason (oneDNN).
//
// MKL ships inside PyTorch's libtorch_cpu, which exports the packed-GEMM entry points; they are declared
// weak here, so a PyTorch built without MKL still loads this library and `available()` says false.
// The packed buffer's size does not depend on M (MKL's pack_get_size returns the same for every M), and
// one buffer serves every M, as close to the exact product as F.linear (tested; for some shapes equal to
// F.linear bit for bit, for others MKL blocks K differently). The buffer is about 8 MB plus 1.3-2x the
// weight's bytes.
#include <torch/extension.h>

#include <cstdint>

extern "C" {
// MKL's LP64 CBLAS interface (MKL_INT is int); enum values from mkl_cblas.h.
__attribute__((weak)) size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k);
__attribute__((weak)) void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha,
                                            const float* src, int ld, float* dest);
__attribute__((weak)) void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k,
                                               const float* a, int lda, const float* b, int ldb, float beta,
                                               float* c, int ldc);
}

namespace {
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162;
constexpr int kPackHintRows = 64;  // MKL asks for an M when packing B; the buffer serves every M
}  // namespace

bool packed_gemm_available() {
  return cblas_sgemm_pack_get_size != nullptr && cblas_sgemm_pack != nullptr && cblas_sgemm_compute != nullptr;
}

// weight [N, K] fp32 (an nn.Linear's) -> an opaque uint8 buffer holding weight^T packed for
// cblas_sgemm_compute. The buffer must not be copied to another address (MKL's rule), so callers keep
// the returned tensor as it is (no .clone(), .to()).
at::Tensor packed_gemm_pack(const at::Tensor& weight) {
  TORCH_CHECK(packed_gemm_available(), "this PyTorch has no MKL packed GEMM");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "packed_gemm_pack: weight must be a 2-D fp32 CPU tensor, got ", weight.sizes(), " ",
              weight.scalar_type());
  at::Tensor w = weight.contiguous();
  const int n = static_cast<int>(w.size(0)), k = static_cast<int>(w.size(1));
  const size_t bytes = cblas_sgemm_pack_get_size(kBMatrix, kPackHintRows, n, k);
  at::Tensor packed = at::empty({static_cast<int64_t>(bytes)}, w.options().dtype(at::kByte));
  cblas_sgemm_pack(kRowMajor, kBMatrix, kTrans, kPackHintRows, n, k, 1.0f, w.data_ptr<float>(), k,
                   reinterpret_cast<float*>(packed.data_ptr<uint8_t>()));
  return packed;
}

int64_t packed_gemm_bytes(int64_t n, int64_t k) {
  TORCH_CHECK(packed_gemm_available(), "this PyTorch has no MKL packed GEMM");
  return static_cast<int64_t>(cblas_sgemm_pack_get_size(kBMatrix, kPackHintRows, n, k));
}

// x [M, K] fp32, packed from packed_gemm_pack of an [N, K] weight, bias [N] or None -> [M, N] =
// x @ weight^T (+ bias). With a bias the output starts as the bias and the GEMM adds to it (beta = 1),
// as PyTorch's addmm does.
at::Tensor packed_gemm_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                              const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "packed_gemm_linear: x must be a 2-D fp32 CPU tensor");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed_gemm_linear: not a packed buffer");
  at::Tensor a = x.stride(1) == 1 && x.stride(0) >= x.size(1) ? x : x.contiguous();
  const int m = static_cast<int>(a.size(0)), k = static_cast<int>(a.size(1));
  // MKL's buffer has a fixed part (about 8 MB) and does not record the shape, so the caller keeps N and K
  // with it (cpu_gemm.py); what is checked here is that MKL cannot read past its end.
  TORCH_CHECK(packed.numel() >= packed_gemm_bytes(n, k), "packed_gemm_linear: the buffer is too small for an [",
              n, ", ", k, "] weight");
  at::Tensor out = at::empty({m, n}, a.options());
  float beta = 0.0f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kFloat, "packed_gemm_linear: bias must be [N] fp32");
    out.copy_(bias->reshape({1, n}).expand({m, n}));  // a copy even at m = 1, where contiguous() is the bias
    beta = 1.0f;
  }
  if (m == 0) return out;
  cblas_sgemm_compute(kRowMajor, kNoTrans, kPacked, m, static_cast<int>(n), k, a.data_ptr<float>(),
                      static_cast<int>(a.stride(0)), reinterpret_cast<const float*>(packed.data_ptr<uint8_t>()), k,
                      beta, out.data_ptr<float>(), static_cast<int>(n));
  return out;
}

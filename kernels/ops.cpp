#include "kernels/ops.h"

#include <atomic>

#include "core/error.h"
#ifdef SG_WITH_CUDA
#include "kernels/cuda/runtime.h"
#endif

namespace sg::kernels {

namespace {
// Atomic: the op profiler (kernels/profile.h) swaps a table while communication threads run ops.
std::atomic<const OpTable*>& slot(DeviceType t) {
  static std::atomic<const OpTable*> tables[kNumDeviceTypes] = {nullptr, nullptr, nullptr};
  return tables[int(t)];
}
}  // namespace

void register_table(DeviceType t, const OpTable* table) { slot(t) = table; }

const OpTable& table(Device d) {
#ifdef SG_WITH_CUDA
  if (d.is_cuda() && !slot(d.type)) cuda::ensure_registered();
#endif
  const OpTable* t = slot(d.type);
  if (!t && !d.is_cuda()) {
    extern const OpTable* cpu_table();
    extern const OpTable* meta_table();
    const OpTable* none = nullptr;
    slot(d.type).compare_exchange_strong(none, d.is_cpu() ? cpu_table() : meta_table());
    t = slot(d.type);
  }
  SG_CHECK(t, "no kernels registered for device ", d.str(), " (was shardgrad built with CUDA?)");
  return *t;
}

void select_attention(const std::string& name, Device d) {
  SG_CHECK(name == "flash" || name == "cudnn", "--attention must be flash or cudnn, got '", name, "'");
  SG_CHECK(name == "flash" || d.is_cuda(), "--attention cudnn runs on a CUDA device, not ", d.str(),
           " (use --attention flash)");
#ifdef SG_WITH_CUDA
  cuda::set_attention_backend(name == "cudnn" ? cuda::AttentionBackend::cudnn : cuda::AttentionBackend::flash);
#else
  SG_CHECK(name == "flash", "--attention cudnn: this build has no CUDA backend (CMake found no CUDA toolkit)");
#endif
}

double half_peak_tflops_of(const std::string& name) {
  const auto has = [&](const char* part) { return name.find(part) != std::string::npos; };
  if (has("H100") || has("H200")) {  // GH200 too; the NVL parts are left out (not in the table)
    if (has("NVL")) return 0;
    return has("PCIe") ? 756 : 989;
  }
  return has("A100") ? 312 : 0;
}

double half_peak_tflops(Device d) {
#ifdef SG_WITH_CUDA
  if (d.is_cuda()) return half_peak_tflops_of(cuda::device_name(d));
#endif
  (void)d;
  return 0;
}

void check_adamw_batch(const AdamWArgs* args, int64_t count, const char* device) {
  for (int64_t i = 0; i < count; ++i) {
    const AdamWArgs& a = args[i];
    const DType g = a.grad_type();
    SG_CHECK(g == a.dtype || (a.dtype == DType::f32 && is_half(g)), "adamw (", device, "): tensor ", i, " has a ",
             dtype_name(g), " gradient for a ", dtype_name(a.dtype), " parameter (only bf16/f16 beside f32)");
    SG_CHECK(!a.copy || a.grad_dtype, "adamw (", device, "): tensor ", i,
             " names a copy without a half-precision gradient type (grad_dtype) to round it to");
    SG_CHECK(g == args[0].grad_type(), "adamw_many (", device, "): tensor ", i, " has a ", dtype_name(g),
             " gradient, tensor 0 a ", dtype_name(args[0].grad_type()), " one");
  }
  for (int64_t i = 1; i < count; ++i) {
    const AdamWArgs &a = args[0], &b = args[i];
    SG_CHECK(b.dtype == a.dtype && b.lr == a.lr && b.beta1 == a.beta1 && b.beta2 == a.beta2 && b.eps == a.eps &&
                 b.grad_scale == a.grad_scale && b.step == a.step,
             "adamw_many (", device, "): tensor ", i, " of ", count, " has dtype/lr/betas/eps/grad_scale/step (",
             dtype_name(b.dtype), ", ", b.lr, ", ", b.beta1, ", ", b.beta2, ", ", b.eps, ", ", b.grad_scale, ", ", b.step,
             ") unlike tensor 0's (", dtype_name(a.dtype), ", ", a.lr, ", ", a.beta1, ", ", a.beta2, ", ", a.eps, ", ",
             a.grad_scale, ", ", a.step, "); only weight_decay may differ");
  }
}

void check_gemm_epilogue(const GemmArgs& g, const char* device) {
  const bool forward = g.bias || g.gelu || g.pre_gelu || g.residual, backward = g.dgelu_pre || g.bias_grad;
  if (forward || backward)
    SG_CHECK(g.batch == 1 && g.ldc == g.N, "gemm (", device, "): a ",
             forward ? "bias, GELU or residual" : "dgelu or bias_grad", " epilogue needs one contiguous C (batch ",
             g.batch, ", ldc ", g.ldc, ", N ", g.N, ")");
  SG_CHECK(!g.gelu || g.beta == 0.0, "gemm (", device, "): the GELU epilogue needs beta = 0, got ", g.beta);
  SG_CHECK(!g.pre_gelu || g.gelu, "gemm (", device, "): pre_gelu given without gelu");
  SG_CHECK(!g.residual || (g.beta == 0.0 && !g.gelu && g.residual != g.C), "gemm (", device,
           "): the residual epilogue needs beta = 0, no GELU and a residual that is not C (beta ", g.beta, ", gelu ",
           g.gelu, ", residual ", g.residual == g.C ? "is" : "is not", " C)");
  SG_CHECK(!backward || g.beta == 0.0, "gemm (", device, "): the dgelu and bias_grad epilogues need beta = 0, got ",
           g.beta);
  SG_CHECK(!(forward && backward), "gemm (", device, "): a forward epilogue (bias, gelu, residual) and a backward ",
           "one (dgelu_pre, bias_grad) in one call");
  if (g.row_sums_a)
    SG_CHECK(g.batch == 1 && g.lda == (g.trans_a ? g.M : g.K), "gemm (", device,
             "): row_sums_a needs one contiguous A (batch ", g.batch, ", lda ", g.lda, ", ", g.trans_a ? "M " : "K ",
             g.trans_a ? g.M : g.K, ")");
}

void unsupported(const char* op, DType dtype, const char* device) {
  throw Error(str("op '", op, "' does not support dtype ", dtype_name(dtype), " on ", device));
}

}  // namespace sg::kernels

// The meta device's op table (core/device.h): every kernel does nothing, since a meta tensor has
// no values, and a copy to the host writes zeros, so the host-side code between kernels (a loss
// read with item(), a norm for clipping) runs unchanged. The checks that do not read values stay:
// a GEMM's epilogue and an AdamW batch are refused on meta as on any device.
#include <cstring>

#include "kernels/ops.h"

namespace sg::kernels {

const OpTable* meta_table() {
  static const OpTable t = [] {
    OpTable o;
    o.device_name = "meta";
    const auto nothing = [](auto...) {};
    o.copy_strided = nothing;
    o.scatter_strided = nothing;
    o.fill = nothing;
    o.binary = nothing;
    o.unary = nothing;
    o.unary_backward = nothing;
    o.reduce = nothing;
    o.gemm = [](const GemmArgs& g) { check_gemm_epilogue(g, "meta"); };
    o.softmax = nothing;
    o.softmax_backward = nothing;
    o.layernorm = nothing;
    o.layernorm_backward = nothing;
    o.residual_layernorm = nothing;
    o.residual_layernorm_backward = nothing;
    o.rmsnorm = nothing;
    o.rmsnorm_backward = nothing;
    o.embedding = nothing;
    o.embedding_backward = nothing;
    o.cross_entropy = nothing;
    o.cross_entropy_backward = nothing;
    o.cross_entropy_fused = nothing;
    o.dropout = nothing;
    o.attention = nothing;
    o.attention_backward = nothing;
    o.random = nothing;
    o.adamw = nothing;
    o.adamw_many = [](const AdamWArgs* args, int64_t count) { check_adamw_batch(args, count, "meta"); };
    o.sum_squares_many = [](DType, const void* const*, const int64_t*, const double*, int64_t) { return 0.0; };
    o.copy_to_host = [](void* host_dst, const void*, size_t bytes, Device) { std::memset(host_dst, 0, bytes); };
    o.copy_from_host = nothing;
    return o;
  }();
  return &t;
}

}  // namespace sg::kernels

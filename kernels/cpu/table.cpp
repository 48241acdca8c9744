#include "kernels/cpu/cpu.h"

namespace sg::kernels {

const OpTable* cpu_table() {
  static const OpTable t = [] {
    OpTable o;
    o.device_name = "cpu";
    o.copy_strided = cpu::copy_strided;
    o.scatter_strided = cpu::scatter_strided;
    o.fill = cpu::fill;
    o.binary = cpu::binary;
    o.unary = cpu::unary;
    o.unary_backward = cpu::unary_backward;
    o.reduce = cpu::reduce;
    o.sum_squares_many = cpu::sum_squares_many;
    o.gemm = cpu::gemm;
    o.softmax = cpu::softmax;
    o.softmax_backward = cpu::softmax_backward;
    o.layernorm = cpu::layernorm;
    o.layernorm_backward = cpu::layernorm_backward;
    o.residual_layernorm = cpu::residual_layernorm;
    o.residual_layernorm_backward = cpu::residual_layernorm_backward;
    o.rmsnorm = cpu::rmsnorm;
    o.rmsnorm_backward = cpu::rmsnorm_backward;
    o.embedding = cpu::embedding;
    o.embedding_backward = cpu::embedding_backward;
    o.cross_entropy = cpu::cross_entropy;
    o.cross_entropy_backward = cpu::cross_entropy_backward;
    o.cross_entropy_fused = cpu::cross_entropy_fused;
    o.dropout = cpu::dropout;
    o.attention = cpu::attention;
    o.attention_backward = cpu::attention_backward;
    o.random = cpu::random;
    o.adamw = cpu::adamw;
    o.adamw_many = cpu::adamw_many;
    return o;
  }();
  return &t;
}

}  // namespace sg::kernels

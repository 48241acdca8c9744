// Implementations of one op that stay side by side until a GPU measurement picks one; the loser is
// then removed and its figures kept in bench/RESULTS.md (README, "Kernel variants awaiting a GPU").
// Plain C++: the CUDA runtime side (runtime.h) and the kernels, real or emulated, both include it.
#pragma once
#include <cstdint>

namespace sg::cuda {

// How the LayerNorm/RMSNorm backward sums dw/db (kernels/cuda/layernorm.cuh):
//   fused       in its input-gradient kernel, each lane's column sums in registers (the default);
//   smem        in its input-gradient kernel, each warp's column sums in shared memory, the row
//               read again for the second pass (L1 or L2);
//   smem_ahead  as smem, with dr read in the first pass beside dy and x (held in registers until
//               the second pass adds it);
//   split       by a second kernel that reads dy and x again.
// The three in-kernel ones need 16-byte rows of at most 1024 columns; elsewhere every choice runs
// split (norm_backward_runs).
enum class NormBackward : uint8_t { fused, smem, smem_ahead, split };

inline const char* name(NormBackward k) {
  switch (k) {
    case NormBackward::fused: return "fused";
    case NormBackward::smem: return "smem";
    case NormBackward::smem_ahead: return "smem_ahead";
    case NormBackward::split: return "split";
  }
  return "?";
}

// How the fused classifier (loss and dlogits in one call, kernels/cuda/classifier.cuh) reads a row:
//   streaming  twice from memory, the second pass partly from L2 (the default);
//   staged     once, into shared memory, both passes reading it there: rows of at most 110 KiB
//              (GPT-2's 50304 bf16 logits are 98 KiB), 16-byte aligned; elsewhere streaming.
enum class Classifier : uint8_t { streaming, staged };

inline const char* name(Classifier k) { return k == Classifier::staged ? "staged" : "streaming"; }

}  // namespace sg::cuda

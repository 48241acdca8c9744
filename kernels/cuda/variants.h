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
//              (GPT-2's 50304 bf16 logits are 98 KiB), 16-byte aligned; elsewhere streaming;
//   reversed   as streaming, the second pass walking the row from its end: the pieces the first
//              pass read last, the likeliest to be still in L2, are read again first, and those
//              last reads and the stores are marked evict-first (ld/st.global.cs). At GPT-2's
//              shapes the rows in flight (4 blocks an SM x 132 SMs x 98 KiB, 52 MiB) outgrow the
//              50 MiB L2, so a second pass in the first one's order meets the evicted start first.
// streaming and reversed do the same arithmetic (the same bits); staged's 1024 threads sum the
// row in another order.
enum class Classifier : uint8_t { streaming, staged, reversed };
inline constexpr Classifier kClassifiers[] = {Classifier::streaming, Classifier::staged, Classifier::reversed};

inline const char* name(Classifier k) {
  return k == Classifier::staged ? "staged" : k == Classifier::reversed ? "reversed" : "streaming";
}

// How the embedding backward's block for a run of equal rows (kernels/cuda/embedding.cuh) reads
// its dout rows, each column summed in position order either way (the same bits):
//   columns  a thread per column, one element a load, 8 positions in flight (the default);
//   packs    a thread per 16 bytes of columns, one 16-byte load a position, 8 positions in
//            flight: a sixth of the blocks at GPT-2's C = 768 in bf16 (one of 96 threads a run,
//            against six of 128), 102 registers a thread against 36. Rows of 16-byte
//            multiples, 16-byte aligned; elsewhere columns.
enum class EmbeddingBackward : uint8_t { columns, packs };

inline const char* name(EmbeddingBackward k) { return k == EmbeddingBackward::packs ? "packs" : "columns"; }

// How cuDNN's attention backward gets its f32 dQ accumulator (B·H·T·D floats of workspace,
// kernels/cuda/attention_cudnn.cpp):
//   memset    zeroed by a cudaMemsetAsync before each backward (the default): what cuDNN before
//             9.6.0 needs, and there the only choice, whatever the GPU measurement says;
//   engine    handed over as the allocator gives it: from cuDNN 9.6.0 the engine zeroes it itself
//             (cudnn-frontend memsets it only for older backends);
//   poisoned  filled with NaN bytes first: for tests, whose backward is then right only if the
//             engine zeroes the accumulator itself.
enum class DqAccumulator : uint8_t { memset, engine, poisoned };

inline const char* name(DqAccumulator k) {
  return k == DqAccumulator::memset ? "memset" : k == DqAccumulator::engine ? "engine" : "poisoned";
}

// The registers of the tensor-core attention backward's two kernels at head dim 64
// (kernels/cuda/attention_tc.cuh), through __launch_bounds__' blocks per SM (same values):
//   free      as ptxas likes: dk/dv 250 registers a thread, dq 176, so 2 blocks of 128 threads an
//             SM each (8 warps; the default);
//   dq_three  dq fitted to 3 blocks an SM (168 registers, 12 bytes spilled), dk/dv free;
//   three     both fitted to 3 (dk/dv spills 68 bytes).
// Head dim 128 stays free (its dk/dv spills already at 255 registers).
enum class FlashBackward : uint8_t { free, dq_three, three };

inline const char* name(FlashBackward k) {
  return k == FlashBackward::free ? "free" : k == FlashBackward::dq_three ? "dq_three" : "three";
}

// Keys per shared-memory tile of the tensor-core attention forward at head dim 64
// (kernels/cuda/attention_tc.cuh; head dim 128 stays at 32, whose 64 would pass the 48 KiB of
// static shared memory):
//   keys32  32 keys a tile (the default): per warp 16 x 32 scores, 32 mma between the block's syncs;
//   keys64  64 keys a tile, as FlashAttention-2 takes more at this head dim: half the syncs, tile
//           loads and rescales of the running output per key, twice the score registers.
// Rows see the same keys in another grouping, so the online softmax rounds differently: the
// results agree to rounding, not to the bit.
enum class FlashForward : uint8_t { keys32, keys64 };

inline const char* name(FlashForward k) { return k == FlashForward::keys64 ? "keys64" : "keys32"; }

}  // namespace sg::cuda

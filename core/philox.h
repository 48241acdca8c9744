// Counter-based Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3").
// A random number is a pure function of (seed, stream, index): element i of a tensor gets the
// same value whichever rank, shard or device computes it, so every layout can replay the
// single-process run exactly.
#pragma once
#include <array>
#include <cmath>
#include <cstdint>

#include "core/hash.h"

#ifdef __CUDACC__
#define SG_HD __host__ __device__
#else
#define SG_HD
#endif

namespace sg {

struct Philox {
  using Block = std::array<uint32_t, 4>;
  static SG_HD inline void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
    uint64_t p = uint64_t(a) * uint64_t(b);
    hi = uint32_t(p >> 32);
    lo = uint32_t(p);
  }
  // 10 rounds over the counter (c0..c3) with key (k0, k1).
  static SG_HD inline void block(uint32_t c[4], uint32_t k0, uint32_t k1) {
    for (int r = 0; r < 10; ++r) {
      uint32_t hi0, lo0, hi1, lo1;
      mulhilo(0xD2511F53u, c[0], hi0, lo0);
      mulhilo(0xCD9E8D57u, c[2], hi1, lo1);
      uint32_t n0 = hi1 ^ c[1] ^ k0, n1 = lo1, n2 = hi0 ^ c[3] ^ k1, n3 = lo0;
      c[0] = n0; c[1] = n1; c[2] = n2; c[3] = n3;
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
  }
  // Four 32-bit words for (seed, stream, index).
  static SG_HD inline void words(uint64_t seed, uint64_t stream, uint64_t index, uint32_t out[4]) {
    out[0] = uint32_t(index);
    out[1] = uint32_t(index >> 32);
    out[2] = uint32_t(stream);
    out[3] = uint32_t(stream >> 32);
    block(out, uint32_t(seed), uint32_t(seed >> 32));
  }
  // Uniform in [0, 1) with 24 bits.
  static SG_HD inline float uniform(uint64_t seed, uint64_t stream, uint64_t index) {
    uint32_t w[4];
    words(seed, stream, index, w);
    return float(w[0] >> 8) * (1.0f / 16777216.0f);
  }
  // Standard normal by Box-Muller on two words of the same block.
  static SG_HD inline float normal(uint64_t seed, uint64_t stream, uint64_t index) {
    uint32_t w[4];
    words(seed, stream, index, w);
    float u1 = (float(w[0] >> 8) + 1.0f) * (1.0f / 16777216.0f);  // (0, 1]
    float u2 = float(w[1] >> 8) * (1.0f / 16777216.0f);
    return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853071795864f * u2);
  }
};

// Stream ids keep independent uses of the same seed apart.
inline uint64_t rng_stream_from_name(const char* s) {  // a parameter's name picks its init stream
  return fnv1a(std::string_view(s), kFnvShortBasis);
}

}  // namespace sg

// Element types. bf16 and f16 are storage types: kernels do their math in f32.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>

#include "core/error.h"

namespace sg {

enum class DType : uint8_t { f32, f64, bf16, f16, i32, i64 };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
  }
  return "?";
}

inline bool is_floating(DType t) { return t == DType::f32 || t == DType::f64 || t == DType::bf16 || t == DType::f16; }
inline bool is_half(DType t) { return t == DType::bf16 || t == DType::f16; }

// Accepts the CLI spellings too: fp32, float32, bf16, fp16, float16, ...
DType parse_dtype(const std::string& s);

// bf16: the top 16 bits of an f32, rounded to nearest even.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

}  // namespace sg

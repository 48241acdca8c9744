// The GEMM algorithms that tuning chose (kernels/cuda/gemm_cublaslt.cpp, SG_GEMM_TUNE), kept in a
// text file (SG_GEMM_TUNE_FILE) so that later processes, and every rank of a job, run the same
// algorithms without timing them again, as PyTorch's TunableOp keeps its results file.
//
// Plain C++ (no CUDA): the file is read, checked and written here. It names the cuBLASLt version
// and the card it was tuned on, and a file of another library or card is refused, not used; each
// algorithm read is checked again by cuBLASLt against its GEMM before it runs.
//
//   # shardgrad GEMM choices ...                      (comments and blank lines are skipped)
//   cublaslt 130100
//   device NVIDIA H200 sm_90
//   gemm bf16 68 0 1 8192 2304 768 768 768 2304 1 0 0 0 1 0 256 256 256 256 256 256 | <8 hex words> | <workspace bytes> | <ms>
#pragma once
#include <array>
#include <compare>
#include <cstdint>
#include <map>
#include <string>

#include "core/dtype.h"

namespace sg::cuda {

// Everything about one GEMM that cuBLASLt's heuristic reads, in the file's order: the dtype, the
// compute type and epilogue (cuBLASLt's enum values), the transposes, whether a residual is the
// source C, the sizes, leading dimensions and batch strides (cuBLASLt's column-major call), and
// each pointer's alignment in bytes.
struct GemmShape {
  DType dtype = DType::f32;
  int32_t compute = 0, epilogue = 0;
  bool trans_a = false, trans_b = false, residual = false;
  int64_t M = 0, N = 0, K = 0, lda = 0, ldb = 0, ldc = 0, batch = 1, stride_a = 0, stride_b = 0, stride_c = 0;
  uint32_t align_a = 0, align_b = 0, align_c = 0, align_d = 0, align_vector = 0, align_aux = 0;
  auto operator<=>(const GemmShape&) const = default;
};

// A tuned algorithm: cuBLASLt's opaque cublasLtMatmulAlgo_t (8 words), the workspace it asked
// for and its median time when it was chosen.
struct GemmChoice {
  std::array<uint64_t, 8> algo{};
  uint64_t workspace = 0;
  double ms = 0;
};

struct GemmChoices {
  std::string cublaslt, device;  // what the file was tuned with; empty in a file not yet written
  std::map<GemmShape, GemmChoice> choices;
};

std::string format_gemm_choices(const GemmChoices& c);
// Throws naming path and the line for anything it cannot read back exactly.
GemmChoices parse_gemm_choices(const std::string& text, const std::string& path);
// No file at path: no choices and no validators (the first tuned GEMM writes it).
GemmChoices read_gemm_choices(const std::string& path);
// Replaces path whole (temporary file, then rename): a crash leaves the old file or the new one.
void write_gemm_choices(const std::string& path, const GemmChoices& c);
// Throws, naming path, when c was tuned with another cuBLASLt or on another card.
void check_gemm_choices(const GemmChoices& c, const std::string& path, const std::string& cublaslt,
                        const std::string& device);
// One line's key, as the file writes it (for messages).
std::string describe(const GemmShape& s);

}  // namespace sg::cuda

// Embedding family on the CPU: row gather forward, scatter-add backward in a fixed order.
#include <cstring>

#include "kernels/cpu/cpu.h"

namespace sg::kernels::cpu {

void embedding(DType dtype, DType idx_dtype, void* out, const void* idx, const void* weight, int64_t n, int64_t C,
               int64_t num_rows) {
  const size_t row_bytes = size_t(C) * dtype_size(dtype);
  for (int64_t i = 0; i < n; ++i) {
    int64_t r = read_index(idx_dtype, idx, i);
    SG_CHECK(r >= 0 && r < num_rows, "embedding: index ", r, " out of range for a table of ", num_rows, " rows");
    std::memcpy(static_cast<char*>(out) + i * int64_t(row_bytes), static_cast<const char*>(weight) + r * int64_t(row_bytes),
                row_bytes);
  }
}

// dweight[idx[i], :] += dout[i, :]  ('+='), rows visited in index order so sums are deterministic.
void embedding_backward(DType dtype, DType idx_dtype, void* dweight, const void* dout, const void* idx, int64_t n,
                        int64_t C, int64_t num_rows) {
  dispatch_float(dtype, "embedding_backward", [&](auto tag) {
    using T = decltype(tag);
    auto* dw = static_cast<T*>(dweight);
    auto* g = static_cast<const T*>(dout);
    for (int64_t i = 0; i < n; ++i) {  // all checked before any row is written
      const int64_t r = read_index(idx_dtype, idx, i);
      SG_CHECK(r >= 0 && r < num_rows, "embedding_backward: index ", r, " out of range for a table of ", num_rows,
               " rows");
    }
    for (int64_t i = 0; i < n; ++i) {
      T* row = dw + read_index(idx_dtype, idx, i) * C;
      const T* gi = g + i * C;
      for (int64_t c = 0; c < C; ++c) row[c] += gi[c];
    }
  });
}

}  // namespace sg::kernels::cpu

// safetensors read/write: an 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype", "shape", "data_offsets": [begin, end)}, "__metadata__": {str: str}},
// then the raw little-endian tensor bytes. Every field of a file we read is validated.
#pragma once
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace sg::io {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// Writes atomically: a temporary file in the same directory, fsync, then rename over path.
// Tensors may be on any device and any layout; they are written contiguous in their dtype.
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;  // CPU tensors; meta ones (shape and dtype only) for those not read
  std::vector<std::string> order;         // names in file order
  std::map<std::string, std::string> metadata;
  const Tensor& at(const std::string& name) const;  // throws naming the file and the tensor
  bool has(const std::string& name) const { return tensors.count(name) != 0; }
  std::string path;
};

// Reads the tensors `want` names (every one when it is empty); the others come back as meta
// tensors of their dtype and shape, their bytes not read: a pipeline rank reads its stages' alone,
// a header's shapes cost no more than the header. Throws sg::Error naming the file and the problem
// for anything malformed or truncated, whatever is read.
using TensorFilter = std::function<bool(const std::string& name)>;
SafetensorsFile load_safetensors(const std::string& path, const TensorFilter& want = {});

}  // namespace sg::io

// libFuzzer: a sharded checkpoint's index.json is the input, next to a fixed 16-byte rank file.
// Opening validates the index (paths stay inside the directory, boxes inside their tensors, exact
// cover, byte ranges inside the files); reading every tensor checks sizes and checksums. Anything
// malformed must end in sg::Error, with allocations bounded by the files on disk.
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "parallel/sharded_checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fs = std::filesystem;
  static const fs::path dir = [] {
    fs::path d = fs::temp_directory_path() / ("sg_fuzz_sharded_" + std::to_string(::getpid())) / "step_00000001";
    fs::remove_all(d);
    fs::create_directories(d);
    // A safetensors file holding one F32 [4] tensor "w#0" = 1, 2, 3, 4: its data at bytes [72, 88).
    std::string header = R"({"w#0":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})";
    header.append((8 - header.size() % 8) % 8, ' ');
    const uint64_t n = header.size();
    const float values[4] = {1, 2, 3, 4};
    std::ofstream f(d / "rank_00000.safetensors", std::ios::binary);
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << header;
    f.write(reinterpret_cast<const char*>(values), sizeof values);
    return d;
  }();
  std::ofstream(dir / "index.json", std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), std::streamsize(size));
  try {
    sg::ckpt::ShardedCheckpoint c(dir.string());
    for (const auto& name : c.names()) (void)c.tensor(name);
  } catch (const sg::Error&) {
  }
  return 0;
}

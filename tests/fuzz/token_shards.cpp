// libFuzzer: the llm.c token-shard reader validates magic, version and length against the file.
#include "core/error.h"
#include "io/token_shards.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = sg::fuzz::write_input(data, size, ".bin");
  try {
    (void)sg::io::token_shard_size(path);
    (void)sg::io::read_token_shard(path);
    (void)sg::io::split_token_shards({path}, 0.1);
  } catch (const sg::Error&) {
  }
  return 0;
}

// libFuzzer: the flag parser, fed NUL-separated arguments, either parses them or refuses with
// sg::Error naming the flag; typed reads of every flag do the same.
#include <vector>

#include "cli/args.h"
#include "core/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> words(1);
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == 0) words.emplace_back();
    else words.back().push_back(char(data[i]));
  }
  std::vector<char*> argv;
  for (auto& w : words) argv.push_back(w.data());
  sg::cli::Args a("fuzz", "flag parser under fuzzing");
  a.flag("steps", "10", "");
  a.flag("lr", "1e-3", "");
  a.flag("data", "synthetic", "");
  a.toggle("shuffle", "");
  try {
    if (a.parse(int(argv.size()), argv.data())) {
      (void)a.i64("steps");
      (void)a.f64("lr");
      (void)a.str("data");
      (void)a.on("shuffle");
    }
  } catch (const sg::Error&) {
  }
  return 0;
}

// libFuzzer: the multiple-choice eval file reader (HellaSwag, llm.c's format) validates the header,
// each example's marker, index, size, label and lengths against the file; the rows built from what
// it accepts stay within the model's positions. The same bytes as HellaSwag jsonl: bad lines end in
// sg::Error naming the line.
#include "core/error.h"
#include "io/multiple_choice.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = sg::fuzz::write_input(data, size, ".bin");
  try {
    const auto ex = sg::io::read_choice_file(path);
    for (size_t i = 0; i < ex.size(); ++i) (void)sg::io::choice_rows(ex, i, 1, 16, 2);
  } catch (const sg::Error&) {
  }
  try {
    (void)sg::io::hellaswag_from_jsonl(path, [](const std::string& s) { return std::vector<int64_t>(s.begin(), s.end()); });
  } catch (const sg::Error&) {
  }
  return 0;
}

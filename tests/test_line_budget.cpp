// tinygrad's habit (STYLE.md): the core stays small enough to read in a sitting, and the count is
// watched by the tests rather than by memory. core/ and autograd/ (tensors, storage, layouts, the
// ledger, the tape and the primitive ops' derivatives) get a budget of lines of code: lines that
// are neither blank nor only a // comment. Raising the budget is a decision for a commit message,
// not an accident; kernels, models and parallel strategies are outside it.
#include "tests/catch.h"

#include <filesystem>
#include <fstream>
#include <string>

namespace fs = std::filesystem;

namespace {

constexpr int kCoreBudget = 3500;  // 3,143 on 2026-11-29

int lines_of_code(const fs::path& file) {
  std::ifstream in(file);
  int n = 0;
  for (std::string line; std::getline(in, line);) {
    const size_t first = line.find_first_not_of(" \t\r");
    if (first != std::string::npos && line.compare(first, 2, "//") != 0) ++n;
  }
  return n;
}

}  // namespace

TEST_CASE("core and autograd stay within their line budget", "[style]") {
  int total = 0, files = 0;
  for (const char* dir : {"core", "autograd"}) {
    const fs::path root = fs::path(SG_SOURCE_DIR) / dir;
    REQUIRE(fs::is_directory(root));
    for (const auto& e : fs::recursive_directory_iterator(root)) {
      const auto ext = e.path().extension();
      if (!e.is_regular_file() || (ext != ".h" && ext != ".cpp")) continue;
      total += lines_of_code(e.path());
      ++files;
    }
  }
  INFO("core + autograd: " << total << " lines of code in " << files << " files; budget " << kCoreBudget);
  CHECK(files > 20);  // the walk found the sources
  CHECK(total > 1000);
  CHECK(total <= kCoreBudget);
}

// The GEMM tuning file (kernels/cuda/gemm_choices.h, SG_GEMM_TUNE_FILE), without a GPU: what is
// written reads back exactly, the file is replaced whole, a file of another cuBLASLt or card is
// refused, and every malformed line is refused naming the file and the line. The GPU side (a tuned
// run writes it, a later one runs its algorithms) is tests/gpu/kernels.cpp's.
#include "tests/catch.h"
#include <unistd.h>

#include <filesystem>
#include <string>

#include "core/error.h"
#include "io/file.h"
#include "kernels/cuda/gemm_choices.h"

using namespace sg;
using namespace sg::cuda;
using Catch::Contains;
namespace fs = std::filesystem;

namespace {

GemmChoices two_choices() {
  GemmChoices c;
  c.cublaslt = "130100", c.device = "NVIDIA H200 sm_90";
  GemmShape a;
  a.dtype = DType::bf16, a.compute = 68, a.epilogue = 1, a.trans_b = true;
  a.M = 8192, a.N = 2304, a.K = 768, a.lda = 768, a.ldb = 768, a.ldc = 2304;
  a.align_a = a.align_b = a.align_c = a.align_d = a.align_vector = a.align_aux = 256;
  GemmShape b = a;  // differs in one field only: its own line
  b.align_vector = 16;
  b.residual = true;
  c.choices[a] = GemmChoice{{0x0123456789abcdefull, 0, 1, 2, 3, 4, 5, ~0ull}, 33554432, 0.0571};
  c.choices[b] = GemmChoice{{7, 6, 5, 4, 3, 2, 1, 0}, 0, 1.5};
  return c;
}

// A valid file with its first gemm line replaced by `line`.
std::string with_line(const std::string& line) {
  std::string text = format_gemm_choices(two_choices());
  const size_t at = text.find("\ngemm ") + 1;
  return text.substr(0, at) + line + text.substr(text.find('\n', at));
}

void refused(const std::string& line, const std::string& message) {
  INFO(line);
  REQUIRE_THROWS_WITH(parse_gemm_choices(with_line(line), "g.tune"), Contains(message) && Contains("g.tune line 6"));
}

}  // namespace

TEST_CASE("the GEMM tuning file reads back what it wrote: every key field, the algorithm's words, workspace and time",
          "[gemm_choices]") {
  const GemmChoices c = two_choices();
  const std::string text = format_gemm_choices(c);
  const GemmChoices back = parse_gemm_choices(text, "g.tune");
  CHECK(back.cublaslt == c.cublaslt);
  CHECK(back.device == c.device);
  REQUIRE(back.choices.size() == 2);
  for (const auto& [shape, choice] : c.choices) {
    INFO(describe(shape));
    auto it = back.choices.find(shape);
    REQUIRE(it != back.choices.end());
    CHECK(it->second.algo == choice.algo);
    CHECK(it->second.workspace == choice.workspace);
    CHECK(it->second.ms == Approx(choice.ms).epsilon(1e-3));
  }
  CHECK(format_gemm_choices(back) == text);
  CHECK_THAT(text, Contains("gemm bf16 68 1 0 1 0 8192 2304 768 768 768 2304 1 0 0 0 256 256 256 256 256 256 | "
                            "0123456789abcdef 0000000000000000"));
  CHECK_THAT(text, Contains("ffffffffffffffff | 33554432 | 0.0571\n"));
  // comments, blank lines and CRLF endings are skipped
  const GemmChoices crlf = parse_gemm_choices("# a note\n\r\ncublaslt 1\r\ndevice X sm_90\n", "g.tune");
  CHECK(crlf.cublaslt == "1");
  CHECK(crlf.choices.empty());
}

TEST_CASE("the GEMM tuning file is replaced whole and a missing one holds nothing", "[gemm_choices]") {
  const fs::path dir = fs::temp_directory_path() / ("sg_gemm_choices_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string path = (dir / "gemm.tune").string();
  const GemmChoices none = read_gemm_choices(path);
  CHECK(none.cublaslt.empty());
  CHECK(none.choices.empty());
  CHECK_FALSE(fs::exists(path));

  GemmChoices c = two_choices();
  write_gemm_choices(path, c);
  CHECK(read_gemm_choices(path).choices.size() == 2);
  c.choices.erase(c.choices.begin());
  write_gemm_choices(path, c);
  const GemmChoices one = read_gemm_choices(path);
  REQUIRE(one.choices.size() == 1);
  CHECK(one.choices.begin()->first == c.choices.begin()->first);
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir)) files += e.is_regular_file();
  CHECK(files == 1);  // no temporary file left beside it

  // a file that cannot be read back is refused, not taken for empty
  io::write_text_atomic(path, "test", "cublaslt 1\ngarbage\n");
  REQUIRE_THROWS_WITH(read_gemm_choices(path), Contains(path) && Contains("line 2"));
  fs::remove_all(dir);
}

TEST_CASE("a GEMM tuning file of another cuBLASLt or another card is refused, naming both", "[gemm_choices]") {
  const GemmChoices c = two_choices();
  REQUIRE_NOTHROW(check_gemm_choices(c, "g.tune", "130100", "NVIDIA H200 sm_90"));
  REQUIRE_THROWS_WITH(check_gemm_choices(c, "g.tune", "130000", "NVIDIA H200 sm_90"),
                      Contains("SG_GEMM_TUNE_FILE g.tune was tuned with cuBLASLt 130100 on NVIDIA H200 sm_90") &&
                          Contains("this process runs cuBLASLt 130000 on NVIDIA H200 sm_90"));
  REQUIRE_THROWS_WITH(check_gemm_choices(c, "g.tune", "130100", "NVIDIA H100 80GB HBM3 sm_90"),
                      Contains("on NVIDIA H100 80GB HBM3 sm_90"));
  REQUIRE_NOTHROW(check_gemm_choices(GemmChoices{}, "g.tune", "130000", "anything"));  // not written yet
}

TEST_CASE("every malformed line of a GEMM tuning file is refused, naming the file and the line", "[gemm_choices]") {
  const std::string key = "bf16 68 1 0 1 0 8192 2304 768 768 768 2304 1 0 0 0 256 256 256 256 256 256";
  const std::string algo = "1 2 3 4 5 6 7 8";
  REQUIRE_NOTHROW(parse_gemm_choices(with_line("gemm " + key + " | " + algo + " | 0 | 0.5"), "g.tune"));
  refused("gemm " + key + " | " + algo + " | 0", "4 parts separated by '|', got 3");
  refused("gemm " + key + " 7 | " + algo + " | 0 | 0.5", "22 fields, got 23");
  refused("gemm " + key + " | 1 2 3 4 5 6 7 | 0 | 0.5", "8 words, got 7");
  refused("gemm " + key + " | 1 2 3 4 5 6 7 xyz | 0 | 0.5", "algorithm word 'xyz' is not a number");
  refused("gemm " + key + " | " + algo + " | 12k | 0.5", "workspace '12k' is not a number");
  refused("gemm " + key + " | " + algo + " | 0 | -1", "time '-1' is not a number of milliseconds");
  refused("gemm " + key + " | " + algo + " | 0 | inf", "time 'inf' is not a number of milliseconds");
  refused("gemm " + key + " | " + algo + " | 0 | 1e30", "time '1e30'");  // would not print back in full
  refused("gemm " + key + " | " + algo + " | 0 1 | 0.5", "one workspace size and one time");
  refused("gemm q8 " + key.substr(5) + " | " + algo + " | 0 | 0.5", "unknown dtype 'q8'");
  refused("gemm bf16 68 1 0 2 0" + key.substr(15) + " | " + algo + " | 0 | 0.5", "key field 5 is a flag (0 or 1)");
  refused("gemm " + key.substr(0, key.size() - 3) + "24 | " + algo + " | 0 | 0.5", "alignment 24 is not a power of two");
  refused("gemm " + key.substr(0, key.size() - 3) + "512 | " + algo + " | 0 | 0.5", "alignment 512");
  refused("gemm bf16 6x" + key.substr(7) + " | " + algo + " | 0 | 0.5", "key field '6x' is not a number");
  refused("gem " + key, "expected 'cublaslt', 'device' or 'gemm', got 'gem'");
  refused("cublaslt 2", "a second 'cublaslt' line");
  refused("device", "'device' without a value");
  // the same GEMM twice: which line would win is not for the reader to guess
  const std::string line = "gemm " + key + " | " + algo + " | 0 | 0.5";
  REQUIRE_THROWS_WITH(parse_gemm_choices(with_line(line + "\n" + line), "g.tune"),
                      Contains("g.tune line 7: a second line for GEMM bf16 68 1 0 1 0 8192"));
  // choices without the validators that say what they were tuned with
  REQUIRE_THROWS_WITH(parse_gemm_choices("gemm " + key + " | " + algo + " | 0 | 0.5\n", "g.tune"),
                      Contains("g.tune: needs both its 'cublaslt' and 'device' lines"));
  REQUIRE_THROWS_WITH(parse_gemm_choices("cublaslt 1\n", "g.tune"), Contains("needs both"));
}

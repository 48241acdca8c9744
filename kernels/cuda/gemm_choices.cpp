#include "kernels/cuda/gemm_choices.h"

#include <charconv>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "io/file.h"

namespace sg::cuda {

namespace {

constexpr const char* kWhat = "SG_GEMM_TUNE_FILE";
constexpr const char* kHeader =
    "# shardgrad GEMM choices: written by SG_GEMM_TUNE=1 with SG_GEMM_TUNE_FILE, read by SG_GEMM_TUNE_FILE.\n"
    "# gemm dtype compute epilogue trans_a trans_b residual M N K lda ldb ldc batch stride_a stride_b stride_c\n"
    "#      align_a align_b align_c align_d align_bias align_aux | cublasLtMatmulAlgo_t (8 hex words) | workspace"
    " bytes | median ms\n";

// The key's integer fields after the dtype, in the file's order.
std::vector<int64_t> numbers(const GemmShape& s) {
  return {s.compute,  s.epilogue, s.trans_a,  s.trans_b,  s.residual, s.M,       s.N,       s.K,
          s.lda,      s.ldb,      s.ldc,      s.batch,    s.stride_a, s.stride_b, s.stride_c, s.align_a,
          s.align_b,  s.align_c,  s.align_d,  s.align_vector, s.align_aux};
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

template <class T>
T number(const std::string& w, int base, const std::string& where, const char* field) {
  T v{};
  const auto [end, ec] = std::from_chars(w.data(), w.data() + w.size(), v, base);
  SG_CHECK(ec == std::errc() && end == w.data() + w.size(), where, ": ", field, " '", w, "' is not a number");
  return v;
}

}  // namespace

std::string describe(const GemmShape& s) {
  std::string out = dtype_name(s.dtype);
  for (int64_t v : numbers(s)) out += str(" ", v);
  return out;
}

std::string format_gemm_choices(const GemmChoices& c) {
  std::string out = kHeader;
  out += str("cublaslt ", c.cublaslt, "\ndevice ", c.device, "\n");
  for (const auto& [shape, choice] : c.choices) {
    out += str("gemm ", describe(shape), " |");
    char word[24];
    for (uint64_t w : choice.algo) {
      std::snprintf(word, sizeof(word), " %016llx", static_cast<unsigned long long>(w));
      out += word;
    }
    std::snprintf(word, sizeof(word), " | %.4f", choice.ms);
    out += str(" | ", choice.workspace, word, "\n");
  }
  return out;
}

GemmChoices parse_gemm_choices(const std::string& text, const std::string& path) {
  GemmChoices c;
  bool have_cublaslt = false, have_device = false;
  std::istringstream in(text);
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    const std::string where = str(kWhat, " ", path, " line ", n);
    const size_t first = line.find_first_not_of(" \t\r");
    if (first == std::string::npos || line[first] == '#') continue;
    line.erase(line.find_last_not_of(" \t\r") + 1);  // CRLF endings, trailing blanks
    const size_t space = line.find(' ', first);
    const std::string word = line.substr(first, space == std::string::npos ? std::string::npos : space - first);
    const std::string rest = space == std::string::npos ? "" : line.substr(space + 1);
    if (word == "cublaslt" || word == "device") {
      std::string& v = word == "cublaslt" ? c.cublaslt : c.device;
      bool& have = word == "cublaslt" ? have_cublaslt : have_device;
      SG_CHECK(!rest.empty(), where, ": '", word, "' without a value");
      SG_CHECK(!have, where, ": a second '", word, "' line");
      v = rest;
      have = true;
      continue;
    }
    SG_CHECK(word == "gemm", where, ": expected 'cublaslt', 'device' or 'gemm', got '", word, "'");
    std::vector<std::string> parts;
    for (size_t at = 0, bar; at <= rest.size(); at = bar + 1) {
      bar = rest.find('|', at);
      if (bar == std::string::npos) bar = rest.size();
      parts.push_back(rest.substr(at, bar - at));
    }
    SG_CHECK(parts.size() == 4, where, ": a gemm line has 4 parts separated by '|', got ", parts.size());
    const std::vector<std::string> key = split(parts[0]), algo = split(parts[1]), ws = split(parts[2]),
                                   ms = split(parts[3]);
    SG_CHECK(key.size() == 22, where, ": the GEMM's key has 22 fields, got ", key.size());
    SG_CHECK(algo.size() == 8, where, ": the algorithm has 8 words, got ", algo.size());
    SG_CHECK(ws.size() == 1 && ms.size() == 1, where, ": one workspace size and one time expected");
    GemmShape s;
    try {
      s.dtype = parse_dtype(key[0]);
    } catch (const Error&) {
      SG_CHECK(false, where, ": unknown dtype '", key[0], "'");
    }
    std::vector<int64_t> v;
    for (size_t i = 1; i < key.size(); ++i) v.push_back(number<int64_t>(key[i], 10, where, "key field"));
    for (int i : {2, 3, 4}) SG_CHECK(v[i] == 0 || v[i] == 1, where, ": key field ", i + 2, " is a flag (0 or 1)");
    for (size_t i = 15; i < v.size(); ++i)
      SG_CHECK(v[i] > 0 && v[i] <= 256 && (v[i] & (v[i] - 1)) == 0, where, ": alignment ", v[i],
               " is not a power of two up to 256");
    s.compute = int32_t(v[0]), s.epilogue = int32_t(v[1]);
    s.trans_a = v[2], s.trans_b = v[3], s.residual = v[4];
    s.M = v[5], s.N = v[6], s.K = v[7], s.lda = v[8], s.ldb = v[9], s.ldc = v[10], s.batch = v[11];
    s.stride_a = v[12], s.stride_b = v[13], s.stride_c = v[14];
    s.align_a = uint32_t(v[15]), s.align_b = uint32_t(v[16]), s.align_c = uint32_t(v[17]);
    s.align_d = uint32_t(v[18]), s.align_vector = uint32_t(v[19]), s.align_aux = uint32_t(v[20]);
    GemmChoice choice;
    for (int i = 0; i < 8; ++i) choice.algo[size_t(i)] = number<uint64_t>(algo[size_t(i)], 16, where, "algorithm word");
    choice.workspace = number<uint64_t>(ws[0], 10, where, "workspace");
    const auto [end, ec] = std::from_chars(ms[0].data(), ms[0].data() + ms[0].size(), choice.ms);
    SG_CHECK(ec == std::errc() && end == ms[0].data() + ms[0].size() && choice.ms >= 0 && choice.ms < 1e9, where,
             ": time '", ms[0], "' is not a number of milliseconds (0 to 1e9)");
    SG_CHECK(c.choices.emplace(s, choice).second, where, ": a second line for GEMM ", describe(s));
  }
  SG_CHECK((have_cublaslt && have_device) || (c.choices.empty() && !have_cublaslt && !have_device), kWhat, " ", path,
           ": needs both its 'cublaslt' and 'device' lines");
  return c;
}

GemmChoices read_gemm_choices(const std::string& path) {
  if (!std::filesystem::exists(path)) return {};
  return parse_gemm_choices(io::read_file(path, kWhat), path);
}

void write_gemm_choices(const std::string& path, const GemmChoices& c) {
  io::write_text_atomic(path, kWhat, format_gemm_choices(c));
}

void check_gemm_choices(const GemmChoices& c, const std::string& path, const std::string& cublaslt,
                        const std::string& device) {
  if (c.cublaslt.empty()) return;  // nothing tuned yet
  SG_CHECK(c.cublaslt == cublaslt && c.device == device, kWhat, " ", path, " was tuned with cuBLASLt ", c.cublaslt,
           " on ", c.device, ", this process runs cuBLASLt ", cublaslt, " on ", device,
           ": point SG_GEMM_TUNE_FILE at another file (SG_GEMM_TUNE=1 fills it) or remove this one");
}

}  // namespace sg::cuda

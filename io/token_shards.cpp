#include "io/token_shards.h"

#include <glob.h>

#include <algorithm>
#include <bit>
#include <filesystem>

#include "core/error.h"
#include "io/file.h"

namespace sg::io {

static_assert(std::endian::native == std::endian::little, "token shards are little-endian, as is this host");

void write_token_shard(const std::string& path, const std::vector<uint16_t>& tokens) {
  SG_CHECK(int64_t(tokens.size()) <= INT32_MAX, "token shard ", path, ": ", tokens.size(),
           " tokens do not fit the header's int32 count");
  int32_t header[256] = {};
  header[0] = kShardMagic;
  header[1] = kShardVersion;
  header[2] = int32_t(tokens.size());
  write_file_atomic(path, "token shard", [&](const ByteSink& sink) {
    sink(header, sizeof(header));
    sink(tokens.data(), tokens.size() * sizeof(uint16_t));
  });
}

namespace {

int64_t validated_size(const ReadFile& f) {
  const std::string& path = f.path();
  const int32_t count =
      read_llmc_header(f, "token shard", kShardMagic, kShardVersion, "not an llm.c token shard?", "token").count;
  const int64_t want = kShardHeaderBytes + 2 * int64_t(count);
  SG_CHECK(f.size() == want, "token shard ", path, ": the header says ", count, " tokens (", want,
           " bytes with the header) but the file is ", f.size(), " bytes");
  return count;
}

bool has_glob_chars(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

}  // namespace

int64_t token_shard_size(const std::string& path) { return validated_size(ReadFile(path, "token shard")); }

std::vector<uint16_t> read_token_shard(const std::string& path) {
  ReadFile f(path, "token shard");
  std::vector<uint16_t> tokens(size_t(validated_size(f)));  // bounded by the file's length
  f.read_at(tokens.data(), tokens.size() * 2, kShardHeaderBytes);
  return tokens;
}

std::vector<std::string> expand_glob(const std::string& pattern, const std::string& what) {
  std::error_code ec;
  if (!has_glob_chars(pattern) || std::filesystem::is_regular_file(pattern, ec)) {  // a file of that very name
    SG_CHECK(std::filesystem::exists(pattern), what, " ", pattern, ": no such file");
    return {pattern};
  }
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> files;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) files.emplace_back(g.gl_pathv[i]);
  ::globfree(&g);
  SG_CHECK(rc == 0 || rc == GLOB_NOMATCH, what, " ", pattern, ": glob failed (code ", rc, ")");
  SG_CHECK(!files.empty(), what, " ", pattern, ": no files match the pattern");
  std::sort(files.begin(), files.end());  // byte order, whatever the locale's collation
  return files;
}

ShardSplit split_token_shards(const std::vector<std::string>& files, double val_fraction) {
  SG_CHECK(!files.empty(), "split_token_shards: no files");
  auto range = [](const std::string& f) { return TokenRange{f, kShardHeaderBytes, 2, 0, token_shard_size(f)}; };
  ShardSplit s;
  if (files.size() == 1) {
    TokenRange all = range(files[0]);
    const int64_t val = int64_t(double(all.count) * val_fraction);
    s.train.push_back({all.path, all.data_offset, 2, 0, all.count - val});
    s.val.push_back({all.path, all.data_offset, 2, all.count - val, val});
    return s;
  }
  for (const std::string& f : files) {
    const bool is_val = std::filesystem::path(f).filename().string().find("val") != std::string::npos;
    (is_val ? s.val : s.train).push_back(range(f));
  }
  if (s.val.empty()) {  // all train: hold out the last
    s.val.push_back(s.train.back());
    s.train.pop_back();
  } else if (s.train.empty()) {  // all val: train on all but the last
    s.train.assign(s.val.begin(), s.val.end() - 1);
    s.val.erase(s.val.begin(), s.val.end() - 1);
  }
  return s;
}

}  // namespace sg::io

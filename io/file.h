// Plain POSIX file access for io/: positioned reads that either return every byte asked for or
// throw naming the file, and atomic replacement (temporary file, fsync, rename, fsync the folder).
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace sg::io {

// A read-only file descriptor that closes itself.
class ReadFile {
 public:
  // `what` prefixes every error ("safetensors", "token shard", ...).
  ReadFile(const std::string& path, const std::string& what);
  ~ReadFile();
  ReadFile(const ReadFile&) = delete;
  ReadFile& operator=(const ReadFile&) = delete;

  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // Exactly n bytes at offset, or an error that says how many were missing.
  void read_at(void* dst, size_t n, int64_t offset) const;

 private:
  std::string path_, what_;
  int fd_ = -1;
  int64_t size_ = 0;
};

// Lets `write` fill PATH.tmp-<pid> (same folder) through a ByteSink, fsyncs it, renames it over path
// and fsyncs the folder, so a crash leaves either the old file or the new one, never a torn one. The
// temporary file is removed when anything throws.
using ByteSink = std::function<void(const void* data, size_t n)>;
void write_file_atomic(const std::string& path, const std::string& what,
                       const std::function<void(const ByteSink&)>& write);

// llm.c's binary files (token shards, eval files) open with a header of 256 little-endian int32
// words: a magic number, a version, a count, then fields of each format's own. Checks that the
// file holds the header, the magic (`hint` says what the file is not), the version and a count
// >= 0 ("negative <count_name> count"), and returns the first four words; errors name `what` and
// the file.
constexpr int64_t kLlmcHeaderBytes = 256 * 4;
constexpr int32_t kShardMagic = 20240520;   // a token shard (io/token_shards.h)
constexpr int32_t kChoiceMagic = 20240522;  // a multiple-choice eval file (io/multiple_choice.h)
struct LlmcHeader {
  int32_t magic, version, count, field3;  // field3: the eval file's longest example in bytes
};
LlmcHeader read_llmc_header(const ReadFile& f, const std::string& what, int32_t magic, int32_t version,
                            const std::string& hint, const std::string& count_name);

// The whole file's bytes; errors name `what` and the file.
std::string read_file(const std::string& path, const std::string& what);

// write_file_atomic of text's bytes.
void write_text_atomic(const std::string& path, const std::string& what, const std::string& text);

// Creates the folder that is to hold path (with its missing parents), so that an output named on
// the command line fails before the work that produces it, not after; the error names `what`
// (the flag) and the reason. A path that is a folder itself, or ends in '/' (a folder, made or
// not), is refused the same way, before any folder is made.
void make_parent_folder(const std::string& path, const std::string& what);

}  // namespace sg::io

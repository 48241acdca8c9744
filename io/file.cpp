#include "io/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace sg::io {

namespace {

std::string errno_str() { return std::strerror(errno); }

void close_quietly(int fd) {
  if (fd >= 0) ::close(fd);
}

}  // namespace

ReadFile::ReadFile(const std::string& path, const std::string& what) : path_(path), what_(what) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  SG_CHECK(fd_ >= 0, what_, " ", path_, ": cannot open (", errno_str(), ")");
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    const std::string why = S_ISDIR(st.st_mode) ? "is a directory" : "is not a regular file";
    close_quietly(fd_);
    fd_ = -1;
    throw Error(str(what_, " ", path_, ": ", why));
  }
  size_ = int64_t(st.st_size);
}

ReadFile::~ReadFile() { close_quietly(fd_); }

void ReadFile::read_at(void* dst, size_t n, int64_t offset) const {
  auto* p = static_cast<char*>(dst);
  size_t done = 0;
  while (done < n) {
    ssize_t got = ::pread(fd_, p + done, n - done, off_t(offset + int64_t(done)));
    if (got < 0 && errno == EINTR) continue;
    SG_CHECK(got >= 0, what_, " ", path_, ": read of ", n, " bytes at offset ", offset, " failed (", errno_str(), ")");
    SG_CHECK(got > 0, what_, " ", path_, ": file ended after ", offset + int64_t(done), " bytes; expected ", n,
             " bytes at offset ", offset, " (was it truncated while open?)");
    done += size_t(got);
  }
}

void write_file_atomic(const std::string& path, const std::string& what,
                       const std::function<void(const ByteSink&)>& write) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());

  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  SG_CHECK(fd >= 0, what, " ", path, ": cannot create ", tmp, " (", errno_str(), ")");
  try {
    write([&](const void* data, size_t n) {
      const char* p = static_cast<const char*>(data);
      while (n > 0) {
        ssize_t w = ::write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        SG_CHECK(w > 0, what, " ", path, ": write to ", tmp, " failed (", errno_str(), ")");
        p += w;
        n -= size_t(w);
      }
    });
    SG_CHECK(::fsync(fd) == 0, what, " ", path, ": fsync of ", tmp, " failed (", errno_str(), ")");
    const int rc = ::close(fd);
    fd = -1;
    SG_CHECK(rc == 0, what, " ", path, ": close of ", tmp, " failed (", errno_str(), ")");
    SG_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, what, " ", path, ": rename from ", tmp, " failed (",
             errno_str(), ")");
  } catch (...) {
    close_quietly(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  // The rename is durable only once the folder entry is on disk.
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  SG_CHECK(dfd >= 0, what, " ", path, ": cannot open folder ", dir.string(), " to fsync it (", errno_str(), ")");
  const int rc = ::fsync(dfd);
  const std::string why = errno_str();
  ::close(dfd);
  SG_CHECK(rc == 0, what, " ", path, ": fsync of folder ", dir.string(), " failed (", why, ")");
}

LlmcHeader read_llmc_header(const ReadFile& f, const std::string& what, int32_t magic, int32_t version,
                            const std::string& hint, const std::string& count_name) {
  const std::string& path = f.path();
  SG_CHECK(f.size() >= kLlmcHeaderBytes, what, " ", path, ": the file is ", f.size(), " bytes, shorter than the ",
           kLlmcHeaderBytes, "-byte header");
  LlmcHeader h{};
  f.read_at(&h, sizeof(h), 0);
  // llm.c's other kind of file, said by name: its token shards and its multiple-choice eval files
  const char* other = h.magic == kShardMagic    ? ": it is an llm.c token shard (train --data)"
                      : h.magic == kChoiceMagic ? ": it is an llm.c multiple-choice eval file (eval/train --hellaswag)"
                                                : "";
  SG_CHECK(h.magic == magic, what, " ", path, ": magic number ", h.magic, " is not ", magic, " (", hint, ")", other);
  SG_CHECK(h.version == version, what, " ", path, ": version ", h.version, " is not ", version);
  SG_CHECK(h.count >= 0, what, " ", path, ": negative ", count_name, " count ", h.count);
  return h;
}

std::string read_file(const std::string& path, const std::string& what) {
  ReadFile f(path, what);
  std::string s(size_t(f.size()), '\0');
  if (!s.empty()) f.read_at(s.data(), s.size(), 0);
  return s;
}

void write_text_atomic(const std::string& path, const std::string& what, const std::string& text) {
  write_file_atomic(path, what, [&](const ByteSink& sink) { sink(text.data(), text.size()); });
}

void make_parent_folder(const std::string& path, const std::string& what) {
  SG_CHECK(!std::filesystem::is_directory(path), what, " ", path, " is a folder; give a file name");
  // "out/" (or "out/.") names a folder too, one that may not exist yet: it would be created and the
  // file's rename into it fail, after the work.
  const std::string name = std::filesystem::path(path).filename().string();
  SG_CHECK(!name.empty() && name != "." && name != "..", what, " ", path, " names a folder; give a file name");
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (dir.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  SG_CHECK(!ec, what, " ", path, ": cannot create the folder ", dir.string(), " (", ec.message(), ")");
}

}  // namespace sg::io

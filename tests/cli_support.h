// For tests that run the shardgrad executable (SG_BINARY) as a user would, alone or under
// mpirun (SG_MPIEXEC): a command's exit code and output, and a scratch directory.
#pragma once
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace sg::testing {

struct CommandResult {
  int code = 0;
  std::string output;  // stdout and stderr together
};

// seconds, when given, receives the wall time the command took.
// The command gets one OpenMP thread per process unless OMP_NUM_THREADS is set (or the command sets
// or unsets it with env): CTest runs two tests at once on a 2-core machine, and two processes whose
// 2-thread OpenMP teams spin on the same cores took 3-4 times as long as with one thread each
// (the tiny models gain nothing from a second thread; results do not depend on the thread count).
inline CommandResult run_shell(const std::string& cmdline, double* seconds = nullptr) {
  static int calls = 0;
  const auto t0 = std::chrono::steady_clock::now();
  const std::filesystem::path captured =
      std::filesystem::temp_directory_path() / ("sg_cmd_" + std::to_string(::getpid()) + "_" + std::to_string(calls++) + ".txt");
  const int status = std::system(("export OMP_NUM_THREADS=\"${OMP_NUM_THREADS:-1}\"; " + cmdline + " > '" +
                                  captured.string() + "' 2>&1").c_str());
  if (seconds) *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CommandResult r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream f(captured);
  std::ostringstream text;
  text << f.rdbuf();
  r.output = text.str();
  std::filesystem::remove(captured);
  return r;
}

// "mpirun ... -np N shardgrad": 1 thread per rank, ranks allowed to share cores.
// mpirun for np ranks on this machine's cores (one thread each), then the program to run.
inline std::string mpirun_command(int np) {
  return std::string(SG_MPIEXEC) + " --oversubscribe --allow-run-as-root --bind-to none -x OMP_NUM_THREADS=1 -np " +
         std::to_string(np) + " ";
}
inline std::string mpirun_shardgrad(int np) { return mpirun_command(np) + SG_BINARY; }

// One JSON object per line (--log-json).
inline std::vector<nlohmann::json> read_json_lines(const std::filesystem::path& p) {
  std::vector<nlohmann::json> v;
  std::ifstream f(p);
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) v.push_back(nlohmann::json::parse(line));
  return v;
}

// A fresh directory under the system's temporary directory, removed with everything in it.
struct ScratchDir {
  std::filesystem::path path;
  explicit ScratchDir(const std::string& tag) {
    path = std::filesystem::temp_directory_path() / ("sg_" + tag + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~ScratchDir() { std::filesystem::remove_all(path); }
};

}  // namespace sg::testing

// shardgrad launch -n N [--max-restarts K] -- train ...: a supervisor around mpirun. When the job
// exits non-zero it is started again with `--resume auto`, which continues from the newest
// complete checkpoint of the run's --save directory, up to K times. Restarted runs do not get
// --inject-fault: an injected fault stands for a transient failure (a node that died), which a
// restart on healthy nodes does not meet again. A job that failed before its first step
// (kRefusedBeforeStart) is not restarted.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"

namespace sg::cli {

namespace {

pid_t child = -1;
volatile sig_atomic_t forwarded = 0;  // the last signal launch received (0: none)

// The first SIGINT, SIGTERM or SIGUSR1 reaches the job as SIGUSR1, which mpirun passes on: the ranks
// stop after their step, saving it (train, kStoppedOnSignal), however long a large model's save
// takes. Passed on as they are, SIGINT and SIGTERM would have mpirun kill the ranks a second later,
// saved or not (Slurm's SIGTERM at a time limit, a Ctrl-C). A second signal goes on as it came: the
// way to end the job at once. Either way the job is not restarted: someone asked it to stop.
void forward_signal(int sig) {
  const bool first = !forwarded;
  forwarded = sig;
  if (child > 0) ::kill(child, first ? SIGUSR1 : sig);
}

// Runs argv, waits for it, returns its exit status (128 + signal when killed). A program that
// cannot be started throws (no job ran: nothing to restart); the child reports exec's errno
// through a close-on-exec pipe, which an exec that succeeds closes unwritten.
int run_job(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  int exec_error[2];
  SG_CHECK(::pipe2(exec_error, O_CLOEXEC) == 0, "launch: pipe failed: ", std::strerror(errno));
  child = ::fork();
  SG_CHECK(child >= 0, "launch: fork failed: ", std::strerror(errno));
  if (child == 0) {
    ::execvp(argv[0], argv.data());
    const int e = errno;
    (void)!::write(exec_error[1], &e, sizeof e);
    std::_Exit(127);
  }
  ::close(exec_error[1]);
  int e = 0;
  ssize_t got;
  while ((got = ::read(exec_error[0], &e, sizeof e)) < 0 && errno == EINTR) {
  }
  ::close(exec_error[0]);
  int status = 0;
  while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  child = -1;
  SG_CHECK(got != sizeof e, "launch: cannot run ", args[0], ": ", std::strerror(e),
           " (--mpirun names the launcher: a program, with its own flags after it)");
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 1;
}

// The value of --name in train's arguments ("--name value" or "--name=value"), or "".
std::string flag_value(const std::vector<std::string>& args, const std::string& name) {
  std::string v;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--" + name && i + 1 < args.size()) v = args[i + 1];
    if (args[i].rfind("--" + name + "=", 0) == 0) v = args[i].substr(name.size() + 3);
  }
  return v;
}

// train's arguments without --name (and its value).
std::vector<std::string> without_flag(const std::vector<std::string>& args, const std::string& name) {
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--" + name) {
      ++i;
      continue;
    }
    if (args[i].rfind("--" + name + "=", 0) == 0) continue;
    out.push_back(args[i]);
  }
  return out;
}

std::string self_path() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "shardgrad";
  buf[n] = 0;
  return buf;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& a : v) s += (s.empty() ? "" : " ") + a;
  return s;
}

}  // namespace

int launch_main(int argc, char** argv) {
  // Our flags come before "--"; everything after it is the train command.
  int sep = argc;
  for (int i = 0; i < argc; ++i)
    if (!std::strcmp(argv[i], "--")) {
      sep = i;
      break;
    }
  std::vector<std::string> ours_s;
  for (int i = 0; i < sep; ++i) ours_s.push_back(!std::strcmp(argv[i], "-n") ? "--np" : argv[i]);
  std::vector<char*> ours;
  for (auto& s : ours_s) ours.push_back(s.data());
  Args a("launch", "Run `shardgrad train` under mpirun on N ranks; restart it from its latest checkpoint when it fails.");
  a.synopsis("-n N [flags] -- train [train flags]");
  a.flag("np", "1", "ranks to launch (also -n)");
  a.flag("max-restarts", "0", "restarts with --resume auto after a failure (needs --save in the train flags)");
  a.flag("mpirun", "mpirun", "the MPI launcher to run, with flags of its own if any (split at spaces)");
  if (!a.parse(int(ours.size()), ours.data())) {
    std::printf("%s", a.usage().c_str());
    return 0;
  }
  const int64_t np = a.i64("np"), max_restarts = a.i64("max-restarts");
  SG_CHECK(np >= 1, "launch: -n must be >= 1, got ", np);
  SG_CHECK(max_restarts >= 0, "launch: --max-restarts must be >= 0, got ", max_restarts);
  SG_CHECK(sep + 1 < argc && !std::strcmp(argv[sep + 1], "train"),
           "launch: expected `-- train [flags]` after the launch flags");
  std::vector<std::string> train(argv + sep + 2, argv + argc);
  const std::string save = flag_value(train, "save");
  SG_CHECK(max_restarts == 0 || !save.empty(), "launch: --max-restarts ", max_restarts,
           " needs --save DIR in the train flags: a restart resumes from the newest checkpoint in DIR");
  const std::string every = flag_value(train, "save-every");
  if (max_restarts > 0 && (every.empty() || every == "0"))
    std::printf("shardgrad launch: note: the train flags save only at the end (no --save-every N): a restart "
                "finds no newer checkpoint in %s and trains again from where that one is (step 0 if none)\n",
                save.c_str());
  const std::string resume = flag_value(train, "resume");
  SG_CHECK(resume.empty() || resume == "auto", "launch: the train flags say --resume ", resume,
           "; a supervised run resumes from its own --save directory (use --resume auto or none)");

  // "mpirun --mca btl self,tcp" is the launcher and flags of its own: split into words.
  std::vector<std::string> mpirun;
  {
    std::istringstream words(a.str("mpirun"));
    for (std::string w; words >> w;) mpirun.push_back(w);
  }
  SG_CHECK(!mpirun.empty(), "launch: --mpirun is empty (the launcher to run, e.g. mpirun)");
  mpirun.insert(mpirun.end(), {"--oversubscribe", "--bind-to", "none"});
  if (::getuid() == 0) mpirun.push_back("--allow-run-as-root");  // containers run as root
  mpirun.insert(mpirun.end(), {"-np", std::to_string(np), self_path(), "train"});

  struct sigaction sa {};
  sa.sa_handler = forward_signal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGUSR1, &sa, nullptr);
  int code = 0;
  for (int64_t attempt = 0;; ++attempt) {
    std::vector<std::string> cmd = mpirun;
    std::vector<std::string> args = train;
    if (attempt > 0) {
      args = without_flag(without_flag(args, "resume"), "inject-fault");
      args.insert(args.end(), {"--resume", "auto"});
    }
    cmd.insert(cmd.end(), args.begin(), args.end());
    std::printf("shardgrad launch: %s %s\n", attempt ? "restart:" : "run:", joined(cmd).c_str());
    code = run_job(cmd);
    if (code == 0) {
      if (attempt) std::printf("shardgrad launch: the job completed after %lld restart%s\n", (long long)attempt,
                               attempt == 1 ? "" : "s");
      return 0;
    }
    if (code == kStoppedOnSignal || forwarded) {
      const char* why = forwarded == SIGINT    ? "SIGINT"
                        : forwarded == SIGTERM ? "SIGTERM"
                        : forwarded            ? "SIGUSR1"
                                               : "a signal to its ranks";
      const std::string saved = code == kStoppedOnSignal ? str(" after saving its checkpoint in ", save) : "";
      std::printf("shardgrad launch: the job stopped on %s (exit status %d)%s; not restarted\n", why, code, saved.c_str());
      return code;
    }
    if (code == kRefusedBeforeStart) {
      std::fprintf(stderr, "shardgrad launch: the job failed before its first step (exit status %d: the error above); "
                   "not restarted: the same command would fail the same way\n", code);
      return code;
    }
    if (attempt == max_restarts) break;
    std::printf("shardgrad launch: the job failed with exit status %d; restart %lld of %lld from the newest "
                "checkpoint in %s\n",
                code, (long long)attempt + 1, (long long)max_restarts, save.c_str());
  }
  std::fprintf(stderr, "shardgrad launch: the job failed with exit status %d%s\n", code,
               max_restarts ? str(" after ", max_restarts, " restart", max_restarts == 1 ? "" : "s", "; giving up").c_str()
                            : "");
  return code;
}

}  // namespace sg::cli

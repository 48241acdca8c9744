// The shardgrad subcommands.
#pragma once
#include "core/error.h"

namespace sg::cli {
int train_main(int argc, char** argv);
int generate_main(int argc, char** argv);
int export_main(int argc, char** argv);
int plan_main(int argc, char** argv);
int launch_main(int argc, char** argv);
int bench_main(int argc, char** argv);
int tokenize_main(int argc, char** argv);
int eval_main(int argc, char** argv);

// train's exit status when SIGUSR1, SIGTERM or SIGINT stopped it early after saving the step it had reached
// (sysexits' EX_TEMPFAIL: the run can be resumed). launch does not restart such a job.
constexpr int kStoppedOnSignal = 75;
// train's exit status when it failed before its first step: a refused flag, a file or checkpoint it
// cannot use (sysexits' EX_USAGE). The same command would fail the same way: launch does not
// restart it (a restart adds --resume auto, which would also pass over a refusal such as "--save
// DIR already holds a run").
constexpr int kRefusedBeforeStart = 64;
// An error that ends the process with its own exit status (main prints it as any error).
struct ExitStatusError : Error {
  int status;
  ExitStatusError(int s, const std::string& what) : Error(what), status(s) {}
};
}  // namespace sg::cli

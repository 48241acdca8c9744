// The shardgrad subcommands.
#pragma once

namespace sg::cli {
int train_main(int argc, char** argv);
int generate_main(int argc, char** argv);
int export_main(int argc, char** argv);
int plan_main(int argc, char** argv);
int launch_main(int argc, char** argv);
int bench_main(int argc, char** argv);
int tokenize_main(int argc, char** argv);
int eval_main(int argc, char** argv);

// train's exit status when SIGUSR1 or SIGTERM stopped it early after saving the step it had reached
// (sysexits' EX_TEMPFAIL: the run can be resumed). launch does not restart such a job.
constexpr int kStoppedOnSignal = 75;
}  // namespace sg::cli

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
}  // namespace sg::cli

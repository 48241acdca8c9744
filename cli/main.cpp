// shardgrad: train, generate, eval, plan, bench, export, launch, tokenize.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>

#include <mpi.h>

#include "cli/commands.h"

static void usage() {
  std::printf(
      "usage: shardgrad <command> [flags]\n\n"
      "commands:\n"
      "  train      train a GPT-2-family model (default: tiny model on the built-in synthetic task, CPU)\n"
      "  generate   sample text from a trained model\n"
      "  eval       score a trained model on a multiple-choice eval file (HellaSwag, llm.c's format)\n"
      "  plan       predict a layout's memory per GPU, traffic, bubble, step time and MFU; --search ranks layouts\n"
      "  bench      run a matrix of parallel layouts here and report them (JSON, CSV, HTML)\n"
      "  export     write a checkpoint's weights as one Hugging Face GPT-2 .safetensors file\n"
      "  launch     run train under mpirun; restart it from its latest checkpoint when it fails\n"
      "  tokenize   turn text files into an llm.c token shard with GPT-2's tokenizer, for train --data\n"
      "             (--format hellaswag: HellaSwag's jsonl into an eval file, for eval and train --hellaswag)\n\n"
      "run 'shardgrad <command> --help' for the flags of a command.\n");
}

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    usage();
    return argc < 2 ? 2 : 0;
  }
  // Whether a launcher (mpirun) started us, read before MPI_Init: as a singleton, Open MPI sets
  // these variables in the process itself. Without one there is no other rank to take down, so an
  // error needs no MPI_Abort (nor its banner).
  const bool launched = std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMIX_RANK") || std::getenv("PMI_RANK");
  try {
    if (!std::strcmp(argv[1], "train")) return sg::cli::train_main(argc - 2, argv + 2);
    if (!std::strcmp(argv[1], "generate")) return sg::cli::generate_main(argc - 2, argv + 2);
    if (!std::strcmp(argv[1], "eval")) return sg::cli::eval_main(argc - 2, argv + 2);
    if (!std::strcmp(argv[1], "export")) return sg::cli::export_main(argc - 2, argv + 2);
    if (!std::strcmp(argv[1], "plan")) return sg::cli::plan_main(argc - 2, argv + 2);
    if (!std::strcmp(argv[1], "launch")) return sg::cli::launch_main(argc - 2, argv + 2);
    if (!std::strcmp(argv[1], "bench")) return sg::cli::bench_main(argc - 2, argv + 2);
    if (!std::strcmp(argv[1], "tokenize")) return sg::cli::tokenize_main(argc - 2, argv + 2);
    std::fprintf(stderr, "shardgrad: unknown command '%s'\n", argv[1]);
    usage();
    return 2;
  } catch (const std::exception& e) {
    const auto* own = dynamic_cast<const sg::cli::ExitStatusError*>(&e);
    const int status = own ? own->status : 1;
    int up = 0, down = 0;
    MPI_Initialized(&up);
    MPI_Finalized(&down);
    if (up && !down && launched) {
      // Under mpirun: name this rank, then take the whole job down so no rank is left waiting
      // in a collective for us.
      int rank = 0;
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      std::fprintf(stderr, "shardgrad %s: rank %d: error: %s\n", argv[1], rank, e.what());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, status);
    }
    // Without MPI (a launcher such as torchrun, train --rendezvous file: or tcp:) the launcher's RANK names it.
    if (const char* rank = std::getenv("RANK"); rank && *rank)
      std::fprintf(stderr, "shardgrad %s: rank %s: error: %s\n", argv[1], rank, e.what());
    else
      std::fprintf(stderr, "shardgrad %s: error: %s\n", argv[1], e.what());
    return status;
  }
}

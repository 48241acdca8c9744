// Catch2 main for tests that run on several ranks under mpirun: MPI is initialised once for the
// whole run; each rank runs every test case, and a failure on any rank fails the run.
// MPI is initialised here, not by comm::init, so the tests also cover comm::init finding MPI
// already initialised (as under a launcher or another library); comm::finalize then stops the
// groups' communication threads before MPI_Finalize.
#define CATCH_CONFIG_RUNNER
#include <mpi.h>

#include <cstdio>
#include <string>

#include "tests/catch.h"

#include "autograd/ops.h"
#include "parallel/comm/mpi_backend.h"

// After comm::finalize a group refuses work by name, and a refused operation is not counted.
// Returns 0 when it does.
static int refuses_after_finalize(sg::comm::ProcessGroup& g) {
  const int64_t before = g.counters()[sg::comm::CommKind::all_reduce].calls;
  try {
    g.all_reduce(sg::zeros({4}));
  } catch (const sg::Error& e) {
    if (std::string(e.what()).find("all_reduce: the process group was shut down") == std::string::npos) return 1;
    return g.counters()[sg::comm::CommKind::all_reduce].calls == before ? 0 : 1;
  }
  return 1;
}

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  sg::comm::init();
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  // Every rank runs the cases in the same (declared) order; rank 0 prints the summary line.
  int rc = rank == 0 ? sg::testing::run_catch(argc, argv, {"--order", "decl"})
                     : sg::testing::run_catch(argc, argv, {"--order", "decl", "--reporter", "compact"});
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  auto probe = sg::comm::MpiProcessGroup::world();
  sg::comm::finalize();
  if (refuses_after_finalize(*probe) != 0) {
    std::fprintf(stderr, "rank %d: a group used after comm::finalize was not refused, or was counted\n", rank);
    worst = 1;
  }
  MPI_Finalize();
  return worst;
}

// Catch2 main for tests that run on several ranks under mpirun: MPI is initialised once for the
// whole run; each rank runs every test case, and a failure on any rank fails the run.
// MPI is initialised here, not by comm::init, so the tests also cover comm::init finding MPI
// already initialised (as under a launcher or another library); comm::finalize then stops the
// groups' communication threads before MPI_Finalize.
#define CATCH_CONFIG_RUNNER
#include <mpi.h>

#include <catch2/catch.hpp>

#include "parallel/comm/mpi_backend.h"

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  sg::comm::init();
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  Catch::Session session;
  if (rank != 0) session.configData().reporterName = "compact";  // rank 0 prints the summary line
  int rc = session.applyCommandLine(argc, argv);
  if (rc == 0) rc = session.run();
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  sg::comm::finalize();
  MPI_Finalize();
  return worst;
}

// The Catch2 main of sg_tests and sg_emu_tests (a runner, so that it is the same under Catch2 2 and 3).
#define CATCH_CONFIG_RUNNER
#include "tests/catch.h"

int main(int argc, char** argv) { return Catch::Session().run(argc, argv); }

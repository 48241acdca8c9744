// Catch2 for every test: version 2 (Debian 12's single header) or 3 (Ubuntu 24.04's and Debian
// 13's compiled library), whichever CMake found (SG_CATCH2_MAJOR). The tests are written against
// 2's names; under 3 the few that moved are brought back: the string matchers Catch::Contains,
// StartsWith and EndsWith, and Approx in the global namespace. A runner (a TU that defines
// CATCH_CONFIG_RUNNER first and its own main with Catch::Session) works under both.
#pragma once
#if SG_CATCH2_MAJOR >= 3
#include <catch2/catch_all.hpp>

#include <string>

namespace Catch {
inline Matchers::StringContainsMatcher Contains(const std::string& s,
                                                CaseSensitive cs = CaseSensitive::Yes) {
  return Matchers::ContainsSubstring(s, cs);
}
using Matchers::EndsWith;
using Matchers::StartsWith;
}  // namespace Catch
using Catch::Approx;
#else
#include <catch2/catch.hpp>
#endif

#ifdef CATCH_CONFIG_RUNNER  // (Catch2 2 declares Session only there)
#include <initializer_list>
#include <vector>

namespace sg::testing {
// A runner's session over argv with `extra` options in front (their Config fields differ between
// Catch2 2 and 3; the command line is the same).
inline int run_catch(int argc, char** argv, std::initializer_list<const char*> extra = {}) {
  std::vector<const char*> args{argv[0]};
  args.insert(args.end(), extra.begin(), extra.end());
  args.insert(args.end(), argv + 1, argv + argc);
  Catch::Session session;
  const int rc = session.applyCommandLine(int(args.size()), args.data());
  return rc != 0 ? rc : session.run();
}
}  // namespace sg::testing
#endif  // CATCH_CONFIG_RUNNER

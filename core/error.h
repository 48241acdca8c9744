// Errors that name the thing: every failure says which op, which shapes, which flag or file.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace sg {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {
inline void append(std::ostringstream&) {}
template <class T, class... Rest>
void append(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  append(os, rest...);
}
}  // namespace detail

template <class... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  detail::append(os, args...);
  return os.str();
}

template <class T>
std::string shape_str(const std::vector<T>& s) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < s.size(); ++i) os << (i ? "," : "") << s[i];
  os << ']';
  return os.str();
}

}  // namespace sg

#define SG_CHECK(cond, ...)                                  \
  do {                                                       \
    if (!(cond)) throw ::sg::Error(::sg::str(__VA_ARGS__));  \
  } while (0)

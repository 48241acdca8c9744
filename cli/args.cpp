#include "cli/args.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "core/error.h"

namespace sg::cli {

void Args::flag(const std::string& name, const std::string& default_value, const std::string& help) {
  flags_[name] = Flag{default_value, help, false, false};
  order_.push_back(name);
}

void Args::toggle(const std::string& name, const std::string& help) {
  flags_[name] = Flag{"0", help, true, false};
  order_.push_back(name);
}

// Edits (insert, delete, replace, swap two neighbours) between a and b: --stpes is one from --steps.
static size_t edits(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i)
    for (size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1])});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

std::string Args::nearest(const std::string& name) const {
  std::string best;
  if (name.size() > 64) return best;  // no flag is that long
  size_t best_edits = std::max<size_t>(1, std::min<size_t>(3, name.size() / 3)) + 1;  // a third of it, 1 to 3
  for (const auto& n : order_) {
    // the start of one flag (--warmup for --warmup-steps) counts as a near miss too
    const size_t e = n.size() > name.size() && n.rfind(name, 0) == 0 && name.size() >= 3 ? 1 : edits(name, n);
    if (e < best_edits) best = n, best_edits = e;
  }
  return best;
}

void Args::positional(const std::string& name, const std::string& help) { positionals_.emplace_back(name, help); }

void Args::positional_list(const std::string& name, const std::string& help) {
  positional(name, help);
  list_name_ = name;
}

bool Args::parse(int argc, char** argv) {
  for (int i = 0; i < argc; ++i) argv_copy.emplace_back(argv[i]);
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") return false;
    if (a.rfind("--", 0) != 0) {
      if (!list_name_.empty() && positional_values_.size() + 1 >= positionals_.size()) {
        list_values_.push_back(a);
        if (positional_values_.size() + 1 == positionals_.size()) positional_values_.push_back(a);
        continue;
      }
      SG_CHECK(positional_values_.size() < positionals_.size(), command_, ": unexpected argument '", a, "'");
      flags_[positionals_[positional_values_.size()].first] = Flag{a, "", false, true};
      positional_values_.push_back(a);
      continue;
    }
    std::string name = a.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    auto it = flags_.find(name);
    if (it == flags_.end()) {
      const std::string near = nearest(name);
      throw Error(sg::str(command_, ": unknown flag --", name, near.empty() ? "" : "; did you mean --" + near + "?",
                      " (see shardgrad ", command_, " --help)"));
    }
    if (it->second.is_toggle) {
      SG_CHECK(!has_value || value == "0" || value == "1", command_, ": --", name, " takes no value");
      it->second.value = has_value ? value : "1";
    } else {
      if (!has_value) {
        SG_CHECK(i + 1 < argc, command_, ": --", name, " needs a value");
        value = argv[++i];
      }
      it->second.value = value;
    }
    it->second.given = true;
  }
  SG_CHECK(positional_values_.size() == positionals_.size(), command_, ": missing argument <",
           positionals_.size() > positional_values_.size() ? positionals_[positional_values_.size()].first : "", ">");
  return true;
}

const Args::Flag& Args::get(const std::string& name) const {
  auto it = flags_.find(name);
  SG_CHECK(it != flags_.end(), "internal: flag --", name, " was never declared");
  return it->second;
}

std::string Args::str(const std::string& name) const { return get(name).value; }
bool Args::on(const std::string& name) const { return get(name).value == "1"; }
bool Args::given(const std::string& name) const { return get(name).given; }
std::string Args::spelled(const std::string& name) const {
  const Flag& f = get(name);
  if (f.is_toggle) return f.value == "1" ? "--" + name : "";
  return "--" + name + " " + f.value;
}

void Args::inherit(const std::string& name, const std::string& value) {
  SG_CHECK(flags_.count(name), "internal: flag --", name, " was never declared");
  Flag& f = flags_[name];
  SG_CHECK(!f.given, "internal: --", name, " was given on the command line");
  f.value = value;
  f.given = true;
  inherited_.push_back(name);
}

std::vector<std::string> Args::list(const std::string& name) const {
  SG_CHECK(name == list_name_, "internal: <", name, "> is not a positional list");
  return list_values_;
}

int64_t Args::i64(const std::string& name) const {
  const std::string& v = get(name).value;
  errno = 0;
  char* end = nullptr;
  long long x = std::strtoll(v.c_str(), &end, 10);
  SG_CHECK(!v.empty() && *end == 0 && errno == 0, command_, ": --", name, " expects an integer, got '", v, "'");
  return x;
}

double Args::f64(const std::string& name) const {
  const std::string& v = get(name).value;
  errno = 0;
  char* end = nullptr;
  double x = std::strtod(v.c_str(), &end);
  SG_CHECK(!v.empty() && *end == 0 && errno == 0 && std::isfinite(x), command_, ": --", name,
           " expects a number, got '", v, "'");
  return x;
}

std::string Args::usage() const {
  std::ostringstream os;
  os << "usage: shardgrad " << command_;
  if (synopsis_.empty()) {
    for (auto& [n, h] : positionals_) os << " <" << n << ">" << (n == list_name_ ? "..." : "");
    os << " [flags]";
  } else {
    os << " " << synopsis_;
  }
  os << "\n" << summary_ << "\n\n";
  for (auto& [n, h] : positionals_) os << "  <" << n << ">  " << h << "\n";
  for (const auto& n : order_) {
    const Flag& f = flags_.at(n);
    os << "  --" << n;
    // An empty default means "not given", which the help says in its own words where it matters
    // ("none" would read as a value, and for bench --report it is one: no report).
    if (!f.is_toggle && !f.value.empty()) os << " (default: " << f.value << ")";
    os << "\n      " << f.help << "\n";
  }
  return os.str();
}

DType model_dtype(const Args& a) {
  DType d = DType::i64;
  try {
    d = parse_dtype(a.str("dtype"));
  } catch (const Error&) {
  }  // refused below with the model dtypes (parse_dtype's list has fp64, i32, i64)
  SG_CHECK(d == DType::f32 || d == DType::bf16 || d == DType::f16, a.command(), ": --dtype must be fp32, bf16 or fp16, ",
           "got '", a.str("dtype"), "'");
  return d;
}

}  // namespace sg::cli

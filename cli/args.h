// Command-line flags: each subcommand declares its flags (name, default, help); parsing refuses
// unknown flags, missing values and malformed numbers with the flag named.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace sg::cli {

class Args;
// A model's --dtype: fp32, bf16 or fp16; anything else is refused naming the command.
DType model_dtype(const Args& a);

class Args {
 public:
  Args(std::string command, std::string summary) : command_(std::move(command)), summary_(std::move(summary)) {}
  void flag(const std::string& name, const std::string& default_value, const std::string& help);
  void toggle(const std::string& name, const std::string& help);  // boolean, no value
  void positional(const std::string& name, const std::string& help);
  // The last positional, taking one or more values (list(name)), as `shardgrad tokenize a.txt b.txt`.
  void positional_list(const std::string& name, const std::string& help);
  // What follows the command on the usage line, instead of its positionals and "[flags]".
  void synopsis(std::string s) { synopsis_ = std::move(s); }
  // Throws sg::Error for bad input; returns false when --help was asked (usage printed).
  bool parse(int argc, char** argv);

  std::string str(const std::string& name) const;
  int64_t i64(const std::string& name) const;
  double f64(const std::string& name) const;
  bool on(const std::string& name) const;
  // "--name value" (a toggle: "--name" when on, "" when off), as it would be typed
  std::string spelled(const std::string& name) const;
  std::vector<std::string> list(const std::string& name) const;  // a positional_list's values
  bool given(const std::string& name) const;  // set on the command line or inherited (not defaulted)
  // Sets a flag the command line did not give, as if it had (train --resume: the checkpoint's flags).
  void inherit(const std::string& name, const std::string& value);
  const std::vector<std::string>& inherited() const { return inherited_; }
  std::string usage() const;
  const std::string& command() const { return command_; }
  std::vector<std::string> argv_copy;  // the command line, for run configs

 private:
  struct Flag {
    std::string value, help;
    bool is_toggle = false, given = false;
  };
  const Flag& get(const std::string& name) const;
  std::string nearest(const std::string& name) const;  // the declared flag a mistyped name likely meant, or ""
  std::string command_, summary_, synopsis_;
  std::map<std::string, Flag> flags_;
  std::vector<std::string> order_;
  std::vector<std::pair<std::string, std::string>> positionals_;
  std::vector<std::string> positional_values_;
  std::vector<std::string> inherited_;
  std::string list_name_;  // the positional_list, when declared
  std::vector<std::string> list_values_;
};

}  // namespace sg::cli

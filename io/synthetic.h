// The built-in task: multi-digit addition, small enough that a tiny GPT learns it in minutes on a CPU.
//
// Tokens: 0-9 are the digits, 10 '+', 11 '=', 12 '\n' (vocabulary 13). Every number is written
// least-significant digit first, operands zero-padded to D digits (default 3) and the sum to D+1:
// 123 + 45 = 168 is  321+540=8610\n . Answer digit i then depends on operand digits i, which sit at
// the same distance behind it in every problem, and on the carry from digit i-1, already written.
// (With the operands most-significant first, the tiny preset learned packed rows several times
// slower.) A problem is 3D+4 tokens: a prompt of 2D+2 ("321+540=") and an answer of D+2 ("8610\n").
//
// Rows: each row of T tokens starts at a problem boundary and is filled with consecutive problems
// (the last one cut off by the row's end). Targets are the next token at the D+2 positions that
// predict the answer digits and the newline ('=' and the answer digits), -1 everywhere else: the
// operands are random and never worth predicting. The evaluator puts every prompt at position 0, so
// rows of exactly 3D+4 tokens (--seq-len 13 for D = 3) train only what it asks and learn fastest.
//
// Splits: the unordered operand pair {a, b} is held out for val when a fixed hash of it is 0 mod 10,
// so val problems (and their commuted twins) never occur in train. Problem n of a split is a pure
// function of (seed, split, n) through Philox; the stream's row n (row r of batch k is n = kB + r at
// a fixed B) holds problems nP, ..., nP + P - 1 with P = ceil((T+1) / (3D+4)). The position is the
// number of rows drawn, so a batch is the same on any machine and after resume, at any batch size.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/dataset.h"

namespace sg::io {

struct SyntheticTask {
  static constexpr int64_t kPlus = 10, kEquals = 11, kNewline = 12, kVocab = 13;
  int64_t digits = 3;  // operand width D, 1..18

  struct Problem {
    uint64_t a = 0, b = 0;
  };

  int64_t vocab_size() const { return kVocab; }
  int64_t prompt_length() const { return 2 * digits + 2; }
  int64_t answer_length() const { return digits + 2; }
  int64_t problem_length() const { return 3 * digits + 4; }

  bool held_out(const Problem& p) const;  // true: the problem belongs to val
  Problem problem(Split split, uint64_t seed, uint64_t n) const;
  std::vector<int64_t> tokens(const Problem& p) const;  // prompt then answer
  std::vector<int64_t> answer(const Problem& p) const;  // the D+2 answer tokens

  std::vector<int64_t> encode(const std::string& text) const;  // throws on a character outside the vocabulary
  std::string decode(const std::vector<int64_t>& tokens) const;  // '?' for ids outside it
};

// "synthetic" (3 digits) or "synthetic:D". Throws naming the spec otherwise.
SyntheticTask parse_synthetic_spec(const std::string& spec);

class SyntheticDataset : public Dataset {
 public:
  SyntheticDataset(SyntheticTask task, Split split, uint64_t seed) : task_(task), split_(split), seed_(seed) {}
  Batch next(int64_t B, int64_t T) override;
  void check_batch(int64_t B, int64_t T) const override;
  int64_t position() const override { return rows_; }
  bool draws_rows() const override { return true; }
  void set_position(int64_t p) override;
  int64_t vocab_size() const override { return task_.vocab_size(); }
  std::string describe() const override;
  std::vector<int64_t> encode(const std::string& text) const override { return task_.encode(text); }
  std::string decode(const std::vector<int64_t>& tokens) const override { return task_.decode(tokens); }
  const SyntheticTask& task() const { return task_; }

 private:
  SyntheticTask task_;
  Split split_;
  uint64_t seed_;
  int64_t rows_ = 0;
};

// logits_fn: int64 token ids [B, T'] -> logits [B, T', V'] with V' >= the task's vocabulary.
using LogitsFn = std::function<Tensor(const Tensor& idx_BT)>;

// Greedy-decodes the answers of val problems 0..num_problems-1 drawn with `seed` (batched, all
// prompts at position 0, argmax over the real vocabulary) and returns the fraction answered exactly
// right, newline included. T is the model's longest input; it must hold a prompt and all but the
// last answer token.
double synthetic_accuracy(const SyntheticTask& task, const LogitsFn& logits_fn, int64_t num_problems, int64_t T,
                          uint64_t seed);

// The same decoding for a few problems, one line each: "321+540=8610  ok" or "321+540=8600  want 8610".
std::vector<std::string> synthetic_examples(const SyntheticTask& task, const LogitsFn& logits_fn, int64_t num_problems,
                                            int64_t T, uint64_t seed);

}  // namespace sg::io

#include "io/synthetic.h"

#include <algorithm>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "core/philox.h"

namespace sg::io {

namespace {

uint64_t pow10(int64_t d) {
  uint64_t p = 1;
  for (int64_t i = 0; i < d; ++i) p *= 10;
  return p;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t split_stream(Split s) {
  return rng_stream_from_name(s == Split::train ? "io.synthetic.train" : "io.synthetic.val");
}

void check_digits(int64_t d) {
  SG_CHECK(d >= 1 && d <= 18, "synthetic: operands of ", d, " digits are not supported (1..18)");
}

// Decodes a batch of val problems greedily; returns, per problem, the answer tokens the model chose.
std::vector<std::vector<int64_t>> greedy_answers(const SyntheticTask& task, const LogitsFn& logits_fn,
                                                 const std::vector<SyntheticTask::Problem>& problems, int64_t T) {
  const int64_t P = task.prompt_length(), A = task.answer_length(), V = task.vocab_size();
  SG_CHECK(P + A - 1 <= T, "synthetic: a ", task.digits, "-digit problem needs inputs of ", P + A - 1,
           " tokens but the model takes at most ", T);
  autograd::NoGradGuard no_grad;
  constexpr int64_t kChunk = 64;  // problems per forward call
  std::vector<std::vector<int64_t>> out(problems.size());
  for (size_t lo = 0; lo < problems.size(); lo += kChunk) {
    const int64_t B = std::min<int64_t>(kChunk, int64_t(problems.size() - lo));
    std::vector<std::vector<int64_t>> seqs(static_cast<size_t>(B));
    for (int64_t i = 0; i < B; ++i) {
      seqs[size_t(i)] = task.tokens(problems[lo + size_t(i)]);
      seqs[size_t(i)].resize(size_t(P));
    }
    for (int64_t step = 0; step < A; ++step) {
      const int64_t len = P + step;
      std::vector<int64_t> flat;
      flat.reserve(size_t(B * len));
      for (const auto& s : seqs) flat.insert(flat.end(), s.begin(), s.end());
      Tensor logits = logits_fn(from_vector(flat, {B, len}));
      SG_CHECK(logits.dim() == 3 && logits.size(0) == B && logits.size(1) == len && logits.size(2) >= V,
               "synthetic_accuracy: logits_fn returned ", shape_str(logits.shape()), " for inputs [", B, ",", len,
               "]; expected [", B, ",", len, ",V] with V >= ", V);
      const int64_t Vp = logits.size(2);
      std::vector<float> last = to_vector<float>(narrow(logits, 1, len - 1, 1));  // [B, 1, Vp]
      for (int64_t i = 0; i < B; ++i) {
        const float* row = last.data() + i * Vp;
        seqs[size_t(i)].push_back(std::max_element(row, row + V) - row);
      }
    }
    for (int64_t i = 0; i < B; ++i)
      out[lo + size_t(i)].assign(seqs[size_t(i)].begin() + P, seqs[size_t(i)].end());
  }
  return out;
}

std::vector<SyntheticTask::Problem> eval_problems(const SyntheticTask& task, int64_t n, uint64_t seed) {
  SG_CHECK(n > 0, "synthetic: the number of evaluation problems must be positive, got ", n);
  std::vector<SyntheticTask::Problem> ps;
  for (int64_t i = 0; i < n; ++i) ps.push_back(task.problem(Split::val, seed, uint64_t(i)));
  return ps;
}

}  // namespace

bool SyntheticTask::held_out(const Problem& p) const {
  const uint64_t lo = std::min(p.a, p.b), hi = std::max(p.a, p.b);
  return splitmix64(splitmix64(lo) ^ hi) % 10 == 0;
}

SyntheticTask::Problem SyntheticTask::problem(Split split, uint64_t seed, uint64_t n) const {
  check_digits(digits);
  const uint64_t range = pow10(digits), stream = split_stream(split);
  const bool want_val = split == Split::val;
  // Rejection sampling: about 1.1 draws per train problem, 10 per val problem.
  for (uint64_t attempt = 0; attempt < (1u << 16); ++attempt) {
    uint32_t w[4];
    Philox::words(seed, stream, (n << 16) | attempt, w);
    Problem p{((uint64_t(w[0]) << 32) | w[1]) % range, ((uint64_t(w[2]) << 32) | w[3]) % range};
    if (held_out(p) == want_val) return p;
  }
  throw Error(str("synthetic: no ", want_val ? "val" : "train", " problem found for index ", n));
}

std::vector<int64_t> SyntheticTask::answer(const Problem& p) const {
  uint64_t s = p.a + p.b;
  std::vector<int64_t> out;
  for (int64_t i = 0; i <= digits; ++i, s /= 10) out.push_back(int64_t(s % 10));  // least significant first
  out.push_back(kNewline);
  return out;
}

std::vector<int64_t> SyntheticTask::tokens(const Problem& p) const {
  std::vector<int64_t> out;
  auto operand = [&](uint64_t x) {  // least significant digit first, zero-padded to D digits
    for (int64_t i = 0; i < digits; ++i, x /= 10) out.push_back(int64_t(x % 10));
  };
  operand(p.a);
  out.push_back(kPlus);
  operand(p.b);
  out.push_back(kEquals);
  for (int64_t t : answer(p)) out.push_back(t);
  return out;
}

std::vector<int64_t> SyntheticTask::encode(const std::string& text) const {
  std::vector<int64_t> out;
  for (unsigned char c : text) {
    if (c >= '0' && c <= '9') out.push_back(c - '0');
    else if (c == '+') out.push_back(kPlus);
    else if (c == '=') out.push_back(kEquals);
    else if (c == '\n') out.push_back(kNewline);
    else throw Error(str("synthetic: character '", char(c), "' (byte ", int(c), ") is not in the vocabulary 0-9 + = \\n"));
  }
  return out;
}

std::string SyntheticTask::decode(const std::vector<int64_t>& tokens) const {
  std::string out;
  for (int64_t t : tokens) {
    out.push_back(t >= 0 && t <= 9 ? char('0' + t)
                  : t == kPlus     ? '+'
                  : t == kEquals   ? '='
                  : t == kNewline  ? '\n'
                                   : '?');
  }
  return out;
}

SyntheticTask parse_synthetic_spec(const std::string& spec) {
  SyntheticTask task;
  if (spec == "synthetic") return task;
  const std::string prefix = "synthetic:";
  SG_CHECK(spec.rfind(prefix, 0) == 0, "data ", spec, ": not a synthetic task spec (synthetic or synthetic:DIGITS)");
  const std::string d = spec.substr(prefix.size());
  SG_CHECK(!d.empty() && d.size() <= 2 && std::all_of(d.begin(), d.end(), [](char c) { return c >= '0' && c <= '9'; }),
           "data ", spec, ": expected synthetic:DIGITS with DIGITS in 1..18");
  task.digits = std::stoll(d);
  check_digits(task.digits);
  return task;
}

void SyntheticDataset::check_batch(int64_t B, int64_t T) const {
  const int64_t L = task_.problem_length();
  SG_CHECK(B > 0 && T > 0, "synthetic: batch shape B=", B, ", T=", T, " must be positive");
  SG_CHECK(T >= L, "synthetic: rows of T=", T, " tokens are shorter than one ", task_.digits, "-digit problem (", L,
           " tokens)");
}

Batch SyntheticDataset::next(int64_t B, int64_t T) {
  check_batch(B, T);
  const int64_t L = task_.problem_length();
  const int64_t per_row = (T + 1 + L - 1) / L;
  std::vector<int64_t> inputs(size_t(B * T)), targets(size_t(B * T));
  std::vector<int64_t> row;
  for (int64_t r = 0; r < B; ++r) {
    const uint64_t row_id = uint64_t(rows_) + uint64_t(r);
    row.clear();
    for (int64_t j = 0; j < per_row; ++j) {
      auto toks = task_.tokens(task_.problem(split_, seed_, row_id * uint64_t(per_row) + uint64_t(j)));
      row.insert(row.end(), toks.begin(), toks.end());
    }
    for (int64_t t = 0; t < T; ++t) {
      inputs[size_t(r * T + t)] = row[size_t(t)];
      const bool answer_next = (t + 1) % L >= task_.prompt_length();  // token t+1 is an answer token
      targets[size_t(r * T + t)] = answer_next ? row[size_t(t + 1)] : -1;
    }
  }
  rows_ += B;
  return {from_vector(inputs, {B, T}), from_vector(targets, {B, T})};
}

void SyntheticDataset::set_position(int64_t p) {
  SG_CHECK(p >= 0, "synthetic: position ", p, " is negative");
  rows_ = p;
}

std::string SyntheticDataset::describe() const {
  return str("synthetic addition (", task_.digits, "-digit operands, digits least-significant first, vocab ",
             task_.vocab_size(), ", ", split_ == Split::train ? "train" : "val", " split)");
}

double synthetic_accuracy(const SyntheticTask& task, const LogitsFn& logits_fn, int64_t num_problems, int64_t T,
                          uint64_t seed) {
  const auto problems = eval_problems(task, num_problems, seed);
  const auto answers = greedy_answers(task, logits_fn, problems, T);
  int64_t right = 0;
  for (size_t i = 0; i < problems.size(); ++i) right += answers[i] == task.answer(problems[i]);
  return double(right) / double(problems.size());
}

std::vector<std::string> synthetic_examples(const SyntheticTask& task, const LogitsFn& logits_fn, int64_t num_problems,
                                            int64_t T, uint64_t seed) {
  const auto problems = eval_problems(task, num_problems, seed);
  const auto answers = greedy_answers(task, logits_fn, problems, T);
  std::vector<std::string> lines;
  for (size_t i = 0; i < problems.size(); ++i) {
    auto prompt = task.tokens(problems[i]);
    prompt.resize(size_t(task.prompt_length()));
    auto strip = [&](const std::vector<int64_t>& a) {  // one line: the final newline dropped, others shown
      std::string s = task.decode(a), out;
      if (!s.empty() && s.back() == '\n') s.pop_back();
      for (char c : s) out += c == '\n' ? std::string("\\n") : std::string(1, c);
      return out;
    };
    const auto want = task.answer(problems[i]);
    lines.push_back(task.decode(prompt) + strip(answers[i]) +
                    (answers[i] == want ? "  ok" : "  want " + strip(want)));
  }
  return lines;
}

}  // namespace sg::io

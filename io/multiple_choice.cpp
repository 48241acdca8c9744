#include "io/multiple_choice.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <fstream>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "core/error.h"
#include "io/file.h"

namespace sg::io {

static_assert(std::endian::native == std::endian::little, "eval files are little-endian, as is this host");

namespace {
constexpr uint16_t kStart = 65535;  // the word that opens every example
}  // namespace

void write_choice_file(const std::string& path, const std::vector<ChoiceExample>& examples) {
  SG_CHECK(examples.size() < 65536, "eval file ", path, ": ", examples.size(),
           " examples; an example's index is a 16-bit word (at most 65535 examples)");
  std::vector<uint16_t> stream;
  int32_t longest = 0;
  for (size_t i = 0; i < examples.size(); ++i) {
    const ChoiceExample& e = examples[i];
    const size_t begin = stream.size();
    auto put_tokens = [&](const std::vector<int32_t>& toks, const char* what) {
      stream.push_back(uint16_t(toks.size()));
      for (int32_t t : toks) {
        SG_CHECK(t >= 0 && t < kStart, "eval file ", path, ": example ", i, ": ", what, " token ", t,
                 " is outside 0..65534");
        stream.push_back(uint16_t(t));
      }
    };
    SG_CHECK(!e.endings.empty() && e.label >= 0 && e.label < int64_t(e.endings.size()), "eval file ", path,
             ": example ", i, ": label ", e.label, " with ", e.endings.size(), " endings");
    stream.insert(stream.end(), {kStart, 0, uint16_t(i), uint16_t(e.label), uint16_t(e.endings.size())});
    put_tokens(e.context, "context");
    for (const auto& end : e.endings) put_tokens(end, "ending");
    const size_t bytes = 2 * (stream.size() - begin);
    SG_CHECK(bytes < 65536, "eval file ", path, ": example ", i, " takes ", bytes,
             " bytes; its size is a 16-bit word (at most 65535)");
    stream[begin + 1] = uint16_t(bytes);
    longest = std::max(longest, int32_t(bytes));
  }
  int32_t header[256] = {};
  header[0] = kChoiceMagic;
  header[1] = kChoiceVersion;
  header[2] = int32_t(examples.size());
  header[3] = longest;
  write_file_atomic(path, "eval file", [&](const ByteSink& sink) {
    sink(header, sizeof(header));
    sink(stream.data(), stream.size() * sizeof(uint16_t));
  });
}

std::vector<ChoiceExample> read_choice_file(const std::string& path, int64_t limit) {
  ReadFile f(path, "eval file");
  const LlmcHeader h = read_llmc_header(f, "eval file", kChoiceMagic, kChoiceVersion,
                                        "not an llm.c multiple-choice eval file such as hellaswag_val.bin?", "example");
  SG_CHECK((f.size() - kLlmcHeaderBytes) % 2 == 0, "eval file ", path, ": ", f.size() - kLlmcHeaderBytes,
           " bytes after the header, not a whole number of 16-bit words");
  std::vector<uint16_t> w(size_t((f.size() - kLlmcHeaderBytes) / 2));
  f.read_at(w.data(), w.size() * 2, kLlmcHeaderBytes);

  const int64_t n = limit > 0 ? std::min<int64_t>(limit, h.count) : h.count;
  std::vector<ChoiceExample> out;
  out.reserve(size_t(std::min<int64_t>(n, int64_t(w.size()) / 9)));  // an example takes 9 words at least: not the header's word
  size_t at = 0;  // the word being read
  for (int64_t i = 0; i < n; ++i) {
    const size_t begin = at;
    auto where = [&] { return str("eval file ", path, ": example ", i, " (byte ", kLlmcHeaderBytes + 2 * int64_t(begin), ")"); };
    auto word = [&]() -> uint16_t {
      SG_CHECK(at < w.size(), where(), ": the file ends inside it (the header promises ", h.count, " examples)");
      return w[at++];
    };
    auto tokens = [&](const char* what) {
      const uint16_t len = word();
      SG_CHECK(len > 0, where(), ": an empty ", what);
      std::vector<int32_t> t(len);
      for (auto& x : t) x = word();
      return t;
    };
    const uint16_t start = word();
    SG_CHECK(start == kStart, where(), ": starts with ", start, ", not the example marker 65535");
    const uint16_t bytes = word(), index = word();
    SG_CHECK(index == uint16_t(i), where(), ": its index says ", index);
    SG_CHECK(bytes <= h.field3, where(), ": ", bytes, " bytes, more than the header's longest example, ", h.field3);
    ChoiceExample e;
    e.label = word();
    const uint16_t endings = word();
    SG_CHECK(endings > 0 && e.label < endings, where(), ": label ", e.label, " with ", endings, " endings");
    e.context = tokens("context");
    for (uint16_t k = 0; k < endings; ++k) e.endings.push_back(tokens("ending"));
    SG_CHECK(2 * (at - begin) == bytes, where(), ": says it is ", bytes, " bytes but its fields take ", 2 * (at - begin));
    out.push_back(std::move(e));
  }
  SG_CHECK(n < h.count || at == w.size(), "eval file ", path, ": ", 2 * (w.size() - at),
           " bytes after the last of its ", h.count, " examples");
  return out;
}

void check_choice_tokens(const std::vector<ChoiceExample>& examples, int64_t vocab, const std::string& where,
                         const std::string& hint) {
  for (size_t i = 0; i < examples.size(); ++i) {
    int32_t top = 0;
    for (int32_t t : examples[i].context) top = std::max(top, t);
    for (const auto& end : examples[i].endings)
      for (int32_t t : end) top = std::max(top, t);
    SG_CHECK(top < vocab, where, ": example ", i, " has token ", top, ", outside the vocabulary of ", vocab, hint);
  }
}

ChoiceRows choice_rows(const std::vector<ChoiceExample>& examples, size_t first, size_t count, int64_t block_size,
                       int64_t multiple) {
  SG_CHECK(first + count <= examples.size() && count > 0, "choice_rows: examples [", first, ", ", first + count,
           ") of ", examples.size());
  const int64_t limit = block_size - block_size % multiple;  // the longest row that rounds up within block_size
  struct Row {
    std::vector<int32_t> tokens;  // context (cropped) + ending
    int64_t counted_from;         // the first position whose target is an ending's
  };
  std::vector<Row> rows;
  int64_t L = 1;
  for (size_t i = first; i < first + count; ++i) {
    const ChoiceExample& e = examples[i];
    int64_t longest = 0;
    for (const auto& end : e.endings) longest = std::max<int64_t>(longest, int64_t(end.size()));
    // Inputs are the row but its last token: context + ending - 1 positions, at most `limit`.
    SG_CHECK(longest <= limit, "eval example ", i, ": an ending of ", longest, " tokens does not fit the model's ",
             limit, " positions after a token of context");
    const int64_t keep = std::min<int64_t>(int64_t(e.context.size()), limit + 1 - longest);
    for (const auto& end : e.endings) {
      Row r;
      r.tokens.assign(e.context.end() - keep, e.context.end());
      r.tokens.insert(r.tokens.end(), end.begin(), end.end());
      r.counted_from = keep - 1;
      L = std::max<int64_t>(L, int64_t(r.tokens.size()) - 1);
      rows.push_back(std::move(r));
    }
  }
  L = (L + multiple - 1) / multiple * multiple;
  const int64_t R = int64_t(rows.size());
  std::vector<int64_t> in(size_t(R * L), 0), tgt(size_t(R * L), -1);
  ChoiceRows out;
  for (int64_t r = 0; r < R; ++r) {
    const Row& row = rows[size_t(r)];
    const int64_t n = int64_t(row.tokens.size()) - 1;
    for (int64_t t = 0; t < n; ++t) {
      in[size_t(r * L + t)] = row.tokens[size_t(t)];
      if (t >= row.counted_from) tgt[size_t(r * L + t)] = row.tokens[size_t(t + 1)];
    }
    out.ending_tokens.push_back(n - row.counted_from);
  }
  out.inputs = from_vector(std::move(in), {R, L});
  out.targets = from_vector(std::move(tgt), {R, L});
  return out;
}

ChoiceScore score_choices(const std::vector<ChoiceExample>& examples, const ChoiceLogitsFn& logits_fn, int64_t vocab,
                          int64_t block_size, int64_t multiple, int64_t batch_examples,
                          const std::function<void(int64_t, int64_t)>& progress) {
  autograd::NoGradGuard ng;
  ChoiceScore s;
  CrossEntropyOptions o;
  o.vocab = vocab;
  o.sum = true;  // divided by the ending's length here: a mean would count the targets on the device, a wait a row
  const size_t per = size_t(std::max<int64_t>(1, batch_examples));
  for (size_t first = 0; first < examples.size(); first += per) {
    const size_t count = std::min(per, examples.size() - first);
    const ChoiceRows rows = choice_rows(examples, first, count, block_size, multiple);
    const Tensor logits = logits_fn(rows.inputs), tgt = to(rows.targets, logits.device());
    SG_CHECK(logits.dim() == 3 && logits.size(0) == rows.inputs.size(0) && logits.size(1) == rows.inputs.size(1),
             "score_choices: logits ", shape_str(logits.shape()), " for rows ", shape_str(rows.inputs.shape()));
    // Each row's mean over its ending: the cross-entropy of that row's logits alone.
    std::vector<Tensor> per_row;
    for (int64_t r = 0; r < logits.size(0); ++r)
      per_row.push_back(reshape(cross_entropy(narrow(logits, 0, r, 1), narrow(tgt, 0, r, 1), o), {1}));
    std::vector<double> loss = to_vector<double>(to(to(cat(per_row, 0), Device::cpu()), DType::f64));
    for (size_t k = 0; k < loss.size(); ++k) loss[k] /= double(rows.ending_tokens[k]);
    size_t r = 0;
    for (size_t i = first; i < first + count; ++i) {
      const ChoiceExample& e = examples[i];
      std::vector<double> mean(loss.begin() + long(r), loss.begin() + long(r + e.endings.size()));
      int64_t best = 0, best_sum = 0;  // ties go to the first ending, as argmin's do
      const auto sum = [&](size_t k) { return mean[k] * double(rows.ending_tokens[r + k]); };
      for (size_t k = 1; k < mean.size(); ++k) {
        if (mean[k] < mean[size_t(best)]) best = int64_t(k);
        if (sum(k) < sum(size_t(best_sum))) best_sum = int64_t(k);
      }
      r += e.endings.size();
      s.chosen.push_back(best);
      s.chosen_sum.push_back(best_sum);
      s.mean_loss.push_back(std::move(mean));
      s.correct_norm += best == e.label;
      s.correct_sum += best_sum == e.label;
      ++s.examples;
    }
    if (progress) progress(int64_t(first + count), int64_t(examples.size()));
  }
  return s;
}

std::vector<ChoiceExample> hellaswag_from_jsonl(const std::string& path,
                                                const std::function<std::vector<int64_t>(const std::string&)>& encode) {
  std::ifstream in(path);
  SG_CHECK(in, "hellaswag ", path, ": cannot open the file");
  auto ids = [](const std::vector<int64_t>& v) { return std::vector<int32_t>(v.begin(), v.end()); };
  std::vector<ChoiceExample> out;
  std::string line;
  for (int64_t no = 1; std::getline(in, line); ++no) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = str("hellaswag ", path, ": line ", no);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw Error(str(where, ": not JSON (", e.what(), ")"));
    }
    SG_CHECK(j.is_object() && j.contains("ctx") && j["ctx"].is_string(), where, ": no \"ctx\" string");
    SG_CHECK(j.contains("endings") && j["endings"].is_array() && !j["endings"].empty(), where,
             ": no \"endings\" list");
    // rowanz/hellaswag's files hold the label as a number, Hugging Face datasets' copy as a string
    // of one digit ("" in the test split, which has no labels).
    const nlohmann::json label = j.value("label", nlohmann::json());
    const std::string text = label.is_string() ? label.get<std::string>() : "";
    const bool digits = !text.empty() && text.size() <= 3 && text.find_first_not_of("0123456789") == std::string::npos;
    SG_CHECK(label.is_number_integer() || digits, where,
             ": no integer \"label\" (the test split has none: use the validation split, hellaswag_val.jsonl)");
    ChoiceExample e;
    e.label = digits ? std::stoll(text) : label.get<int64_t>();
    SG_CHECK(e.label >= 0 && e.label < int64_t(j["endings"].size()), where, ": label ", e.label, " with ",
             j["endings"].size(), " endings");
    e.context = ids(encode(j["ctx"].get<std::string>()));
    SG_CHECK(!e.context.empty(), where, ": an empty context");
    for (const auto& end : j["endings"]) {
      SG_CHECK(end.is_string(), where, ": an ending that is not a string");
      e.endings.push_back(ids(encode(str(" ", end.get<std::string>()))));
    }
    out.push_back(std::move(e));
  }
  SG_CHECK(!in.bad(), "hellaswag ", path, ": read error");
  return out;
}

}  // namespace sg::io

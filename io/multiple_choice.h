// Multiple-choice evaluations in llm.c's file format (HellaSwag: its dev/data/hellaswag.py writes
// hellaswag_val.bin, 10,042 examples). A header of 256 little-endian int32 words (word 0 = magic
// 20240522, word 1 = version 1, word 2 = the example count, word 3 = the longest example's bytes),
// then each example as uint16 words:
//   65535, the example's bytes (these words included), its index (0, 1, ... in order), the label
//   (the right ending), the ending count, the context's token count and tokens, then for each
//   ending its token count and tokens.
// An example is scored as llm.c and the HellaSwag script score it "completion style": each ending
// follows the context in a row of its own, and the ending whose tokens have the lowest mean
// cross-entropy is the model's answer (acc_norm; the lowest summed cross-entropy gives acc).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/file.h"  // kChoiceMagic

namespace sg::io {

constexpr int32_t kChoiceVersion = 1;

struct ChoiceExample {
  int64_t label = 0;
  std::vector<int32_t> context;
  std::vector<std::vector<int32_t>> endings;
};

// Writes the file atomically. Refuses what the format cannot hold (a token of 65535 or more, an
// example over 65535 bytes, 65536 examples or more), naming the example.
void write_choice_file(const std::string& path, const std::vector<ChoiceExample>& examples);
// The file's first `limit` examples (0: all), validated: every error names the file, the example
// and its byte offset.
std::vector<ChoiceExample> read_choice_file(const std::string& path, int64_t limit = 0);

// Refuses an example holding a token >= vocab: "<where>: example I has token T, outside the
// vocabulary of V<hint>".
void check_choice_tokens(const std::vector<ChoiceExample>& examples, int64_t vocab, const std::string& where,
                         const std::string& hint = "");

// One forward's rows: every ending of examples [first, first + count) after its context, padded
// at the end to a common length that is a multiple of `multiple` (causal attention: the padding
// changes nothing before it). targets are the next token where it is an ending's, -1 elsewhere.
// A context too long for block_size loses its oldest tokens; an ending that does not fit is refused.
struct ChoiceRows {
  Tensor inputs, targets;  // [rows, L] i64
  std::vector<int64_t> ending_tokens;  // per row: the targets counted
};
ChoiceRows choice_rows(const std::vector<ChoiceExample>& examples, size_t first, size_t count, int64_t block_size,
                       int64_t multiple = 1);

struct ChoiceScore {
  int64_t examples = 0, correct_norm = 0, correct_sum = 0;
  double accuracy_norm() const { return examples ? double(correct_norm) / double(examples) : 0.0; }
  double accuracy_sum() const { return examples ? double(correct_sum) / double(examples) : 0.0; }
  std::vector<int64_t> chosen, chosen_sum;  // per example: the ending of lowest mean, of lowest summed loss
  std::vector<std::vector<double>> mean_loss;  // per example and ending: the mean cross-entropy of its tokens
};
// Runs `batch_examples` examples at a time through logits_fn (idx [rows, L] on the host -> logits
// [rows, L, >= vocab] on any device; columns from `vocab` on are padding and never count) and
// scores them. `progress(done, total)` is called after each batch when given.
using ChoiceLogitsFn = std::function<Tensor(const Tensor& idx)>;
ChoiceScore score_choices(const std::vector<ChoiceExample>& examples, const ChoiceLogitsFn& logits_fn, int64_t vocab,
                          int64_t block_size, int64_t multiple, int64_t batch_examples,
                          const std::function<void(int64_t, int64_t)>& progress = {});

// HellaSwag's own jsonl (rowanz/hellaswag: one object a line with "ctx", "endings", "label") made
// into examples with `encode`: the context as it is, each ending after a space, as GPT-2's
// tokenizer wants it (llm.c's preparation does the same). Errors name the file and line.
std::vector<ChoiceExample> hellaswag_from_jsonl(const std::string& path,
                                                const std::function<std::vector<int64_t>(const std::string&)>& encode);

}  // namespace sg::io

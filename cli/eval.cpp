// shardgrad eval: a trained model's accuracy on an llm.c multiple-choice eval file (HellaSwag), one
// process, as llm.c and its dev/data/hellaswag.py score it (io/multiple_choice.h).
#include <chrono>
#include <cstdio>
#include <algorithm>

#include <nlohmann/json.hpp>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "cli/model_from.h"
#include "io/file.h"
#include "io/multiple_choice.h"

namespace sg::cli {

int eval_main(int argc, char** argv) {
  Args a("eval", "Score a model on an llm.c multiple-choice eval file (HellaSwag): the ending of lowest mean loss.");
  a.flag("from", "", "checkpoint directory (run or step; auto:DIR for the newest complete one of a run) or a .safetensors file");
  a.flag("hellaswag", "", "the eval file: hellaswag_val.bin from llm.c's dev/data/hellaswag.py, or "
         "`shardgrad tokenize --format hellaswag`");
  a.flag("examples", "0", "the file's first N examples (0 = all)");
  a.flag("batch-size", "64", "rows per forward (each example takes a row per ending, 4 for HellaSwag)");
  a.flag("n-head", "0", "head count, for files that do not record it");
  a.flag("device", "cpu", "cpu or cuda:N");
  a.flag("dtype", "fp32", "fp32 | bf16 | fp16: the weights and activations (the file's values rounded to it)");
  a.flag("log-json", "", "write one JSON object per example (its label, the chosen endings, each ending's mean loss), "
         "then one with the totals");
  if (!a.parse(argc, argv)) {
    std::printf("%s", a.usage().c_str());
    return 0;
  }
  const std::string file = a.str("hellaswag"), log_path = a.str("log-json");
  SG_CHECK(!file.empty(), "eval: --hellaswag is required (an llm.c multiple-choice eval file)");
  const int64_t limit = a.i64("examples"), rows = a.i64("batch-size");
  SG_CHECK(limit >= 0, "eval: --examples must be >= 0 (0 = all), got ", limit);
  SG_CHECK(rows >= 1, "eval: --batch-size must be >= 1, got ", rows);
  const Device device = parse_device(a.str("device"));
  SG_CHECK(!device.is_meta(), "eval: --device ", device.str(), " holds no values to score with");
  if (!log_path.empty()) io::make_parent_folder(log_path, "eval: --log-json");
  const std::vector<io::ChoiceExample> examples = io::read_choice_file(file, limit);
  SG_CHECK(!examples.empty(), "eval: --hellaswag ", file, " holds no examples");
  if (limit > int64_t(examples.size()))
    std::printf("note: --examples %lld: %s holds %zu; all are scored\n", (long long)limit, file.c_str(), examples.size());
  const ModelFrom m = model_from(a, model_dtype(a), device);
  io::check_choice_tokens(examples, m.cfg.vocab_size, str("eval: --hellaswag ", file), str(" (", m.file, ")"));

  DropoutOff eval_mode;
  const auto start = std::chrono::steady_clock::now();
  auto shown = start;
  const auto progress = [&](int64_t done, int64_t total) {
    const auto now = std::chrono::steady_clock::now();
    if (done < total && now - shown < std::chrono::seconds(10)) return;
    shown = now;
    std::printf("%lld of %lld examples (%.1f s)\n", (long long)done, (long long)total,
                std::chrono::duration<double>(now - start).count());
    std::fflush(stdout);
  };
  const nn::GPT& model = *m.model;
  const io::ChoiceScore s = io::score_choices(
      examples, [&](const Tensor& idx) { return model.forward(to(idx, device)); }, m.cfg.vocab_size,
      m.cfg.block_size, 1, std::max<int64_t>(1, rows / 4), progress);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("hellaswag %s: %lld examples | acc_norm %.4f (%lld right; the lowest mean loss, as llm.c) | acc %.4f "
              "(%lld; the lowest summed loss) | %.1f s\n",
              file.c_str(), (long long)s.examples, s.accuracy_norm(), (long long)s.correct_norm, s.accuracy_sum(),
              (long long)s.correct_sum, seconds);
  if (!log_path.empty()) {
    std::string text;
    for (size_t i = 0; i < examples.size(); ++i)
      text += nlohmann::json{{"example", i}, {"label", examples[i].label}, {"chosen", s.chosen[i]},
                             {"chosen_sum", s.chosen_sum[i]}, {"mean_loss", s.mean_loss[i]}}.dump() + "\n";
    text += nlohmann::json{{"examples", s.examples}, {"accuracy", s.accuracy_norm()}, {"accuracy_sum", s.accuracy_sum()},
                           {"correct", s.correct_norm}, {"correct_sum", s.correct_sum}, {"seconds", seconds}}.dump() + "\n";
    io::write_text_atomic(log_path, "eval: --log-json", text);
  }
  return 0;
}

}  // namespace sg::cli

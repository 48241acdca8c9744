// shardgrad generate: sample from a trained model (a checkpoint directory or a .safetensors file).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "cli/model_from.h"
#include "cli/sampling.h"
#include "io/dataset.h"
#include "io/gpt2_tokenizer.h"
#include "models/gpt.h"

namespace sg::cli {

int generate_main(int argc, char** argv) {
  Args a("generate", "Sample from a model trained on bytes, on the synthetic task, or on GPT-2 tokens (--tokenizer).");
  a.flag("from", "", "checkpoint directory (run or step; auto:DIR for the newest complete one of a run) or a .safetensors file");
  a.flag("prompt", "", "text to continue");
  a.flag("max-new-tokens", "64", "tokens to sample (the synthetic task stops at the end of its answer's line)");
  a.flag("temperature", "1.0", "softmax temperature (0 = greedy)");
  a.flag("top-k", "0", "sample among the k most likely tokens (0 = all)");
  a.flag("seed", "42", "sampling seed");
  a.flag("n-head", "0", "head count, for files that do not record it");
  a.flag("data", "", "tokenizer: synthetic or a text file's bytes (default: what the model was trained on)");
  a.flag("tokenizer", "", "GPT-2 tokens: a folder holding GPT-2's vocab.json and merges.txt (an empty prompt starts from <|endoftext|>)");
  a.flag("device", "cpu", "cpu or cuda:N (the model, its KV cache and the forward run there; sampling on the host)");
  a.flag("dtype", "fp32", "fp32 | bf16 | fp16: the weights and activations (the file's values rounded to it)");
  if (!a.parse(argc, argv)) {
    std::printf("%s", a.usage().c_str());
    return 0;
  }
  const int64_t max_new = a.i64("max-new-tokens"), top_k = a.i64("top-k");
  const double temperature = a.f64("temperature");
  SG_CHECK(max_new >= 0, "generate: --max-new-tokens must be >= 0");
  SG_CHECK(temperature >= 0, "generate: --temperature must be >= 0");
  SG_CHECK(top_k >= 0, "generate: --top-k must be >= 0");
  const Device device = parse_device(a.str("device"));
  SG_CHECK(!device.is_meta(), "generate: --device ", device.str(), " holds no values to sample from");
  const DType dtype = model_dtype(a);

  const ModelFrom m = model_from(a, dtype, device);
  const nn::GPTConfig& cfg = m.cfg;
  const nn::GPT& model = *m.model;
  const io::SafetensorsFile& weights = m.weights;
  const std::string& file = m.file;

  // Text <-> ids: GPT-2's tokenizer, or the tokens of the data the model was trained on.
  std::function<std::vector<int64_t>(const std::string&)> encode;
  std::function<std::string(const std::vector<int64_t>&)> decode;
  std::unique_ptr<io::Dataset> tok;
  std::unique_ptr<io::Gpt2Tokenizer> bpe;
  int64_t sample_vocab = cfg.vocab_size;  // ids that may be drawn
  std::string data = a.str("data");
  if (data.empty()) {
    auto it = weights.metadata.find("data");
    data = it != weights.metadata.end() ? it->second : "";
  }
  if (!a.str("tokenizer").empty()) {
    SG_CHECK(!a.given("data"), "generate: give --tokenizer or --data, not both");
    bpe = std::make_unique<io::Gpt2Tokenizer>(io::Gpt2Tokenizer::load(a.str("tokenizer")));
    SG_CHECK(bpe->vocab_size() <= cfg.vocab_size, "generate: the tokenizer ", bpe->source(), " has ",
             bpe->vocab_size(), " tokens, more than the model's vocabulary of ", cfg.vocab_size, " (", file, ")");
    sample_vocab = bpe->vocab_size();
    encode = [&](const std::string& t) {
      if (!t.empty()) return bpe->encode(t);
      SG_CHECK(bpe->eot() >= 0, "generate: the prompt is empty and the tokenizer ", bpe->source(),
               " has no <|endoftext|> to start from (give --prompt)");
      return std::vector<int64_t>{bpe->eot()};
    };
    decode = [&](const std::vector<int64_t>& ids) { return bpe->decode(ids); };
  } else {
    SG_CHECK(!data.empty(), "generate: ", file, " does not say what data it was trained on; pass --data, or --tokenizer for GPT-2 tokens");
    SG_CHECK(!io::is_shard_spec(data), "generate: ", file, " was trained on GPT-2 token shards (", data,
             "); pass --tokenizer, a folder with GPT-2's vocab.json and merges.txt");
    // A text file's tokens are its bytes: they need no file, so a model moved away from the text
    // it was trained on still samples.
    const bool text = !io::is_generated_spec(data);
    if (text && !a.given("data") && !std::filesystem::exists(data)) {
      std::fprintf(stderr, "generate: %s was trained on the bytes of %s, which is not here; bytes need no file\n",
                   file.c_str(), data.c_str());
      sample_vocab = 256;
      encode = io::encode_bytes;
      decode = io::decode_bytes;
    } else {
      io::DataOptions opt;
      opt.spec = data;
      tok = io::open_dataset(opt);
      sample_vocab = tok->vocab_size();
      encode = [&](const std::string& t) { return tok->encode(t); };
      decode = [&](const std::vector<int64_t>& ids) { return tok->decode(ids); };
    }
    // Ids past the data's are never sampled (a model may have more rows than its data's tokens);
    // data with more tokens than the model has rows is other data than it learned.
    SG_CHECK(sample_vocab <= cfg.vocab_size, "generate: the data ", data, " has ", sample_vocab,
             " tokens, more than the model's vocabulary of ", cfg.vocab_size, " (", file,
             "): it was trained on other data; give the --data it was trained on");
  }

  // The synthetic task's answer ends with its line: sampling stops there (its numbers are written
  // least-significant digit first: 321+540= asks 123 + 45).
  const int64_t stop = tok && data.rfind("synthetic", 0) == 0 ? tok->encode("\n").at(0) : -1;
  std::vector<int64_t> ids = encode(a.str("prompt"));
  SG_CHECK(!ids.empty(), "generate: the prompt is empty (give --prompt)");
  const uint64_t seed = uint64_t(a.i64("seed"));
  autograd::NoGradGuard ng;
  DropoutOff eval_mode;  // sampling is evaluation: no dropout, whatever the weights were trained with
  nn::KVCache cache;  // the keys and values of ids but the last: each step runs one new position (on the device)
  auto on_device = [&](std::vector<int64_t> v) {
    const int64_t n = int64_t(v.size());
    return to(from_vector(std::move(v), {1, n}), device);
  };
  // Each token is written as it is drawn (every decode here is the concatenation of its tokens'):
  // a long sample shows as it grows, and an interrupted one keeps what it had.
  std::fwrite(a.str("prompt").data(), 1, a.str("prompt").size(), stdout);
  std::fflush(stdout);
  for (int64_t s = 0; s < max_new; ++s) {
    Tensor logits;
    if (cache.len > 0 && cache.len < cfg.block_size && cache.len + 1 == int64_t(ids.size())) {
      logits = model.forward_cached(on_device({ids.back()}), cache);
    } else {  // the prompt, or a window that slid past block_size: its last block_size ids afresh
      const int64_t start = std::max<int64_t>(0, int64_t(ids.size()) - cfg.block_size);
      std::vector<int64_t> window(ids.begin() + start, ids.end());
      cache = nn::KVCache{};
      logits = model.forward_cached(on_device(std::move(window)), cache);
    }
    std::vector<float> last = to_vector<float>(narrow(logits, 1, logits.size(1) - 1, 1));  // to the host, in f32
    last.resize(size_t(sample_vocab));  // the padded columns (and ids past the tokenizer's) are never sampled
    SG_CHECK(std::all_of(last.begin(), last.end(), [](float x) { return std::isfinite(x); }), "\ngenerate: the logits ",
             "after ", ids.size(), " tokens are not finite: ", file, "'s weights overflow the forward in ",
             a.str("dtype"), " (its weights themselves are finite: loading checks them)");
    const int64_t next = draw_token(last, temperature, top_k, seed, uint64_t(s));
    ids.push_back(next);
    if (next == stop) break;
    const std::string piece = decode({next});
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
  }
  std::printf("\n");
  return 0;
}

}  // namespace sg::cli

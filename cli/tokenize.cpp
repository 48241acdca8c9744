// shardgrad tokenize: text files -> one llm.c token shard of GPT-2 tokens, which `train --data`
// reads (a single shard: its last tenth is the held-out split). Each file is one document and, as
// llm.c's preprocessing does, starts with <|endoftext|>. --format hellaswag: HellaSwag's jsonl ->
// llm.c's multiple-choice eval file, which `train --hellaswag` scores.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "io/file.h"
#include "io/gpt2_tokenizer.h"
#include "io/multiple_choice.h"
#include "io/token_shards.h"

namespace sg::cli {

int tokenize_main(int argc, char** argv) {
  Args a("tokenize", "Turn text files into an llm.c token shard (GPT-2's tokenizer) for train --data, or HellaSwag "
                     "into an eval file for train --hellaswag.");
  a.positional_list("text", "text files or quoted globs ('corpus/*.txt', its files in name order); each file is one document");
  a.flag("tokenizer", "", "folder holding GPT-2's vocab.json and merges.txt (as a Hugging Face GPT-2 folder does)");
  a.flag("out", "", "the .bin file to write (must not exist)");
  a.flag("format", "text", "text: the files' text as one token shard | hellaswag: HellaSwag's jsonl (rowanz/hellaswag's "
         "hellaswag_val.jsonl) as an llm.c multiple-choice eval file, for train --hellaswag");
  if (!a.parse(argc, argv)) {
    std::printf("%s", a.usage().c_str());
    return 0;
  }
  const std::string out = a.str("out");
  SG_CHECK(!a.str("tokenizer").empty(), "tokenize: --tokenizer is required (a folder with vocab.json and merges.txt)");
  SG_CHECK(!out.empty(), "tokenize: --out is required");
  SG_CHECK(!std::filesystem::exists(out), "tokenize: ", out, " already exists; refusing to overwrite it");
  const io::Gpt2Tokenizer tok = io::Gpt2Tokenizer::load(a.str("tokenizer"));
  SG_CHECK(tok.vocab_size() <= 65536, "tokenize: the tokenizer ", tok.source(), " has ", tok.vocab_size(),
           " tokens; a token shard stores 16-bit ids (at most 65536)");
  const std::string format = a.str("format");
  SG_CHECK(format == "text" || format == "hellaswag", "tokenize: --format must be text or hellaswag, got ", format);
  std::vector<std::string> files;
  for (const std::string& t : a.list("text"))
    for (std::string& f : io::expand_glob(t, "tokenize:")) files.push_back(std::move(f));
  // Every input is checked before the first is tokenized (a folder matched by a glob, a file that
  // cannot be read) and before --out's folder is made: not after hours of a corpus.
  for (const std::string& f : files) {
    SG_CHECK(!std::filesystem::is_directory(f), "tokenize: ", f, " is a folder, not a text file");
    SG_CHECK(std::ifstream(f).good(), "tokenize: cannot read ", f);
  }
  io::make_parent_folder(out, "tokenize: --out");
  if (format == "hellaswag") {
    SG_CHECK(files.size() == 1, "tokenize: --format hellaswag reads one jsonl file, got ", files.size());
    const auto examples = io::hellaswag_from_jsonl(files[0], [&](const std::string& s) { return tok.encode(s); });
    SG_CHECK(!examples.empty(), "tokenize: ", files[0], " holds no examples");
    io::write_choice_file(out, examples);
    std::printf("wrote %s: %zu examples from %s; evaluate with train --hellaswag %s\n", out.c_str(), examples.size(),
                files[0].c_str(), out.c_str());
    return 0;
  }

  const auto t0 = std::chrono::steady_clock::now();
  std::vector<uint16_t> tokens;
  int64_t bytes = 0;
  for (const std::string& path : files) {
    const std::string text = io::read_file(path, "tokenize");
    const size_t before = tokens.size();
    if (tok.eot() >= 0) tokens.push_back(uint16_t(tok.eot()));
    constexpr size_t kPart = size_t(1) << 20, kReport = size_t(64) << 20;
    size_t reported = 0;
    auto progress = [&](size_t done) {  // a line per 64 MiB of a long file
      if (done - reported < kReport || done == text.size()) return;
      std::printf("  %s: %.0f of %.0f MiB\n", path.c_str(), double(done) / (1 << 20), double(text.size()) / (1 << 20));
      std::fflush(stdout);
      reported = done;
    };
    for (int64_t id : tok.encode_chunks(text, kPart, progress)) tokens.push_back(uint16_t(id));
    bytes += int64_t(text.size());
    std::printf("%s: %zu bytes -> %zu tokens\n", path.c_str(), text.size(), tokens.size() - before);
    std::fflush(stdout);
  }
  io::write_token_shard(out, tokens);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // A shard does not record its vocabulary; train takes GPT-2's 50257 unless told fewer.
  const std::string vocab = tok.vocab_size() == io::kGpt2Vocab ? "" : " --vocab-size " + std::to_string(tok.vocab_size());
  std::printf("wrote %s: %zu tokens from %zu file%s (%.2f bytes per token, %.1f MB/s); train with --data %s%s\n",
              out.c_str(), tokens.size(), files.size(), files.size() == 1 ? "" : "s",
              tokens.empty() ? 0.0 : double(bytes) / double(tokens.size()), double(bytes) / 1e6 / std::max(s, 1e-9),
              out.c_str(), vocab.c_str());
  return 0;
}

}  // namespace sg::cli

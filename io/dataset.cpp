// File-backed datasets (a text file as bytes, llm.c token shards) and the spec dispatch.
//
// A split is one stream of tokens: its shards concatenated in name order (a window may straddle two
// shards; llm.c starts every document with <|endoftext|>, so a shard boundary is just another
// document boundary), or the head / tail of a single file.
//   sequential (default, as llm.c): batch k takes the next B*T+1 tokens of the stream as B rows
//     (inputs = tokens[0, BT), targets = tokens[1, BT]) and advances by B*T; when the next batch
//     would run past the end it starts again at token 0. position() is the token offset.
//   shuffle: row n of the stream (row r of batch k is n = kB + r at a fixed B) starts at a token
//     drawn by Philox from (seed, split stream, n), uniform over every start that leaves T+1 tokens
//     (rows drawn with replacement). position() is the number of rows drawn.
// Tokens are read from disk per batch, never the whole split into memory.
#include "io/dataset.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <cstdlib>
#include <memory>

#include "autograd/ops.h"
#include "core/philox.h"
#include "io/file.h"
#include "io/synthetic.h"
#include "io/token_shards.h"

namespace sg::io {

namespace {

const char* split_name(Split s) { return s == Split::train ? "train" : "val"; }

class FileDataset : public Dataset {
 public:
  FileDataset(std::string spec, std::string kind, int64_t vocab, std::vector<TokenRange> ranges, const DataOptions& opt)
      : spec_(std::move(spec)), kind_(std::move(kind)), vocab_(vocab), ranges_(std::move(ranges)), split_(opt.split),
        seed_(opt.seed), shuffle_(opt.shuffle),
        stream_(rng_stream_from_name(opt.split == Split::train ? "io.shuffle.train" : "io.shuffle.val")) {
    for (const TokenRange& r : ranges_) {
      starts_.push_back(total_);
      total_ += r.count;
    }
    files_.resize(ranges_.size());
    SG_CHECK(total_ > 0, "data ", spec_, ": the ", split_name(split_), " split is empty");
  }

  void check_batch(int64_t B, int64_t T) const override {
    SG_CHECK(B > 0 && T > 0, "data ", spec_, ": batch shape B=", B, ", T=", T, " must be positive");
    const int64_t need = shuffle_ ? T + 1 : B * T + 1;
    SG_CHECK(total_ >= need, "data ", spec_, ": the ", split_name(split_), " split has ", total_, " tokens, fewer than ",
             shuffle_ ? str("one row needs (T+1 = ", need, ")") : str("one batch needs (B*T+1 = ", need, ")"));
  }

  Batch next(int64_t B, int64_t T) override {
    check_batch(B, T);
    std::vector<int64_t> inputs(size_t(B * T)), targets(size_t(B * T));
    if (shuffle_) {
      std::vector<int64_t> row(size_t(T + 1));
      for (int64_t r = 0; r < B; ++r) {
        uint32_t w[4];
        Philox::words(seed_, stream_, uint64_t(pos_) + uint64_t(r), w);
        const uint64_t draw = (uint64_t(w[0]) << 32) | w[1];
        read(int64_t(draw % uint64_t(total_ - T)), T + 1, row.data());
        std::copy(row.begin(), row.end() - 1, inputs.begin() + r * T);
        std::copy(row.begin() + 1, row.end(), targets.begin() + r * T);
      }
      pos_ += B;
    } else {
      const int64_t need = B * T + 1;
      if (pos_ + need > total_) pos_ = 0;
      std::vector<int64_t> buf(static_cast<size_t>(need));
      read(pos_, need, buf.data());
      std::copy(buf.begin(), buf.end() - 1, inputs.begin());
      std::copy(buf.begin() + 1, buf.end(), targets.begin());
      pos_ += B * T;
    }
    return {from_vector(inputs, {B, T}), from_vector(targets, {B, T})};
  }

  int64_t position() const override { return pos_; }
  void set_position(int64_t p) override {
    SG_CHECK(p >= 0, "data ", spec_, ": position ", p, " is negative");
    pos_ = p;
  }
  bool draws_rows() const override { return shuffle_; }
  int64_t vocab_size() const override { return vocab_; }
  void restrict_vocab(int64_t v) override {
    if (kind_ != "token shards" || v <= 0) {
      Dataset::restrict_vocab(v);
      return;  // a larger model reads the bytes as they are
    }
    SG_CHECK(v <= 65536, "data ", spec_, ": token shards hold uint16 ids; a vocabulary of ", v, " is past their 65536");
    vocab_ = v;  // another tokenizer's: fewer than GPT-2's 50257, or more
  }

  std::string describe() const override {
    // The files by name (the first and last of many): which shards are held out is seen, not guessed.
    const auto name = [&](size_t i) { return std::filesystem::path(ranges_[i].path).filename().string(); };
    std::string files;
    for (size_t i = 0; i < ranges_.size(); ++i) {
      if (ranges_.size() > 3 && i > 0 && i + 1 < ranges_.size()) {
        if (i == 1) files += ", ...";
        continue;
      }
      files += (i ? ", " : "") + name(i);
    }
    return str(kind_, " ", spec_, " (vocab ", vocab_, "): ", split_name(split_), " split of ", total_, " tokens in ",
               ranges_.size(), ranges_.size() == 1 ? " file" : " files", " (", files, "), ",
               shuffle_ ? "random rows" : "sequential");
  }

  std::vector<int64_t> encode(const std::string& text) const override {
    SG_CHECK(kind_ == "text bytes", "data ", spec_, ": token shards carry no tokenizer (io::Gpt2Tokenizer encodes GPT-2 tokens)");
    return encode_bytes(text);
  }

  std::string decode(const std::vector<int64_t>& tokens) const override {
    SG_CHECK(kind_ == "text bytes", "data ", spec_, ": token shards carry no tokenizer (io::Gpt2Tokenizer decodes GPT-2 tokens)");
    return decode_bytes(tokens);
  }

 private:
  // Tokens [pos, pos + n) of the split's stream, which may span several files.
  void read(int64_t pos, int64_t n, int64_t* out) {
    size_t i = size_t(std::upper_bound(starts_.begin(), starts_.end(), pos) - starts_.begin()) - 1;
    std::vector<uint8_t> raw;
    while (n > 0) {
      const TokenRange& r = ranges_[i];
      const int64_t first = pos - starts_[i];
      const int64_t take = std::min(n, r.count - first);
      if (!files_[i]) files_[i] = std::make_unique<ReadFile>(r.path, "data");
      raw.resize(size_t(take * r.elem_bytes));
      files_[i]->read_at(raw.data(), raw.size(), r.data_offset + (r.first + first) * r.elem_bytes);
      for (int64_t k = 0; k < take; ++k) {
        const int64_t t = r.elem_bytes == 1 ? int64_t(raw[size_t(k)])
                                            : int64_t(raw[size_t(2 * k)]) | int64_t(raw[size_t(2 * k + 1)]) << 8;
        SG_CHECK(t < vocab_, "data ", r.path, ": token ", t, " at index ", r.first + first + k,
                 " is outside the vocabulary of ", vocab_);
        out[k] = t;
      }
      out += take;
      pos += take;
      n -= take;
      ++i;
    }
  }

  std::string spec_, kind_;
  int64_t vocab_;
  std::vector<TokenRange> ranges_;
  std::vector<int64_t> starts_;  // stream offset of each range
  std::vector<std::unique_ptr<ReadFile>> files_;  // opened on first use
  int64_t total_ = 0;
  Split split_;
  uint64_t seed_;
  bool shuffle_;
  uint64_t stream_;
  int64_t pos_ = 0;
};

}  // namespace

namespace {
// "random" or "random:V": uniform token ids in [0, V) (GPT-2's 50257 by default) from Philox, row by
// row (id t of the stream's row n is draw n·(T+1) + t of the split's stream; position() counts
// rows), for sizing and timing a model
// without a corpus: `train --simulate`, throughput runs. Nothing in it can be learned.
class RandomDataset final : public Dataset {
 public:
  RandomDataset(int64_t vocab, Split split, uint64_t seed) : vocab_(vocab), stream_(split == Split::val), seed_(seed) {}
  Batch next(int64_t B, int64_t T) override {
    std::vector<int64_t> in(size_t(B * T)), out(size_t(B * T));
    for (int64_t b = 0; b < B; ++b) {
      const uint64_t row = uint64_t(rows_ + b) * uint64_t(T + 1);
      for (int64_t t = 0; t < T; ++t) {
        in[size_t(b * T + t)] = id(row + uint64_t(t));
        out[size_t(b * T + t)] = id(row + uint64_t(t) + 1);
      }
    }
    rows_ += B;
    return {from_vector(in, {B, T}), from_vector(out, {B, T})};
  }
  int64_t position() const override { return rows_; }
  void set_position(int64_t p) override { rows_ = p; }
  bool draws_rows() const override { return true; }
  int64_t vocab_size() const override { return vocab_; }
  void restrict_vocab(int64_t v) override { vocab_ = v; }  // the ids are drawn, not read: draw fewer
  std::string describe() const override { return str("random tokens (uniform over ", vocab_, " ids)"); }
  std::vector<int64_t> encode(const std::string&) const override {
    throw Error("data random: random tokens have no text to encode (generate needs the model's tokenizer)");
  }
  std::string decode(const std::vector<int64_t>&) const override {
    throw Error("data random: random tokens have no text to decode (generate needs the model's tokenizer)");
  }

 private:
  int64_t id(uint64_t i) const {
    uint32_t w[4];
    Philox::words(seed_, 0x7a2d0000 + stream_, i, w);
    return int64_t((uint64_t(w[0]) * uint64_t(vocab_)) >> 32);  // multiply-shift: [0, vocab)
  }
  int64_t vocab_;
  uint64_t stream_, seed_;
  int64_t rows_ = 0;
};
}  // namespace

void Dataset::restrict_vocab(int64_t v) {
  SG_CHECK(v >= vocab_size(), "data ", describe(), ": a model of ", v, " tokens cannot read its ", vocab_size(),
           " (the vocabulary must be at least the data's)");
}

bool is_generated_spec(const std::string& s) {
  return s == "synthetic" || s.rfind("synthetic:", 0) == 0 || s == "random" || s.rfind("random:", 0) == 0;
}

std::vector<int64_t> encode_bytes(const std::string& text) {
  std::vector<int64_t> out;
  for (unsigned char c : text) out.push_back(c);
  return out;
}

std::string decode_bytes(const std::vector<int64_t>& ids) {
  std::string out;
  for (int64_t t : ids) out.push_back(t >= 0 && t < 256 ? char(t) : '?');
  return out;
}

bool is_shard_spec(const std::string& s) {
  const bool named_bin = s.size() >= 4 && s.compare(s.size() - 4, 4, ".bin") == 0;
  std::error_code ec;
  if (std::filesystem::is_regular_file(s, ec)) {  // a file of that very name (even with [ ? * in it)
    int32_t magic = 0;
    {
      std::ifstream f(s, std::ios::binary);
      f.read(reinterpret_cast<char*>(&magic), sizeof magic);
    }
    return named_bin || magic == kShardMagic;  // a shard by any name, read as one
  }
  return named_bin || s.find_first_of("*?[") != std::string::npos;
}

std::unique_ptr<Dataset> open_dataset(const DataOptions& opt) {
  const std::string& spec = opt.spec;
  SG_CHECK(!spec.empty(), "data: empty data spec (synthetic, random, a text file, or a glob of .bin token shards)");
  if (spec == "synthetic" || spec.rfind("synthetic:", 0) == 0)
    return std::make_unique<SyntheticDataset>(parse_synthetic_spec(spec), opt.split, opt.seed);
  if (spec == "random" || spec.rfind("random:", 0) == 0) {
    int64_t v = kGpt2Vocab;
    if (spec != "random") {
      const std::string n = spec.substr(7);
      char* end = nullptr;
      v = std::strtoll(n.c_str(), &end, 10);
      SG_CHECK(!n.empty() && *end == 0 && v >= 2 && v <= (int64_t(1) << 31), "data ", spec,
               ": random:V takes the vocabulary size V (2 to 2^31), got '", n, "'");
    }
    return std::make_unique<RandomDataset>(v, opt.split, opt.seed);
  }
  SG_CHECK(opt.val_fraction >= 0 && opt.val_fraction < 1, "data ", spec, ": val_fraction ", opt.val_fraction,
           " is not in [0, 1)");

  if (is_shard_spec(spec)) {
    ShardSplit s = split_token_shards(expand_glob(spec), opt.val_fraction);
    auto& ranges = opt.split == Split::train ? s.train : s.val;
    return std::make_unique<FileDataset>(spec, "token shards", kGpt2Vocab, ranges, opt);
  }

  int64_t bytes = 0;
  {
    ReadFile f(spec, "data");
    bytes = f.size();
  }
  SG_CHECK(bytes > 0, "data ", spec, ": the file is empty");
  const int64_t val = int64_t(double(bytes) * opt.val_fraction);
  TokenRange r{spec, 0, 1, 0, bytes - val};
  if (opt.split == Split::val) r = TokenRange{spec, 0, 1, bytes - val, val};
  return std::make_unique<FileDataset>(spec, "text bytes", 256, std::vector<TokenRange>{r}, opt);
}

}  // namespace sg::io

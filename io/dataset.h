// Training data: every source yields global batches of B rows of T tokens (inputs) and the next
// tokens (targets, -1 where nothing is to be predicted). A source's position is one integer,
// saved in checkpoints so a resumed run sees exactly the batches it would have seen.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace sg::io {

struct Batch {
  Tensor inputs;   // i64 [B, T]
  Tensor targets;  // i64 [B, T]; -1 = ignored
};

enum class Split { train, val };

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual Batch next(int64_t B, int64_t T) = 0;
  // Refuses (naming the data) a batch shape next() could not serve: checked before training, so
  // that a held-out split too small for the final evaluation fails first, not after the run.
  virtual void check_batch(int64_t B, int64_t T) const { (void)B, (void)T; }
  // An opaque cursor: the token offset of a sequential file, the rows drawn so far by the sources
  // that draw rows (synthetic, random, shuffled files; rows, not batches, so that a run resumed at
  // another --batch-size goes on with the next row, none skipped or repeated).
  virtual int64_t position() const = 0;
  virtual void set_position(int64_t p) = 0;
  virtual bool draws_rows() const { return false; }  // position() counts rows
  virtual int64_t vocab_size() const = 0;    // tokens are in [0, vocab_size)
  // For a model of another vocabulary than vocab_size(): token shards (GPT-2's 50257 ids, or another
  // tokenizer's, fewer or more: uint16 ids, up to 65536) then check every id they read against v,
  // naming the file and index of one outside; other data refuses a smaller v, naming itself.
  virtual void restrict_vocab(int64_t v);
  virtual std::string describe() const = 0;  // for the progress header
  // Text <-> tokens for `shardgrad generate` (bytes and the synthetic task; GPT-2 token shards are
  // read through io::Gpt2Tokenizer instead).
  virtual std::vector<int64_t> encode(const std::string& text) const = 0;
  virtual std::string decode(const std::vector<int64_t>& tokens) const = 0;
};

struct DataOptions {
  std::string spec = "synthetic";  // "synthetic", a text file, or a glob of llm.c .bin shards
  Split split = Split::train;
  uint64_t seed = 0;
  bool shuffle = false;
  double val_fraction = 0.1;  // for a single text file: the tail held out
};

// Whether a data spec names llm.c token shards (a glob, a .bin file, or a file of any name that
// starts with the shard magic) rather than a text file; a file of that very name is not a glob.
bool is_shard_spec(const std::string& spec);
// Whether a data spec is generated, not read from a file: synthetic[:...] or random[:V].
bool is_generated_spec(const std::string& spec);
// A text file's tokens: its bytes (vocabulary 256). Ids outside it decode as '?'.
std::vector<int64_t> encode_bytes(const std::string& text);
std::string decode_bytes(const std::vector<int64_t>& ids);

// Throws sg::Error naming the file/glob when it cannot be opened or is malformed.
std::unique_ptr<Dataset> open_dataset(const DataOptions& opt);

}  // namespace sg::io

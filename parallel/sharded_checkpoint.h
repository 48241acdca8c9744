// Sharded checkpoints: one safetensors file per rank plus an index, so that any layout can load
// what any other layout saved (the pieces of parallel/shard_state.h, on disk).
//
// Usage (train; every rank, collectively):
//   std::vector<ckpt::Piece> mine = ...;  // pieces_of(view, local) for this rank's state
//   ckpt::save_sharded(run_dir, step, mine, state, metadata, *world, keep);
//   // resume, any format, any layout:
//   std::unique_ptr<ckpt::Checkpoint> c = ckpt::open_checkpoint("auto:" + run_dir);  // or a dir
//   ckpt::read_local(*c, view, local);  c->state().at("step");  c->metadata().at("n_head");
//
// Replicated state is saved once: every element of every global tensor must be in exactly one
// rank's pieces (e.g. under ddp rank 0 passes all pieces and the others none; under tp × dp the
// dp-rank-0 replica of each tp rank). The commit refuses overlaps and gaps, naming the tensor.
//
// On disk, RUN/step_XXXXXXXX/:
//   rank_00000.safetensors ...   rank r's pieces, keys "<tensor>#<i>", written by rank r, fsynced
//   index.json                   the manifest, written last by rank 0:
//     {"format": "shardgrad-sharded", "version": 1, "step": S, "world": N,
//      "state": {...}, "metadata": {str: str},
//      "files": {"rank_00000.safetensors": {"bytes": B}, ...},
//      "tensors": {"<name>": {"shape": [...], "dtype": "F32",
//                             "pieces": [{"file", "key", "offset": [...], "box": [...], "flat_lo",
//                                         "numel", "data_offsets": [begin, end], "checksum"}]}}}
// data_offsets are absolute byte offsets in the file, so a reader fetches one piece without
// reading the rest; every piece is checked against its FNV-1a checksum when it is read.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "parallel/comm/process_group.h"
#include "parallel/shard_state.h"

namespace sg::ckpt {

// The collective save. Every rank writes its file into RUN/.tmp-step_XXXXXXXX; after a barrier,
// rank 0 writes index.json last, renames the directory into place, updates `latest` and keeps the
// newest `keep` (> 0); a final barrier. Returns the step directory (on every rank). Each barrier
// is an all-reduce of a failure flag: when any rank fails (its write, the commit's checks), every
// rank throws, and the run directory keeps its previous checkpoint.
std::string save_sharded(const std::string& run_dir, int64_t step, const std::vector<Piece>& mine,
                         const nlohmann::json& state, const std::map<std::string, std::string>& metadata,
                         comm::ProcessGroup& group, int keep = 0);
// The same with the rank, world size and barrier given (other launchers; threads in tests): a
// failure is thrown on the rank that had it only.
std::string save_sharded(const std::string& run_dir, int64_t step, const std::vector<Piece>& mine,
                         const nlohmann::json& state, const std::map<std::string, std::string>& metadata, int rank,
                         int world, const std::function<void()>& barrier, int keep = 0);
// The two phases, for callers that sequence ranks themselves (single-process tests):
// every rank's files, then the manifest and the commit (rank 0, once all ranks' files exist).
void write_rank_shard(const std::string& run_dir, int64_t step, int rank, const std::vector<Piece>& mine);
std::string commit_sharded(const std::string& run_dir, int64_t step, int world, const nlohmann::json& state,
                           const std::map<std::string, std::string>& metadata, int keep = 0);

// A committed checkpoint of either format, as global tensors in shardgrad names and layouts.
class Checkpoint : public PieceSource {
 public:
  const std::string& path() const { return path_; }  // the step directory
  std::string where() const override { return " from " + path_; }
  const nlohmann::json& state() const { return state_; }
  // The model config as strings (n_layer, n_head, ...; safetensors metadata of the full format).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  virtual std::vector<std::string> names() const = 0;  // every global tensor, sorted
  virtual DType dtype(const std::string& name) const = 0;
  // The whole global tensor, in its saved dtype.
  virtual Tensor tensor(const std::string& name) const;

 protected:
  std::string path_;
  nlohmann::json state_;
  std::map<std::string, std::string> metadata_;
};

// A sharded step directory. Opening validates the whole index (no path leaves the directory,
// dtypes known, boxes inside their tensors, the pieces of each tensor cover it exactly once,
// byte ranges inside files of the recorded sizes) without reading tensor data; reads fetch only
// the pieces of the tensor asked for and verify their checksums. Errors name the tensor and file.
class ShardedCheckpoint : public Checkpoint {
 public:
  explicit ShardedCheckpoint(const std::string& step_dir);
  bool has(const std::string& name) const override;
  Shape shape(const std::string& name) const override;
  void read(const std::string& name, const Box& box, int64_t flat_lo, const Tensor& out) const override;
  std::vector<std::string> names() const override;
  DType dtype(const std::string& name) const override;
  Tensor tensor(const std::string& name) const override;
  // "" when every file the index names is there at its recorded size; else the first that is not.
  std::string missing_files() const;

  struct PieceRef {
    std::string file, key;
    Box box;
    int64_t flat_lo = 0, numel = 0, begin = 0, end = 0;
    std::string checksum;
  };
  struct TensorRef {
    Shape shape;
    DType dtype = DType::f32;
    std::vector<PieceRef> pieces;
  };

 private:
  const TensorRef& ref(const std::string& name) const;
  // Reads, checks and assembles `name` into cached_ (unless it is there already). Allocates only
  // after every file it needs has the recorded size, so memory is bounded by the files on disk.
  void load(const std::string& name) const;
  std::map<std::string, TensorRef> tensors_;
  std::map<std::string, int64_t> file_bytes_;
  // The last tensor assembled (reads of one tensor come together: one per box or flat run).
  mutable std::string cached_name_;
  mutable MemorySource cached_;
  // The pieces of one tensor read so far by read() (by key): a rank's several reads of a tensor
  // (q, k, v blocks; m, v and masters are other tensors) fetch each piece once.
  mutable std::string pieces_name_;
  mutable std::map<std::string, Piece> pieces_;
};

// Parses and validates a sharded index (the text of index.json) for the step directory `dir`;
// throws sg::Error naming the field, tensor or file. Exposed for the fuzz target and tests.
void parse_sharded_index(const std::string& dir, const std::string& text, nlohmann::json& state,
                         std::map<std::string, std::string>& metadata,
                         std::map<std::string, ShardedCheckpoint::TensorRef>& tensors,
                         std::map<std::string, int64_t>& file_bytes);

// Opens a run directory (`latest` followed), a step directory, or "auto:RUN" (the newest complete
// step directory), in either format. A full checkpoint is converted to the global names and
// layouts of shard_state.h: Hugging Face Conv1D weights transposed back, optimizer state of wte
// cut to vocab_size rows. report_skipped: as resolve_checkpoint's.
std::unique_ptr<Checkpoint> open_checkpoint(const std::string& dir, bool report_skipped = true);

// Optimizer state ("<param>.exp_avg", ".exp_avg_sq", ".master") as opposed to model parameters.
bool is_optimizer_state(const std::string& name);
// The model's parameters in Hugging Face GPT-2 names and layouts (Conv1D weights [in, out]),
// read tensor by tensor. A bf16/f16 run's parameters are its f32 masters where the checkpoint holds
// them (the weights its optimizer steps, not their rounded copies: what DeepSpeed's zero_to_fp32
// gives); the rest of the optimizer state is never read. What `shardgrad export` writes.
io::NamedTensors hf_model_tensors(const Checkpoint& c);

}  // namespace sg::ckpt

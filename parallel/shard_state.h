// A training state spread over ranks, described as pieces of global tensors — the common language
// of sharded checkpoints (parallel/sharded_checkpoint.h) and of every strategy's state (DDP, ZeRO,
// FSDP, TP, PP, and their compositions). Saving writes each rank's pieces; loading asks a
// PieceSource for exactly the elements the new layout's rank holds, whatever layout wrote them.
//
// Global tensors use shardgrad's own names and layouts ("h.0.attn.c_attn.weight", [3C, C], i.e.
// Linear [out, in]); wte is [V, C] without the padding rows. Optimizer state is a global tensor of
// the parameter's shape named "<param>.exp_avg", "<param>.exp_avg_sq" and, with half-precision
// parameters, "<param>.master" (f32). Hugging Face names/layouts appear only at export.
//
// A rank's local tensor maps onto its global tensor as a LocalView: a stack, along dim 0, of
// boxes of the global tensor (one box for a whole tensor or a split along one dim; three for a
// tensor-parallel c_attn, whose q, k and v blocks are split separately), each placed at a row of
// the local tensor; local rows in no box are padding (vocab padding), saved nowhere, loaded as 0.
// Flat-sharded strategies (ZeRO, FSDP) hold a run [lo, lo + n) of the local tensor's row-major
// elements: pieces_of() cuts such a run into per-box pieces.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace sg::ckpt {

struct Box {
  Shape offset, shape;  // of the global tensor, same rank
  int64_t numel() const;
};

struct LocalView {
  std::string name;    // the global tensor
  Shape global_shape;
  Shape local_shape;   // the rank's tensor
  struct Part {
    int64_t local_row;  // first row (dim 0) of the local tensor holding this box
    Box box;
  };
  std::vector<Part> parts;
  int64_t local_numel() const;
};
// The whole tensor held locally (local_shape == global_shape), optionally with `pad_rows` extra
// zero rows at the end of the local tensor (wte's padded vocabulary).
LocalView whole_view(const std::string& name, const Shape& global_shape, int64_t pad_rows = 0);
// A tensor split along `dim` (tensor parallelism): `dim` is cut into `blocks` equal blocks (3 for
// c_attn's q, k, v), each split `size` ways; rank `rank` holds the rank-th piece of every block,
// stacked. dim must be 0 when blocks > 1.
LocalView split_view(const std::string& name, const Shape& global_shape, int64_t dim, int64_t blocks, int rank,
                     int size);
// The view of another name with the same geometry (optimizer state of a parameter).
LocalView renamed(const LocalView& v, const std::string& name);
// How a GPT parameter held by tp rank `tp_rank` of `tp_size` (local_shape: what the rank holds)
// maps onto its global tensor: tensor-parallel splits (parallel/tp/layers.h gpt_param_split) and
// wte's padding rows (the global wte has vocab_size rows).
LocalView gpt_param_view(const std::string& name, const Shape& local_shape, int64_t vocab_size, int tp_rank = 0,
                         int tp_size = 1);

// A contiguous run of one box's row-major elements: [flat_lo, flat_lo + data.numel()).
struct Piece {
  std::string name;
  Shape global_shape;
  Box box;
  int64_t flat_lo = 0;
  Tensor data;  // 1-D, contiguous, host
};
// The pieces holding local elements [flat_lo, flat_lo + data.numel()) (data 1-D, contiguous);
// elements in padding rows are dropped. data's storage is shared, not copied.
std::vector<Piece> pieces_of(const LocalView& v, int64_t flat_lo, const Tensor& data);
// All of a local tensor.
std::vector<Piece> pieces_of(const LocalView& v, const Tensor& local);

// Where a loading rank gets its elements from.
class PieceSource {
 public:
  virtual ~PieceSource() = default;
  virtual bool has(const std::string& name) const = 0;
  virtual Shape shape(const std::string& name) const = 0;  // the global shape
  // out (1-D, contiguous, any dtype: converted) = elements [flat_lo, flat_lo + out.numel()) of
  // the box of `name`. Throws naming the tensor when it is missing or the box does not fit.
  virtual void read(const std::string& name, const Box& box, int64_t flat_lo, const Tensor& out) const = 0;
  // Where the tensors come from, for errors (" in DIR"; "" for a source in memory).
  virtual std::string where() const { return ""; }
};
// out (1-D, local_numel elements or a run of them starting at flat_lo) from the source; padding
// rows are zeroed.
void read_local(const PieceSource& src, const LocalView& v, int64_t flat_lo, const Tensor& out);
void read_local(const PieceSource& src, const LocalView& v, const Tensor& local);

// Whole global tensors in memory: tests, consolidated files, and the base of file sources.
class MemorySource : public PieceSource {
 public:
  MemorySource() = default;
  explicit MemorySource(std::map<std::string, Tensor> tensors) : tensors_(std::move(tensors)) {}
  void add(const std::string& name, const Tensor& t) { tensors_[name] = t; }
  bool has(const std::string& name) const override { return tensors_.count(name) > 0; }
  Shape shape(const std::string& name) const override;
  void read(const std::string& name, const Box& box, int64_t flat_lo, const Tensor& out) const override;
  const std::map<std::string, Tensor>& tensors() const { return tensors_; }

 private:
  std::map<std::string, Tensor> tensors_;
};
// Assembles global tensors from pieces (every element of each must be covered): the inverse of
// pieces_of over all ranks. Throws naming the tensor and the first uncovered element count.
std::map<std::string, Tensor> assemble(const std::vector<Piece>& pieces);

// The global row-major offsets [lo, hi) that elements [flat_lo, flat_lo + n) of `box` lie
// within (a bounding range: a quick test of whether a stored piece can hold any of them).
std::pair<int64_t, int64_t> run_extent(const Shape& global, const Box& box, int64_t flat_lo, int64_t n);
// Copies into `out` (elements [flat_lo, flat_lo + out.numel()) of `box`) every element that
// `piece` (of the same global tensor) holds; returns how many.
int64_t copy_overlap(const Piece& piece, const Box& box, int64_t flat_lo, const Tensor& out);

// Elements [flat_lo, flat_lo + n) of `box` of the global tensor `t`, as a new 1-D tensor.
Tensor box_run(const Tensor& t, const Box& box, int64_t flat_lo, int64_t n);

}  // namespace sg::ckpt

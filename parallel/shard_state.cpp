#include "parallel/shard_state.h"

#include <algorithm>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "parallel/tp/layers.h"

namespace sg::ckpt {

int64_t Box::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

int64_t LocalView::local_numel() const {
  int64_t n = 1;
  for (int64_t s : local_shape) n *= s;
  return n;
}

namespace {

int64_t row_numel(const Shape& s) {  // elements per dim-0 row
  int64_t n = 1;
  for (size_t d = 1; d < s.size(); ++d) n *= s[d];
  return n;
}

// Calls fn(global_flat, run_pos, len) for the contiguous runs of the global tensor that make up
// elements [flat_lo, flat_lo + n) of `box` (row-major), run_pos counting from flat_lo.
template <class Fn>
void for_runs(const Shape& global, const Box& box, int64_t flat_lo, int64_t n, Fn fn) {
  const int64_t nd = int64_t(global.size());
  SG_CHECK(int64_t(box.offset.size()) == nd && int64_t(box.shape.size()) == nd, "shard state: box rank ",
           box.shape.size(), " does not match the tensor's ", shape_str(global));
  for (int64_t d = 0; d < nd; ++d)
    SG_CHECK(box.offset[size_t(d)] >= 0 && box.shape[size_t(d)] >= 0 &&
                 box.offset[size_t(d)] + box.shape[size_t(d)] <= global[size_t(d)],
             "shard state: box at ", shape_str(box.offset), " of shape ", shape_str(box.shape),
             " does not fit in a tensor of shape ", shape_str(global));
  SG_CHECK(flat_lo >= 0 && n >= 0 && flat_lo + n <= box.numel(), "shard state: elements [", flat_lo, ", ",
           flat_lo + n, ") are outside a box of ", box.numel());
  if (n == 0) return;
  // The innermost dims the box covers fully, plus the first one it does not, form one run.
  int64_t d0 = nd - 1;
  while (d0 > 0 && box.shape[size_t(d0)] == global[size_t(d0)]) --d0;
  int64_t run = 1;
  for (int64_t d = nd - 1; d > d0; --d) run *= global[size_t(d)];
  std::vector<int64_t> gstrides(size_t(nd), 1);
  for (int64_t d = nd - 2; d >= 0; --d) gstrides[size_t(d)] = gstrides[size_t(d + 1)] * global[size_t(d + 1)];
  const int64_t run_len = nd ? box.shape[size_t(d0)] * run : 1;  // elements in one run
  int64_t pos = flat_lo;
  const int64_t end = flat_lo + n;
  while (pos < end) {
    const int64_t r = pos / run_len, within = pos % run_len;
    // r indexes the outer dims [0, d0) of the box, row-major.
    int64_t goff = 0, rem = r;
    for (int64_t d = d0 - 1; d >= 0; --d) {
      const int64_t i = rem % box.shape[size_t(d)];
      rem /= box.shape[size_t(d)];
      goff += (box.offset[size_t(d)] + i) * gstrides[size_t(d)];
    }
    if (nd) goff += box.offset[size_t(d0)] * gstrides[size_t(d0)];
    const int64_t len = std::min(run_len - within, end - pos);
    fn(goff + within, pos - flat_lo, len);
    pos += len;
  }
}

}  // namespace

LocalView whole_view(const std::string& name, const Shape& global_shape, int64_t pad_rows) {
  LocalView v;
  v.name = name;
  v.global_shape = global_shape;
  v.local_shape = global_shape;
  if (pad_rows) {
    SG_CHECK(!global_shape.empty(), "shard state: '", name, "' is a scalar and cannot have padding rows");
    v.local_shape[0] += pad_rows;
  }
  v.parts.push_back({0, Box{Shape(global_shape.size(), 0), global_shape}});
  return v;
}

LocalView split_view(const std::string& name, const Shape& global_shape, int64_t dim, int64_t blocks, int rank,
                     int size) {
  SG_CHECK(dim >= 0 && dim < int64_t(global_shape.size()), "shard state: '", name, "' of shape ",
           shape_str(global_shape), " has no dim ", dim);
  SG_CHECK(blocks == 1 || dim == 0, "shard state: '", name, "': a split into blocks must be along dim 0");
  const int64_t extent = global_shape[size_t(dim)];
  SG_CHECK(extent % (blocks * size) == 0, "shard state: '", name, "' dim ", dim, " of ", extent,
           " does not split into ", blocks, " blocks of ", size, " pieces");
  const int64_t block = extent / blocks, piece = block / size;
  LocalView v;
  v.name = name;
  v.global_shape = global_shape;
  v.local_shape = global_shape;
  v.local_shape[size_t(dim)] = piece * blocks;
  for (int64_t k = 0; k < blocks; ++k) {
    Box b{Shape(global_shape.size(), 0), global_shape};
    b.offset[size_t(dim)] = k * block + rank * piece;
    b.shape[size_t(dim)] = piece;
    v.parts.push_back({dim == 0 ? k * piece : 0, b});
  }
  return v;
}

LocalView renamed(const LocalView& v, const std::string& name) {
  LocalView r = v;
  r.name = name;
  return r;
}

LocalView gpt_param_view(const std::string& name, const Shape& local_shape, int64_t vocab_size, int tp_rank,
                         int tp_size) {
  const parallel::tp::Split s = tp_size > 1 ? parallel::tp::gpt_param_split(name) : parallel::tp::Split{};
  if (name == "wte.weight") {
    // Local rows [0, R) are global rows [start, start + R) of the padded table; rows >= vocab_size
    // are padding.
    const int64_t R = local_shape.at(0), start = s.replicated() ? 0 : int64_t(tp_rank) * R;
    LocalView v;
    v.name = name;
    v.global_shape = {vocab_size, local_shape.at(1)};
    v.local_shape = local_shape;
    const int64_t real = std::clamp<int64_t>(vocab_size - start, 0, R);
    if (real > 0) v.parts.push_back({0, Box{{start, 0}, {real, local_shape[1]}}});
    return v;
  }
  if (s.replicated()) return whole_view(name, local_shape);
  Shape global = local_shape;
  global.at(size_t(s.dim)) *= tp_size;
  return split_view(name, global, s.dim, s.parts, tp_rank, tp_size);
}

std::vector<Piece> pieces_of(const LocalView& v, int64_t flat_lo, const Tensor& data) {
  SG_CHECK(data.dim() == 1 && data.is_contiguous(), "shard state: pieces_of('", v.name,
           "') needs a 1-D contiguous run, got ", shape_str(data.shape()));
  const int64_t n = data.numel(), rowsz = row_numel(v.local_shape);
  SG_CHECK(flat_lo >= 0 && flat_lo + n <= v.local_numel(), "shard state: elements [", flat_lo, ", ", flat_lo + n,
           ") are outside '", v.name, "' of local shape ", shape_str(v.local_shape));
  std::vector<Piece> out;
  for (const auto& part : v.parts) {
    // A part fills local elements [a, a + its numel): a dim-0 block of whole local rows, or (one
    // part split along another dim) the whole local tensor.
    const int64_t a = part.local_row * rowsz, part_len = part.box.numel();
    const int64_t lo = std::max(flat_lo, a), hi = std::min(flat_lo + n, a + part_len);
    if (lo >= hi) continue;
    autograd::NoGradGuard ng;
    out.push_back({v.name, v.global_shape, part.box, lo - a, narrow(data, 0, lo - flat_lo, hi - lo)});
  }
  // A tensor with no elements still gets one (empty) piece, so that a checkpoint names it.
  if (out.empty() && shape_numel(v.global_shape) == 0 && !v.parts.empty())
    out.push_back({v.name, v.global_shape, v.parts.front().box, 0, data});
  return out;
}

std::vector<Piece> pieces_of(const LocalView& v, const Tensor& local) {
  SG_CHECK(local.shape() == v.local_shape, "shard state: '", v.name, "' is ", shape_str(local.shape()),
           " locally but its view says ", shape_str(v.local_shape));
  autograd::NoGradGuard ng;
  return pieces_of(v, 0, reshape(contiguous(local), {local.numel()}));
}

void read_local(const PieceSource& src, const LocalView& v, int64_t flat_lo, const Tensor& out) {
  SG_CHECK(out.dim() == 1 && out.is_contiguous(), "shard state: read_local('", v.name, "') needs a 1-D run");
  const int64_t n = out.numel(), rowsz = row_numel(v.local_shape);
  SG_CHECK(flat_lo >= 0 && flat_lo + n <= v.local_numel(), "shard state: elements [", flat_lo, ", ", flat_lo + n,
           ") are outside '", v.name, "' of local shape ", shape_str(v.local_shape));
  SG_CHECK(src.has(v.name), "checkpoint: tensor '", v.name, "' is missing", src.where());
  const Shape have = src.shape(v.name);
  SG_CHECK(have == v.global_shape, "checkpoint: tensor '", v.name, "' has shape ", shape_str(have),
           " but this layout expects ", shape_str(v.global_shape));
  autograd::NoGradGuard ng;
  zero_(out);  // padding rows
  for (const auto& part : v.parts) {
    const int64_t a = part.local_row * rowsz, part_len = part.box.numel();
    const int64_t lo = std::max(flat_lo, a), hi = std::min(flat_lo + n, a + part_len);
    if (lo >= hi) continue;
    src.read(v.name, part.box, lo - a, narrow(out, 0, lo - flat_lo, hi - lo));
  }
}

void read_local(const PieceSource& src, const LocalView& v, const Tensor& local) {
  SG_CHECK(local.shape() == v.local_shape, "shard state: '", v.name, "' is ", shape_str(local.shape()),
           " locally but its view says ", shape_str(v.local_shape));
  autograd::NoGradGuard ng;
  if (local.is_contiguous()) {
    read_local(src, v, 0, reshape(local, {local.numel()}));
    return;
  }
  Tensor tmp = empty({local.numel()}, local.dtype(), local.device());
  read_local(src, v, 0, tmp);
  copy_(local, reshape(tmp, local.shape()));
}

Shape MemorySource::shape(const std::string& name) const {
  auto it = tensors_.find(name);
  SG_CHECK(it != tensors_.end(), "checkpoint: tensor '", name, "' is missing");
  return it->second.shape();
}

namespace {
struct Run {
  int64_t global, pos, len;
};
std::vector<Run> runs_of(const Shape& global, const Box& box, int64_t flat_lo, int64_t n) {
  std::vector<Run> out;
  for_runs(global, box, flat_lo, n, [&](int64_t g, int64_t pos, int64_t len) { out.push_back({g, pos, len}); });
  return out;
}
}  // namespace

std::pair<int64_t, int64_t> run_extent(const Shape& global, const Box& box, int64_t flat_lo, int64_t n) {
  int64_t lo = -1, hi = -1;
  for_runs(global, box, flat_lo, n, [&](int64_t g, int64_t, int64_t len) {
    if (lo < 0) lo = g;
    hi = g + len;
  });
  return {std::max<int64_t>(lo, 0), std::max<int64_t>(hi, 0)};
}

int64_t copy_overlap(const Piece& piece, const Box& box, int64_t flat_lo, const Tensor& out) {
  // Both run lists ascend in global offset (a box's row-major order is the tensor's): merge them.
  const std::vector<Run> want = runs_of(piece.global_shape, box, flat_lo, out.numel()),
                         have = runs_of(piece.global_shape, piece.box, piece.flat_lo, piece.data.numel());
  autograd::NoGradGuard ng;
  int64_t copied = 0;
  size_t i = 0, j = 0;
  while (i < want.size() && j < have.size()) {
    const Run &w = want[i], &h = have[j];
    const int64_t lo = std::max(w.global, h.global), hi = std::min(w.global + w.len, h.global + h.len);
    if (lo < hi) {
      copy_(narrow(out, 0, w.pos + (lo - w.global), hi - lo), narrow(piece.data, 0, h.pos + (lo - h.global), hi - lo));
      copied += hi - lo;
    }
    if (w.global + w.len <= h.global + h.len) ++i;
    else ++j;
  }
  return copied;
}

Tensor box_run(const Tensor& t, const Box& box, int64_t flat_lo, int64_t n) {
  autograd::NoGradGuard ng;
  Tensor flat = reshape(contiguous(t), {t.numel()});
  Tensor out = empty({n}, t.dtype(), t.device());
  for_runs(t.shape(), box, flat_lo, n,
           [&](int64_t g, int64_t pos, int64_t len) { copy_(narrow(out, 0, pos, len), narrow(flat, 0, g, len)); });
  return out;
}

void MemorySource::read(const std::string& name, const Box& box, int64_t flat_lo, const Tensor& out) const {
  auto it = tensors_.find(name);
  SG_CHECK(it != tensors_.end(), "checkpoint: tensor '", name, "' is missing");
  autograd::NoGradGuard ng;
  const Tensor& t = it->second;
  Tensor flat = reshape(contiguous(t), {t.numel()});
  for_runs(t.shape(), box, flat_lo, out.numel(),
           [&](int64_t g, int64_t pos, int64_t len) { copy_(narrow(out, 0, pos, len), narrow(flat, 0, g, len)); });
}

std::map<std::string, Tensor> assemble(const std::vector<Piece>& pieces) {
  autograd::NoGradGuard ng;
  std::map<std::string, Tensor> out;
  std::map<std::string, int64_t> covered;
  for (const Piece& p : pieces) {
    auto it = out.find(p.name);
    if (it == out.end()) it = out.emplace(p.name, zeros(p.global_shape, p.data.dtype())).first;
    SG_CHECK(it->second.shape() == p.global_shape, "checkpoint: tensor '", p.name, "' appears with shapes ",
             shape_str(it->second.shape()), " and ", shape_str(p.global_shape));
    Tensor flat = reshape(it->second, {it->second.numel()});
    for_runs(p.global_shape, p.box, p.flat_lo, p.data.numel(),
             [&](int64_t g, int64_t pos, int64_t len) { copy_(narrow(flat, 0, g, len), narrow(p.data, 0, pos, len)); });
    covered[p.name] += p.data.numel();
  }
  // Replicated state is written by one rank per replica group, so each element appears once;
  // a total below the size means a missing piece.
  for (auto& [name, t] : out)
    SG_CHECK(covered[name] >= t.numel(), "checkpoint: tensor '", name, "' is incomplete: pieces cover ",
             covered[name], " of ", t.numel(), " elements");
  return out;
}

}  // namespace sg::ckpt

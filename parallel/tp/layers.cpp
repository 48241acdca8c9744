#include "parallel/tp/layers.h"

#include "autograd/tape.h"
#include "parallel/functional.h"

namespace sg::parallel::tp {

namespace {
int64_t split_ways(int64_t n, int64_t ways, const char* layer, const char* what) {
  SG_CHECK(ways > 0 && n % ways == 0, layer, ": ", what, " ", n, " cannot be split ", ways, " ways");
  return n / ways;
}
}  // namespace

Tensor shard_of(const Tensor& full, Split s, int rank, int size) {
  if (s.replicated()) return full;
  autograd::NoGradGuard ng;
  const int64_t block = split_ways(full.size(s.dim), s.parts, "shard_of", "dim"),
                piece = split_ways(block, size, "shard_of", "block");
  std::vector<Tensor> pieces;
  for (int64_t k = 0; k < s.parts; ++k) pieces.push_back(narrow(full, s.dim, k * block + rank * piece, piece));
  return contiguous(pieces.size() == 1 ? clone(pieces[0]) : cat(pieces, s.dim));
}

void normal_shard_(const Tensor& local, Split s, int rank, int size, uint64_t seed, uint64_t stream, double mean,
                   double std) {
  if (s.replicated()) return normal_(local, seed, stream, mean, std);
  autograd::NoGradGuard ng;
  SG_CHECK(local.is_contiguous() && local.size(s.dim) % s.parts == 0, "normal_shard_: ", local.describe(),
           " is not a contiguous piece of ", s.parts, " part(s) along dim ", s.dim);
  Shape full = local.shape();
  full[size_t(s.dim)] *= size;
  const int64_t piece = local.size(s.dim) / s.parts, block = piece * size;
  if (s.dim == 0) {  // each part's piece is one run of the full tensor's elements
    const int64_t row = local.numel() / std::max<int64_t>(local.size(0), 1);
    for (int64_t k = 0; k < s.parts; ++k)
      normal_(narrow(local, 0, k * piece, piece), seed, stream, mean, std, uint64_t((k * block + rank * piece) * row));
    return;
  }
  // Rows of the full tensor a band at a time, each band's piece copied out.
  const int64_t rows = full[0], band = std::max<int64_t>(1, rows / size), row = shape_numel(full) / std::max<int64_t>(rows, 1);
  for (int64_t r = 0; r < rows; r += band) {
    Shape shape = full;
    shape[0] = std::min(band, rows - r);
    const Tensor drawn = randn(shape, seed, stream, mean, std, local.dtype(), local.device(), uint64_t(r * row));
    copy_(narrow(local, 0, r, shape[0]), shard_of(drawn, s, rank, size));
  }
}

Tensor unshard(const Tensor& local, Split s, comm::ProcessGroup& group) {
  if (s.replicated()) return local;
  autograd::NoGradGuard ng;
  Tensor all = all_gather_along(local, s.dim, group);  // rank-major: [r0: parts pieces][r1: ...]
  if (s.parts == 1) return all;
  const int64_t piece = local.size(s.dim) / s.parts;
  std::vector<Tensor> pieces;
  for (int64_t k = 0; k < s.parts; ++k)
    for (int r = 0; r < group.size(); ++r) pieces.push_back(narrow(all, s.dim, (r * s.parts + k) * piece, piece));
  return contiguous(cat(pieces, s.dim));
}

Split gpt_param_split(const std::string& name) {
  auto ends = [&](const char* suf) {
    const std::string x(suf);
    return name.size() >= x.size() && name.compare(name.size() - x.size(), x.size(), x) == 0;
  };
  if (name == "wte.weight") return {0, 1};
  if (ends(".attn.c_attn.weight") || ends(".attn.c_attn.bias")) return {0, 3};
  if (ends(".mlp.c_fc.weight") || ends(".mlp.c_fc.bias")) return {0, 1};
  if (ends(".attn.c_proj.weight") || ends(".mlp.c_proj.weight")) return {1, 1};
  return {};  // LayerNorms, wpe, row-parallel biases: replicated
}

void sync_sequence_parallel_grads(const nn::Module& gpt, comm::ProcessGroup& group) {
  for (auto& [name, prm] : gpt.named_parameters()) {
    if (!gpt_param_split(name).replicated() || !prm.grad().defined()) continue;
    group.all_reduce(prm.grad(), comm::ReduceOp::sum, comm::Sync::blocking);
  }
}

// ---- linears ----

ColumnParallelLinear::ColumnParallelLinear(int64_t in, int64_t out, bool has_bias, GroupPtr g, bool gather,
                                           int64_t parts_, DType dtype, Device device)
    : group(std::move(g)), gather_output(gather), parts(parts_) {
  SG_CHECK(!(gather_output && parts > 1), "ColumnParallelLinear: gather_output would interleave the ", parts,
           " output blocks");
  const int64_t local = split_ways(split_ways(out, parts, "ColumnParallelLinear", "out_features"), group->size(),
                                   "ColumnParallelLinear", "output block") * parts;
  weight = register_parameter("weight", {local, in}, dtype, device);
  if (has_bias) bias = register_parameter("bias", {local}, dtype, device);
}

namespace {
Tensor column_parallel(const ColumnParallelLinear& l, const Tensor& x, bool gelu) {
  // Under sequence parallelism the GEMM gathers its input itself and keeps only the shard.
  const Regather rg = l.regather();
  Tensor in = rg ? x : l.input(x);
  Tensor y = gelu ? linear_gelu(in, l.weight, l.bias, rg) : linear(in, l.weight, l.bias, Tensor(), rg);
  return l.gather_output ? gather_from_region(y, *l.group) : y;  // GELU is elementwise: before or after
}
}  // namespace

Tensor ColumnParallelLinear::input(const Tensor& x) const {
  return sequence_parallel ? all_gather_seq(x, *group) : copy_to_region(x, *group);
}

Regather ColumnParallelLinear::regather() const {
  if (!sequence_parallel) return {};
  comm::ProcessGroup* g = group.get();
  return {[g](const Tensor& t) { return all_gather_along(t, 1, *g); },
          [g](const Tensor& t) { return reduce_scatter_along(t, 1, *g); }};
}
Tensor ColumnParallelLinear::forward(const Tensor& x) const { return column_parallel(*this, x, false); }
Tensor ColumnParallelLinear::forward_gelu(const Tensor& x) const { return column_parallel(*this, x, true); }

void ColumnParallelLinear::load_full(const nn::Linear& full) {
  autograd::NoGradGuard ng;
  copy_(weight, shard_of(full.weight, {0, parts}, group->rank(), group->size()));
  if (bias.defined()) copy_(bias, shard_of(full.bias, {0, parts}, group->rank(), group->size()));
}

RowParallelLinear::RowParallelLinear(int64_t in, int64_t out, bool has_bias, GroupPtr g, DType dtype, Device device)
    : group(std::move(g)) {
  weight = register_parameter("weight", {out, split_ways(in, group->size(), "RowParallelLinear", "in_features")},
                              dtype, device);
  if (has_bias) bias = register_parameter("bias", {out}, dtype, device);
}

Tensor RowParallelLinear::forward(const Tensor& x) const { return output(linear(x, weight, Tensor())); }

Tensor RowParallelLinear::output(const Tensor& partial) const {
  // The bias joins after the sum: added on every rank before it, it would count p times.
  Tensor y = sequence_parallel ? reduce_scatter_seq(partial, *group) : reduce_from_region(partial, *group);
  return bias.defined() ? add(y, bias) : y;
}

void RowParallelLinear::load_full(const nn::Linear& full) {
  autograd::NoGradGuard ng;
  copy_(weight, shard_of(full.weight, {1, 1}, group->rank(), group->size()));
  if (bias.defined()) copy_(bias, full.bias);
}

// ---- embedding ----

VocabParallelEmbedding::VocabParallelEmbedding(int64_t num, int64_t dim, GroupPtr g, DType dtype, Device device)
    : group(std::move(g)) {
  weight = register_parameter("weight", {split_ways(num, group->size(), "VocabParallelEmbedding", "rows"), dim},
                              dtype, device);
}

Tensor VocabParallelEmbedding::forward(const Tensor& idx) const {
  SG_CHECK(idx.dtype() == DType::i32 || idx.dtype() == DType::i64,
           "VocabParallelEmbedding: indices must be i32/i64, got ", idx.describe());
  // Local row ids and the in-range mask are made on the host: [B, T] integers, small next to
  // the [B, T, C] lookup.
  const int64_t start = vocab_start(), rows = weight.size(0), all_rows = rows * group->size();
  std::vector<int64_t> ids = to_vector<int64_t>(idx), local(ids.size());
  std::vector<float> keep(ids.size());
  for (size_t k = 0; k < ids.size(); ++k) {
    // Past the whole table, an id would be no rank's: a zero row, where one process refuses it.
    SG_CHECK(ids[k] >= 0 && ids[k] < all_rows, "VocabParallelEmbedding: index ", ids[k], " out of range for a table of ",
             all_rows, " rows (", rows, " on each of ", group->size(), " ranks)");
    const bool mine = ids[k] >= start && ids[k] < start + rows;
    local[k] = mine ? ids[k] - start : 0;
    keep[k] = mine ? 1.0f : 0.0f;
  }
  Shape mask_shape = idx.shape();
  mask_shape.push_back(1);
  Tensor mask = to(from_vector(keep, mask_shape, idx.device()), weight.dtype());
  Tensor part = mul(embedding(weight, from_vector(local, idx.shape(), idx.device())), mask);
  return sequence_parallel ? reduce_scatter_seq(part, *group) : reduce_from_region(part, *group);
}

void VocabParallelEmbedding::load_full(const nn::Embedding& full) {
  autograd::NoGradGuard ng;
  copy_(weight, shard_of(full.weight, {0, 1}, group->rank(), group->size()));
}

// ---- attention and MLP ----

ParallelAttention::ParallelAttention(const nn::GPTConfig& c, GroupPtr group, DType dtype, Device device)
    : local_heads(split_ways(c.n_head, group->size(), "ParallelAttention", "n_head")), dropout(c.dropout) {
  c_attn = register_module("c_attn", std::make_shared<ColumnParallelLinear>(c.n_embd, 3 * c.n_embd, true, group,
                                                                            false, 3, dtype, device));
  c_proj = register_module("c_proj", std::make_shared<RowParallelLinear>(c.n_embd, c.n_embd, true, group, dtype, device));
  c_attn->sequence_parallel = c_proj->sequence_parallel = c.sequence_parallel;
}

Tensor ParallelAttention::forward(const Tensor& x, bool recompute_core) const {
  Tensor y = c_proj->forward(nn::causal_attention(c_attn->forward(x), local_heads, recompute_core));
  return dropout > 0 ? sg::dropout(y, dropout, dropout_site) : y;
}

void ParallelAttention::load_full(const nn::CausalSelfAttention& full) {
  c_attn->load_full(*full.c_attn);
  c_proj->load_full(*full.c_proj);
}

ParallelMLP::ParallelMLP(const nn::GPTConfig& c, GroupPtr group, DType dtype, Device device) {
  c_fc = register_module("c_fc", std::make_shared<ColumnParallelLinear>(c.n_embd, 4 * c.n_embd, true, group, false,
                                                                        1, dtype, device));
  c_proj = register_module("c_proj", std::make_shared<RowParallelLinear>(4 * c.n_embd, c.n_embd, true, group, dtype, device));
  c_fc->sequence_parallel = c_proj->sequence_parallel = c.sequence_parallel;
}

// c_proj's bias joins after the group's sum (RowParallelLinear::output), so the fused MLP runs
// without it.
Tensor ParallelMLP::forward(const Tensor& x) const {
  const Regather rg = c_fc->regather();  // sequence parallelism: mlp gathers its input itself
  return c_proj->output(mlp(rg ? x : c_fc->input(x), c_fc->weight, c_fc->bias, c_proj->weight, Tensor(), Tensor(), rg));
}

void ParallelMLP::load_full(const nn::MLP& full) {
  c_fc->load_full(*full.c_fc);
  c_proj->load_full(*full.c_proj);
}

}  // namespace sg::parallel::tp

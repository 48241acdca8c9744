#include "bench/report/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>

#include "core/error.h"
#include "models/gpt.h"
#include "parallel/comm/process_group.h"
#include "parallel/pp/schedule.h"

namespace sg::report {

// The FSDP family keeps only its units' shards between steps (fsdp-grad-op too: it gathers every
// unit for the step's forward and releases them after its backward).
bool shards_params(const std::string& s) { return s == "zero3" || s == "fsdp" || s == "fsdp-grad-op" || s == "hsdp"; }

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int dtype_bytes(const std::string& d) {
  if (d == "fp32") return 4;
  if (d == "bf16" || d == "fp16") return 2;
  throw Error(str("plan: --dtype must be fp32, bf16 or fp16, got '", d, "'"));
}

bool shards_grads(const std::string& s) { return s == "zero2" || shards_params(s); }
bool shards_optimizer(const std::string& s) { return s != "ddp"; }

// What one pipeline rank holds of the model (elements, before data-parallel sharding): its units
// (the root unit of embeddings/ln_f it holds, then one per block), as the engine builds them.
// A pipeline rank's FSDP units (parallel/fsdp.h), parameter counts of its tp slices: the roots
// first, then one per block. Without a pipeline one root (wte, wpe, ln_f); under one, the tied
// embedding's own unit on the first and the last stage and a root of wpe (first) or ln_f (last),
// both gathered once a step and reduced once.
struct StageUnits {
  std::vector<int64_t> units;
  size_t roots = 0;
};

StageUnits stage_units(const ModelShape& m, int tp, int pp, int rank) {
  if (!m.has_shape()) return {{ceil_div(m.num_params(), int64_t(tp) * pp)}, 0};
  const int64_t C = m.n_embd, wte = m.vocab_rows(tp) * C / tp, wpe = m.block_size * C;
  const int64_t block = tp > 1 ? (12 * C * C + 7 * C) / tp + 6 * C : 12 * C * C + 13 * C;
  StageUnits s;
  if (pp == 1) {
    s.units = {wte + wpe + 2 * C};
  } else if (rank == 0 || rank == pp - 1) {
    s.units = {wte, rank == 0 ? wpe : 2 * C};  // 2C: ln_f
  }
  s.roots = s.units.size();
  for (int64_t b = 0; b < m.n_layer / pp; ++b) s.units.push_back(block);
  return s;
}

// Korthikanti et al.: activation bytes of one layer for one micro-batch of b sequences (2-byte
// activations, 1-byte dropout masks).
double layer_activation_bytes(const ModelShape& m, const Layout& l, double b) {
  const double s = double(m.seq_len), h = double(m.n_embd), a = double(m.n_head), t = double(l.tp);
  const double sbh = s * b * h;
  if (l.recompute == "full") return 2 * sbh / (l.sequence_parallel ? t : 1);
  const double attn = l.recompute == "selective" ? 0 : 5 * a * s / h;  // the a·s² score matrices
  if (l.sequence_parallel) return sbh / t * (34 + attn);
  if (l.tp > 1) return sbh * (10 + 24 / t + attn / t);
  return sbh * (34 + attn);
}

double link_bandwidth(const Cluster& c, bool intra) { return intra ? c.intra_bandwidth : c.inter_bandwidth; }

}  // namespace

int64_t ModelShape::vocab_rows(int64_t tp) const { return nn::padded_vocab_rows(vocab_size, tp); }

int64_t ModelShape::num_params() const {
  if (!has_shape()) return params;
  nn::GPTConfig c;
  c.n_layer = n_layer, c.n_head = n_head, c.n_embd = n_embd, c.block_size = block_size, c.vocab_size = vocab_size;
  return c.num_params();
}

ModelShape model_preset(const std::string& name) {
  nn::GPTConfig c = nn::gpt_preset(name);
  ModelShape m;
  m.name = name;
  m.n_layer = c.n_layer, m.n_head = c.n_head, m.n_embd = c.n_embd, m.block_size = c.block_size;
  m.seq_len = c.block_size, m.vocab_size = c.vocab_size;
  return m;
}

Cluster cluster_preset(const std::string& name) {
  Cluster c;
  c.name = name;
  if (name == "8xH100-NVLink-IB") {  // NVLink 4: 450 GB/s each way; one 400 Gb/s NIC per GPU
    c.gpu_memory = 80e9, c.intra_bandwidth = 450e9, c.inter_bandwidth = 50e9, c.peak_flops = 989e12;
  } else if (name == "8xH200-NVLink-IB") {
    c.gpu_memory = 141e9, c.intra_bandwidth = 450e9, c.inter_bandwidth = 50e9, c.peak_flops = 989e12;
  } else if (name == "8xA100-NVLink-IB") {  // NVLink 3: 300 GB/s each way; 200 Gb/s per GPU
    c.gpu_memory = 80e9, c.intra_bandwidth = 300e9, c.inter_bandwidth = 25e9, c.peak_flops = 312e12;
  } else if (name == "cpu-local") {  // this 2-core machine: one rank per core, MPI over shared memory
    c.gpus_per_node = 2, c.gpu_memory = 8e9, c.intra_bandwidth = 4e9, c.inter_bandwidth = 1e9;
    c.peak_flops = 150e9, c.host_bandwidth = 10e9, c.efficiency = 0.6;
  } else {
    throw Error(str("plan: --cluster: unknown preset '", name,
                    "' (expected 8xH100-NVLink-IB, 8xH200-NVLink-IB, 8xA100-NVLink-IB or cpu-local)"));
  }
  return c;
}

std::string Layout::label() const {
  std::string s = "dp" + std::to_string(dp) + " tp" + std::to_string(tp) + (sequence_parallel ? "+sp" : "") + " pp" +
                  std::to_string(pp) + " " + strategy;
  if (shard_group_size > 0) s += "/" + std::to_string(shard_group_size);
  if (pp > 1) s += " " + pp_schedule + (virtual_stages > 1 ? "/v" + std::to_string(virtual_stages) : "");
  s += " mb" + std::to_string(micro_batch_size);
  if (recompute != "none") s += " rc:" + recompute;
  if (offload != "none") s += " offload:" + offload;
  if (grad_accumulation != "sharded") s += " accum:" + grad_accumulation;
  return s;
}

void check_input(const PlanInput& in) {
  const ModelShape& m = in.model;
  const Cluster& c = in.cluster;
  const int64_t gpus = int64_t(c.gpus_per_node) * c.nodes;
  SG_CHECK(c.gpus_per_node >= 1 && c.nodes >= 1, "plan: --gpus-per-node ", c.gpus_per_node, " and --nodes ", c.nodes,
           " must be >= 1");
  SG_CHECK(gpus <= kMaxRanks, "plan: --gpus-per-node ", c.gpus_per_node, " x --nodes ", c.nodes, " = ", gpus,
           " GPUs, more than the planner's ", kMaxRanks, " (2^20)");
  if (m.has_shape()) {  // each within its limit, the parameter count below stays far inside int64
    const auto within = [](const char* flag, int64_t v, int64_t lo, int64_t hi) {
      SG_CHECK(v >= lo && v <= hi, "plan: --", flag, " must be in [", lo, ", ", hi, "], got ", v);
    };
    within("n-layer", m.n_layer, 1, kMaxLayers);
    within("n-embd", m.n_embd, 1, kMaxWidth);
    within("n-head", m.n_head, 1, m.n_embd);
    within("vocab-size", m.vocab_size, 1, kMaxVocab);
    within("block-size", m.block_size, 1, kMaxBlock);
    SG_CHECK(m.num_params() <= kMaxParams, "plan: the model's ", m.num_params(), " parameters (--n-layer ", m.n_layer,
             ", --n-embd ", m.n_embd, ", --vocab-size ", m.vocab_size, ", --block-size ", m.block_size,
             ") are more than the planner's ", kMaxParams, " (2^43)");
    const double work = double(in.global_batch) * double(m.seq_len) * double(m.n_embd) * double(m.n_layer);
    SG_CHECK(work <= kMaxTokenWork, "plan: --batch-size ", in.global_batch, " x --seq-len ", m.seq_len, " x --n-embd ",
             m.n_embd, " x --n-layer ", m.n_layer, " = ", work, " is more than the planner's 2^54 (",
             kMaxTokenWork, "): its tensor-parallel bytes per step would overflow");
  } else {
    SG_CHECK(m.params <= kMaxParams, "plan: --params ", m.params, " is more than the planner's ", kMaxParams, " (2^43)");
  }
  SG_CHECK(m.num_params() > 0, "plan: the model has no parameters (give --model, --n-layer/--n-embd/... or --params)");
}

namespace {

// Every refusal of a layout that cannot run, before anything is counted.
void check_layout(const PlanInput& in) {
  check_input(in);
  const ModelShape& m = in.model;
  const Cluster& c = in.cluster;
  const Layout& l = in.layout;
  SG_CHECK(l.dp >= 1 && l.tp >= 1 && l.pp >= 1, "plan: --dp, --tp and --pp must be >= 1");
  SG_CHECK(l.dp <= kMaxRanks && l.tp <= kMaxRanks && l.pp <= kMaxRanks && l.virtual_stages <= kMaxRanks,
           "plan: --dp ", l.dp, ", --tp ", l.tp, ", --pp ", l.pp, " and --virtual-stages ", l.virtual_stages,
           " must each be at most ", kMaxRanks, " (2^20)");
  SG_CHECK(l.strategy == "ddp" || l.strategy == "zero1" || l.strategy == "zero2" || l.strategy == "zero3" ||
               l.strategy == "fsdp" || l.strategy == "fsdp-grad-op" || l.strategy == "hsdp",
           "plan: --strategy '", l.strategy, "' (expected ddp, zero1, zero2, zero3, fsdp, fsdp-grad-op or hsdp)");
  SG_CHECK(l.recompute == "none" || l.recompute == "selective" || l.recompute == "full", "plan: --recompute '",
           l.recompute, "' (expected none, selective or full)");
  SG_CHECK(l.offload == "none" || l.offload == "optimizer" || l.offload == "params", "plan: --offload '", l.offload,
           "' (expected none, optimizer or params)");
  SG_CHECK(l.offload != "params" || shards_params(l.strategy), "plan: --offload params needs a strategy that shards ",
           "the parameters (zero3, fsdp, fsdp-grad-op, hsdp), not ", l.strategy);
  SG_CHECK(l.offload == "none" || l.strategy != "ddp", "plan: --offload is for the sharded strategies (zero1, zero2 ",
           "and the fsdp family), not ddp, whose every rank keeps the whole optimizer state where it steps");
  SG_CHECK(l.virtual_stages >= 1, "plan: --virtual-stages must be >= 1, got ", l.virtual_stages);
  SG_CHECK(l.virtual_stages == 1 || (l.pp > 1 && l.pp_schedule == "interleaved"), "plan: --virtual-stages ",
           l.virtual_stages, " is for the interleaved schedule of a pipeline (--pp > 1 --pp-schedule interleaved)");
  SG_CHECK(!l.sequence_parallel || l.tp > 1, "plan: --sequence-parallel needs --tp > 1");
  SG_CHECK(l.grad_accumulation == "sharded" || l.grad_accumulation == "unsharded", "plan: --grad-accumulation '",
           l.grad_accumulation, "' (expected sharded or unsharded)");
  SG_CHECK(l.grad_accumulation == "sharded" || l.strategy == "zero2" || shards_params(l.strategy),
           "plan: --grad-accumulation unsharded is for zero2 and the fsdp family (ddp and zero1 accumulate full ",
           "gradients), not ", l.strategy);
  SG_CHECK(l.grad_accumulation == "sharded" || !shards_params(l.strategy) || l.pp == 1, "plan: --grad-accumulation ",
           "unsharded (FSDP's no_sync) is not for pipelines, whose micro-batches interleave");
  const int64_t world = int64_t(l.dp) * l.tp * l.pp, gpus = int64_t(c.gpus_per_node) * c.nodes;
  SG_CHECK(world <= gpus, "plan: dp ", l.dp, " x tp ", l.tp, " x pp ", l.pp, " = ", world, " GPUs, the cluster has ",
           gpus, " (", c.nodes, " x ", c.gpus_per_node, ")");
  if (m.has_shape()) {
    SG_CHECK(m.n_head % l.tp == 0, "plan: --tp ", l.tp, ": ", m.n_head, " heads cannot be split ", l.tp, " ways");
    SG_CHECK(m.n_layer % (int64_t(l.pp) * l.virtual_stages) == 0, "plan: --pp ", l.pp, " x --virtual-stages ",
             l.virtual_stages, ": ", m.n_layer, " layers do not split evenly");
    SG_CHECK(!l.sequence_parallel || m.seq_len % l.tp == 0, "plan: --sequence-parallel: --seq-len ", m.seq_len,
             " does not split over --tp ", l.tp);
    SG_CHECK(m.seq_len >= 1 && m.seq_len <= m.block_size, "plan: --seq-len ", m.seq_len, " outside [1, block size ",
             m.block_size, "]");
  }
  SG_CHECK(in.global_batch % l.dp == 0, "plan: --batch-size ", in.global_batch, " does not split over dp ", l.dp);
  SG_CHECK(l.micro_batch_size >= 1 && (in.global_batch / l.dp) % l.micro_batch_size == 0, "plan: --micro-batch-size ",
           l.micro_batch_size, " does not divide the per-rank batch ", in.global_batch / l.dp);
  const int64_t micro_batches = in.global_batch / l.dp / l.micro_batch_size;
  SG_CHECK(micro_batches <= kMaxMicroBatches, "plan: --batch-size ", in.global_batch, " over dp ", l.dp,
           " in micro-batches of ", l.micro_batch_size, " is ", micro_batches, " micro-batches a step, more than the ",
           "planner's ", kMaxMicroBatches, " (2^16): give a larger --micro-batch-size");
  const int64_t actions = int64_t(l.pp) * (l.pp > 1 ? l.virtual_stages : 1) * micro_batches;
  SG_CHECK(l.pp == 1 || actions <= kMaxScheduleActions, "plan: the pipeline schedule is simulated action by action: ",
           "--pp ", l.pp, " x --virtual-stages ", l.virtual_stages, " x ", micro_batches, " micro-batches = ", actions,
           ", more than the planner's ", kMaxScheduleActions, " (2^20): give a larger --micro-batch-size");
  SG_CHECK(l.shard_group_size >= 0, "plan: --shard-group-size must be >= 0, got ", l.shard_group_size);
  SG_CHECK(l.shard_group_size == 0 || l.strategy == "hsdp", "plan: --shard-group-size is for hsdp, not ", l.strategy);
}

// How the N data-parallel ranks share the sharded states: in groups of shard_n (N, but for hsdp
// one shard group, by default the dp ranks of one node), `replicas` groups holding the same shards.
struct Sharding {
  int N = 1, shard_n = 1, replicas = 1;
};

Sharding sharding_of(const Layout& l, const Cluster& c) {
  Sharding s;
  s.N = l.dp;
  s.shard_n = l.strategy != "hsdp"     ? s.N
              : l.shard_group_size > 0 ? l.shard_group_size
                                       : std::max(1, std::min(s.N, c.gpus_per_node / (l.tp * l.pp)));
  SG_CHECK(l.strategy != "hsdp" || s.N % s.shard_n == 0, "plan: hsdp: dp ", s.N, " is not a multiple of the shard "
           "group's ", s.shard_n, " ranks");
  s.replicas = s.N / s.shard_n;
  return s;
}

// One pipeline rank's parameter elements (its tp slices): E in all, E_shard_units as the FSDP
// family shards them (each unit padded to shard_n), E_shard_flat as ZeRO-1/2 do (one flat vector
// padded to N); the roots' elements and the biggest block unit (what FSDP gathers at once).
struct StageElements {
  StageUnits su;
  int64_t E = 0, E_shard_units = 0, E_shard_flat = 0, roots = 0, biggest_unit = 0;
};

StageElements stage_elements(const ModelShape& m, const Layout& l, const Sharding& sh, int r) {
  StageElements st;
  st.su = stage_units(m, l.tp, l.pp, r);
  for (size_t i = 0; i < st.su.units.size(); ++i) {
    const int64_t u = st.su.units[i];
    st.E += u;
    st.E_shard_units += ceil_div(u, sh.shard_n);
    if (i < st.su.roots) st.roots += u;
    else st.biggest_unit = std::max(st.biggest_unit, u);
  }
  st.E_shard_flat = ceil_div(st.E, sh.N);
  return st;
}

// The optimizer's elements on this rank: its shard under ZeRO/FSDP, all of them under ddp.
int64_t optimizer_elements(const Layout& l, const StageElements& st) {
  return shards_params(l.strategy) ? st.E_shard_units : shards_optimizer(l.strategy) ? st.E_shard_flat : st.E;
}

// ZeRO's model states, 2Ψ + 2Ψ + KΨ (bf16) divided as the strategy shards them, the activations of
// the micro-batches in flight on this rank, and the communication buffers.
RankMemory stage_memory(const PlanInput& in, const StageElements& st, const Sharding& sh, int in_flight, int r) {
  const ModelShape& m = in.model;
  const Layout& l = in.layout;
  const int d = dtype_bytes(in.dtype);
  const int optim_bytes = 8 + (d < 4 ? 4 : 0);  // AdamW m, v (+ f32 master weights)
  RankMemory mem;
  const int64_t param_el = shards_params(l.strategy) ? st.E_shard_units : st.E;
  const int64_t grad_el = shards_params(l.strategy) ? st.E_shard_units : shards_grads(l.strategy) ? st.E_shard_flat : st.E;
  mem.param = l.offload == "params" ? 0 : param_el * d;
  mem.grad = grad_el * d;
  mem.optim_state = l.offload == "none" ? optimizer_elements(l, st) * optim_bytes : 0;

  // Activations: the micro-batch·chunk units in flight on this rank, L/(p·v) layers each.
  if (m.has_shape()) {
    const int v = l.pp > 1 ? l.virtual_stages : 1;
    const double layers_per_unit = double(m.n_layer) / double(l.pp * v);
    mem.activation = double(in_flight) * layers_per_unit * layer_activation_bytes(m, l, double(l.micro_batch_size)) * d / 2.0;
    // f32 logits for the loss, vocabulary split over tp: one copy, as this engine's fused
    // classifier keeps them (the softmax is never stored; the gradient is written over them)
    if (r == l.pp - 1) mem.activation += 4.0 * double(m.seq_len) * double(l.micro_batch_size) * double(m.vocab_rows(l.tp)) / l.tp;
  }
  // Buffers: zero's two stripes; fsdp's gathered root + one block (fsdp-grad-op: every unit, gathered
  // from forward to the end of backward; under a pipeline all step, beside its full gradients) and
  // a flat gradient of one unit. ddp's buckets are its
  // gradients (they take the .grad tensors' place and become them as views): nothing beside them.
  if (sh.N > 1) {
    const double gathered = double(std::max(st.roots, st.biggest_unit)) * d;
    if (l.strategy == "ddp") mem.buffers = 0;
    // zero1/zero2: the stripe being filled and the one before it, whose collective is still in
    // flight (the engine frees a stripe's buffer once its reduce-scatter or all-gather completes)
    else if (l.strategy == "zero1" || l.strategy == "zero2") mem.buffers = std::min(2.0 * double(in.bucket_bytes), double(st.E) * d);
    else if (l.strategy == "fsdp-grad-op" && l.pp > 1) mem.buffers = 2.0 * double(st.E) * d + gathered;  // + full grads all step
    else if (l.strategy == "fsdp-grad-op") mem.buffers = double(st.E) * d + gathered;
    else if (m.has_shape()) mem.buffers = double(st.roots + st.biggest_unit) * d + gathered;
    // A raw parameter count has no units: the gathered unit is unknown (not the whole model).
    // Accumulating unsharded over several micro-batches (zero2 also under a pipeline or sequence
    // parallelism), the full gradient is held beside the shard until the last backward reduces it.
    const bool several = (in.global_batch / l.dp) / l.micro_batch_size > 1;
    const bool zero2_full = l.strategy == "zero2" && !l.reduces_every_micro_batch() && (several || l.pp > 1 || l.sequence_parallel);
    const bool fsdp_full = shards_params(l.strategy) && l.grad_accumulation == "unsharded" && several;
    if (zero2_full || fsdp_full) mem.buffers += double(st.E) * d;
  }
  return mem;
}

// What one rank sends in a step: by kind, as ProcessGroup counts it, and by the axis it crosses.
struct StageTraffic {
  std::map<std::string, int64_t> kinds;
  double dp = 0, dp_inter = 0, tp = 0, pp = 0;  // dp_inter: hsdp's replica all-reduce, across nodes
  // The reduce-scatters in dp (and the all-reduces in dp_inter) sent after the last backward,
  // with nothing left to overlap them: under a pipeline, those of the units reduced once a step
  // (the roots, and every unit of fsdp-grad-op), which finish_gradients runs after the schedule.
  double dp_tail = 0, dp_tail_inter = 0;
};

// Data parallelism: ddp's all-reduce, ZeRO-1/2's reduce-scatter and all-gather of the flat vector,
// the FSDP family's per-unit gathers and reduce-scatters (and hsdp's all-reduce over replicas).
void add_dp_traffic(StageTraffic& t, const PlanInput& in, const StageElements& st, const Sharding& sh, int64_t mb) {
  const Layout& l = in.layout;
  const int d = dtype_bytes(in.dtype);
  if (sh.N == 1) return;
  std::map<std::string, int64_t>& k = t.kinds;
  if (l.strategy == "ddp") {
    k["all_reduce"] += comm::all_reduce_bytes(st.E * d, sh.N);
  } else if (l.strategy == "zero1" || l.strategy == "zero2") {
    k["reduce_scatter"] += (l.reduces_every_micro_batch() ? mb : 1) * comm::reduce_scatter_bytes(st.E_shard_flat * sh.N * d, sh.N);
    k["all_gather"] += comm::all_gather_bytes(st.E_shard_flat * sh.N * d, sh.N);
  } else {
    const int gathers = l.strategy == "fsdp-grad-op" ? 1 : 2;  // forward, and again in backward
    for (size_t i = 0; i < st.su.units.size(); ++i) {
      // Every micro-batch gathers and reduces a unit; a pipeline's roots once a step, and under a
      // pipeline fsdp-grad-op's every unit (gathered from its first forward to the step's end).
      const bool once = l.pp > 1 && (i < st.su.roots || l.strategy == "fsdp-grad-op");
      const bool reduced_once = once || l.grad_accumulation == "unsharded";  // no_sync: the last micro-batch
      const int64_t padded = ceil_div(st.su.units[i], sh.shard_n) * sh.shard_n * d;
      k["all_gather"] += (once ? 1 : gathers * mb) * comm::all_gather_bytes(padded, sh.shard_n);
      const int64_t rs = (reduced_once ? 1 : mb) * comm::reduce_scatter_bytes(padded, sh.shard_n);
      k["reduce_scatter"] += rs;
      if (once) t.dp_tail += double(rs);
      if (sh.replicas > 1) {  // each reduced shard, across the replicas
        const int64_t ar = (reduced_once ? 1 : mb) * comm::all_reduce_bytes(padded / sh.shard_n, sh.replicas);
        k["all_reduce"] += ar;
        t.dp_inter += double(ar);
        if (once) t.dp_tail_inter += double(ar);
      }
    }
  }
  // The gradient norm's partial sum (f64) over dp (hsdp: over one shard group, since every
  // replica holds the same shards); under tp/pp over the whole world, on the metrics group,
  // which the counters leave out.
  if (l.strategy != "ddp" && l.tp * l.pp == 1) k["all_reduce"] += comm::all_reduce_bytes(8, sh.shard_n);
  for (const auto& [kind, bytes] : k) t.dp += double(bytes);
  t.dp -= t.dp_inter;
}

// Tensor parallelism, per micro-batch: 4 collectives per layer (attention and MLP, forward and
// backward; 6 with full recompute, which repeats the forward's), one for the vocab-parallel
// embedding (forward) on the first stage, one for the tied head's input gradient on the last; the
// vocab-parallel cross-entropy all-reduces three f32 numbers per token (max, target logit, sum of
// exps). Sequence parallelism turns each all-reduce into a reduce-scatter and an all-gather.
void add_tp_traffic(StageTraffic& t, const PlanInput& in, const Sharding& sh, int64_t mb, int r) {
  const ModelShape& m = in.model;
  const Layout& l = in.layout;
  if (l.tp == 1 || !m.has_shape()) return;
  const int d = dtype_bytes(in.dtype);
  std::map<std::string, int64_t>& k = t.kinds;
  const int64_t act = m.seq_len * l.micro_batch_size * m.n_embd * d;
  const int64_t per_layer = l.recompute == "full" ? 6 : 4;
  const int64_t big = mb * (m.n_layer / l.pp * per_layer + (r == 0 ? 1 : 0) + (r == l.pp - 1 ? 1 : 0));
  if (l.sequence_parallel) {
    // and the column-parallel GEMMs (c_attn, c_fc) gather their input again in the backward
    // instead of keeping it whole (Megatron's sequence parallelism)
    const int64_t gathers = big + mb * (m.n_layer / l.pp) * 2;
    k["all_gather"] += gathers * comm::all_gather_bytes(act, l.tp);
    k["reduce_scatter"] += big * comm::reduce_scatter_bytes(act, l.tp);
    t.tp += double(gathers * comm::all_gather_bytes(act, l.tp) + big * comm::reduce_scatter_bytes(act, l.tp));
    // The replicated parameters' gradients are partial sums over this rank's tokens: one
    // all-reduce each per step (LayerNorms and row-parallel biases, 6·C a block; wpe; ln_f).
    std::vector<int64_t> replicated(size_t(m.n_layer / l.pp * 6), m.n_embd);
    if (r == 0) replicated.push_back(m.block_size * m.n_embd);
    if (r == l.pp - 1) replicated.insert(replicated.end(), {m.n_embd, m.n_embd});
    // The FSDP family sums them after the reduce over dp, on this rank's shards, packed into
    // one all-reduce: about 1/shard_n of them (the segments' cuts move it by a few elements).
    if (shards_params(l.strategy)) {
      int64_t total = 0;
      for (int64_t e : replicated) total += e;
      replicated = {ceil_div(total, sh.shard_n)};
    }
    for (int64_t e : replicated) {
      k["all_reduce"] += comm::all_reduce_bytes(e * d, l.tp);
      t.tp += double(comm::all_reduce_bytes(e * d, l.tp));
    }
  } else {
    k["all_reduce"] += big * comm::all_reduce_bytes(act, l.tp);
    t.tp += double(big * comm::all_reduce_bytes(act, l.tp));
  }
  if (r == l.pp - 1) {
    const int64_t ce = 3 * mb * comm::all_reduce_bytes(int64_t(m.seq_len * l.micro_batch_size * 4), l.tp);
    k["all_reduce"] += ce;
    t.tp += double(ce);
  }
}

// Pipeline parallelism: each micro-batch's activation out and its gradient back at every stage
// boundary this rank's chunks touch, the tied embedding's gradient between the first and last
// stage, and the step's loss.
void add_pp_traffic(StageTraffic& t, const PlanInput& in, const Sharding& sh, int64_t mb, int r) {
  const ModelShape& m = in.model;
  const Layout& l = in.layout;
  if (l.pp == 1 || !m.has_shape()) return;
  const int d = dtype_bytes(in.dtype);
  std::map<std::string, int64_t>& k = t.kinds;
  const int64_t act = m.seq_len * l.micro_batch_size * m.n_embd * d / (l.sequence_parallel ? l.tp : 1);
  const int v = l.virtual_stages, stages = l.pp * v;
  for (int chunk = 0; chunk < v; ++chunk) {
    const int s = chunk * l.pp + r;
    if (s < stages - 1) k["send"] += mb * act, k["recv"] += mb * act;  // activation out, its gradient in
    if (s > 0) k["send"] += mb * act, k["recv"] += mb * act;           // gradient back, activation in
  }
  if (r == 0 || r == l.pp - 1) {  // the tied embedding's gradient, exchanged between its holders
    const int64_t wte = m.vocab_rows(l.tp) * m.n_embd / l.tp;
    const int64_t bytes = (shards_params(l.strategy) ? ceil_div(wte, sh.shard_n) : wte) * d;  // fsdp: its shard
    k["send"] += bytes, k["recv"] += bytes;
  }
  k["all_reduce"] += comm::all_reduce_bytes(8, l.pp);  // the step's loss, known to every stage
  t.pp = double(k["send"]);
}

// The model FLOPs, the step time with the exposed communication and the bubble, and MFU.
// dp_tail: the part of dp_time that waits for the last backward (StageTraffic::dp_tail).
void add_step_time(Plan& p, double dp_time, double dp_tail, double other_time) {
  const PlanInput& in = p.input;
  const ModelShape& m = in.model;
  const Cluster& c = in.cluster;
  const Layout& l = in.layout;
  // Compute: model FLOPs per token 6·(Ψ − wpe) + 12·L·s·h (the convention of bench/RESULTS.md),
  // plus the recomputed forward (full: the whole forward; selective: the attention core's 4·s·h).
  const double psi = double(m.num_params());
  const double L = double(m.n_layer), s = double(m.seq_len), h = double(m.n_embd);
  const double wpe = m.has_shape() ? double(m.block_size) * h : 0;
  p.model_flops_per_token = 6 * (psi - wpe) + 12 * L * s * h;
  double hw = p.model_flops_per_token;
  if (l.recompute == "full") hw += 2 * (psi - wpe) + 4 * L * s * h;
  if (l.recompute == "selective") hw += 4 * L * s * h;
  const double tokens = double(in.global_batch) * std::max(1.0, s);
  p.compute_s = p.timed() ? tokens / l.dp * hw / double(l.tp * l.pp) / (c.peak_flops * c.efficiency) : 0;
  const double t_dp = dp_time, backward = p.compute_s * 2.0 / 3.0;
  // The backward that ddp's buckets and zero2's stripes can hide behind: every micro-batch's when
  // zero2 reduces each, else the last one's (no_sync before it); none under a pipeline (or zero2
  // under sequence parallelism), which reduces once the schedule is over.
  const bool after_schedule = l.pp > 1 || (l.strategy == "zero2" && l.sequence_parallel);
  const double window = after_schedule ? 0.0
                        : l.reduces_every_micro_batch() ? backward
                                                        : backward / double(std::max<int64_t>(1, p.micro_batches));
  double dp_exposed = 0;
  if (l.strategy == "ddp") dp_exposed = std::max(0.0, t_dp - window);          // buckets during backward
  else if (l.strategy == "zero1") dp_exposed = t_dp;                             // after backward, then gather
  else if (l.strategy == "zero2") {  // the reduce-scatters behind the backward, the all-gather after the step
    const double rs = p.comm.count("reduce_scatter") ? double(p.comm.at("reduce_scatter")) : 0.0;
    const double ag = p.comm.count("all_gather") ? double(p.comm.at("all_gather")) : 0.0;
    const double rs_share = rs + ag > 0 ? rs / (rs + ag) : 0.5;  // M micro-batches' reductions (sharded) or one
    dp_exposed = std::max(0.0, t_dp * rs_share - window) + t_dp * (1 - rs_share);
  }
  else dp_exposed = std::max(0.0, t_dp - dp_tail - p.compute_s) + dp_tail;         // prefetched gathers
  p.comm_exposed_s = dp_exposed + other_time;
  p.step_s = p.compute_s * (1 + p.bubble) + p.comm_exposed_s;
  p.tokens_per_s = tokens / p.step_s;
  p.mfu = p.tokens_per_s * p.model_flops_per_token / (double(p.world) * c.peak_flops);
  if (!p.timed()) p.tokens_per_s = p.mfu = 0;  // a raw parameter count without --seq-len: no tokens to count
}

void add_notes(Plan& p) {
  const ModelShape& m = p.input.model;
  const Layout& l = p.input.layout;
  if (!m.has_shape())
    p.notes.push_back(shards_params(l.strategy)
                          ? "raw parameter count: activations, tp and pp traffic and the gathered FSDP unit not estimated"
                          : "raw parameter count: activations, tp and pp traffic not estimated");
  if (dtype_bytes(p.input.dtype) == 4) p.notes.push_back("fp32: Korthikanti's 2-byte activation formulas scaled by 2");
  if (m.has_shape() && l.recompute == "none") {
    // The a·s² term is the attention's score matrices, which a flash attention kernel never stores.
    const double scores = 5.0 * double(m.n_head) * double(m.seq_len) / double(m.n_embd);
    p.notes.push_back(str("Korthikanti's activations count the attention scores (5as/h = ", std::lround(scores),
                          " of the ", std::lround(34 + scores), " bytes per sbh element, ",
                          std::lround(100 * scores / (34 + scores)), "%), which this engine's flash attention never "
                          "stores: train --simulate counts its own"));
  }
  if (l.offload != "none") p.notes.push_back("offload: the optimizer state lives in host memory");
}

// A schedule's simulated bubble and each rank's micro-batches in flight: the same for every layout
// of a search that shares (schedule, p, m, v), and on a long pipeline the costly part of a plan,
// so each is simulated once per process.
struct SimulatedSchedule {
  double bubble = 0;
  std::vector<int> in_flight;
};
SimulatedSchedule simulated_schedule(const std::string& kind, int pp, int micro_batches, int v) {
  static std::mutex mu;
  static std::map<std::tuple<std::string, int, int, int>, SimulatedSchedule> done;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(kind, pp, micro_batches, v);
  if (auto it = done.find(key); it != done.end()) return it->second;
  if (done.size() >= 4096) done.clear();  // bounded: a search meets far fewer
  const auto sched = parallel::pp::make_schedule(kind, pp, micro_batches, v);
  const auto tl = parallel::pp::simulate(sched, 1.0 / v, 2.0 / v);
  SimulatedSchedule s;
  s.bubble = tl.bubble_fraction();
  for (int r = 0; r < pp; ++r) s.in_flight.push_back(tl.peak_in_flight(r));
  return done.emplace(key, std::move(s)).first->second;  // a copy: another call may clear the map
}

}  // namespace

Plan make_plan(const PlanInput& in) {
  check_layout(in);
  const Cluster& c = in.cluster;
  const Layout& l = in.layout;
  Plan p;
  p.input = in;
  p.world = l.dp * l.tp * l.pp;
  p.nodes_used = int(ceil_div(p.world, c.gpus_per_node));
  p.micro_batches = in.global_batch / l.dp / l.micro_batch_size;

  // The schedule, simulated: its bubble and the activations each rank holds.
  std::vector<int> in_flight(size_t(l.pp), 1);
  if (l.pp > 1) {
    const SimulatedSchedule sim = simulated_schedule(l.pp_schedule, l.pp, int(p.micro_batches), l.virtual_stages);
    p.bubble = sim.bubble;
    in_flight = sim.in_flight;
  }

  const Sharding sh = sharding_of(l, c);
  p.shard_group = sh.shard_n;
  const int d = dtype_bytes(in.dtype);
  const bool dp_intra = p.world <= c.gpus_per_node, tp_intra = l.tp <= c.gpus_per_node,
             pp_intra = l.tp * l.pp <= c.gpus_per_node;
  const bool shard_intra = dp_intra || (l.strategy == "hsdp" && sh.shard_n * l.tp * l.pp <= c.gpus_per_node);
  // the slowest rank's data-parallel (and its tail's) / tp + pp + host transfer seconds
  double dp_time = 0, dp_tail = 0, other_time = 0;
  for (int r = 0; r < l.pp; ++r) {
    const StageElements st = stage_elements(in.model, l, sh, r);
    const RankMemory mem = stage_memory(in, st, sh, in_flight[size_t(r)], r);
    p.per_stage.push_back(mem);
    if (mem.total() > p.worst.total()) p.worst = mem;

    StageTraffic t;
    add_dp_traffic(t, in, st, sh, p.micro_batches);
    add_tp_traffic(t, in, sh, p.micro_batches, r);
    add_pp_traffic(t, in, sh, p.micro_batches, r);
    if (r == 0) p.comm = t.kinds;
    const double intra = (shard_intra ? t.dp : 0) + (tp_intra ? t.tp : 0) + (pp_intra ? t.pp : 0);
    const double inter = (shard_intra ? 0 : t.dp) + t.dp_inter + (tp_intra ? 0 : t.tp) + (pp_intra ? 0 : t.pp);
    p.intra_bytes = std::max(p.intra_bytes, intra);
    p.inter_bytes = std::max(p.inter_bytes, inter);

    // Time of this rank's exposed communication (the compute is the same on every rank).
    const double t_dp = t.dp / link_bandwidth(c, shard_intra) + t.dp_inter / c.inter_bandwidth;
    const double t_tail = t.dp_tail / link_bandwidth(c, shard_intra) + t.dp_tail_inter / c.inter_bandwidth;
    const double t_tp = t.tp / link_bandwidth(c, tp_intra), t_pp = t.pp / link_bandwidth(c, pp_intra);
    double host = 0;
    if (l.offload != "none") host += 2.0 * double(optimizer_elements(l, st)) * d / c.host_bandwidth;  // grads down, params up
    if (l.offload == "params") host += 2.0 * double(p.micro_batches) * double(st.E_shard_units) * d / c.host_bandwidth;
    other_time = std::max(other_time, t_tp + t_pp + host);
    if (t_dp > dp_time) dp_time = t_dp, dp_tail = t_tail;
  }
  add_step_time(p, dp_time, dp_tail, other_time);
  p.fits = p.worst.total() <= c.gpu_memory;
  add_notes(p);
  return p;
}

std::vector<Plan> search_plans(const PlanInput& base) {
  check_input(base);
  const int world = base.cluster.gpus_per_node * base.cluster.nodes;
  std::vector<Plan> out;
  auto powers = [](int limit) {
    std::vector<int> v;
    for (int x = 1; x <= limit; x *= 2) v.push_back(x);
    return v;
  };
  for (int tp : powers(base.cluster.gpus_per_node))
    for (int pp = 1; pp <= world / tp; ++pp) {
      if ((world / tp) % pp) continue;
      const int dp = world / (tp * pp);
      for (const char* strategy : {"ddp", "zero1", "zero2", "zero3", "fsdp-grad-op", "hsdp"}) {
        if (std::string(strategy) == "hsdp" && dp * tp * pp <= base.cluster.gpus_per_node) continue;
        for (const char* schedule : {"1f1b", "interleaved"}) {
          if (pp == 1 && std::string(schedule) != "1f1b") continue;
          for (const char* rc : {"none", "selective", "full"})
            for (int64_t mbs : {1, 2, 4, 8, 16})
              for (const char* accumulation : {"sharded", "unsharded"}) {
                PlanInput in = base;
                in.layout = Layout{};
                in.layout.dp = dp, in.layout.tp = tp, in.layout.pp = pp;
                in.layout.sequence_parallel = tp > 1;
                in.layout.strategy = strategy, in.layout.pp_schedule = schedule;
                in.layout.virtual_stages = std::string(schedule) == "interleaved" ? 2 : 1;
                in.layout.recompute = rc, in.layout.micro_batch_size = mbs;
                // zero2 over several micro-batches, where it reduces each (the default): the full
                // gradient held for one reduction a step is a candidate too
                const bool reduces_each = in.layout.reduces_every_micro_batch() && base.global_batch / dp > mbs;
                if (std::string(accumulation) == "unsharded" && !reduces_each) continue;
                in.layout.grad_accumulation = accumulation;
                try {
                  Plan p = make_plan(in);
                  if (p.fits) out.push_back(std::move(p));
                } catch (const Error&) {
                  // an impossible combination (heads, layers, batch): not a candidate
                }
              }
        }
      }
    }
  // Fastest first; among equally fast layouts, the one with the most memory to spare.
  std::stable_sort(out.begin(), out.end(), [](const Plan& a, const Plan& b) {
    if (std::abs(a.tokens_per_s - b.tokens_per_s) > 1e-9 * std::max(a.tokens_per_s, b.tokens_per_s))
      return a.tokens_per_s > b.tokens_per_s;
    return a.worst.total() < b.worst.total();
  });
  return out;
}

nlohmann::json Plan::to_json() const {
  auto mem_json = [](const RankMemory& r) {
    return nlohmann::json{{"param", r.param},           {"grad", r.grad},       {"optim_state", r.optim_state},
                          {"activation", r.activation}, {"buffers", r.buffers}, {"total", r.total()}};
  };
  nlohmann::json j;
  const Layout& l = input.layout;
  j["layout"] = {{"label", l.label()}, {"dp", l.dp}, {"tp", l.tp}, {"pp", l.pp},
                 {"sequence_parallel", l.sequence_parallel}, {"strategy", l.strategy}, {"shard_group_size", l.shard_group_size},
                 {"pp_schedule", l.pp_schedule}, {"virtual_stages", l.virtual_stages}, {"recompute", l.recompute},
                 {"offload", l.offload}, {"grad_accumulation", l.grad_accumulation}, {"micro_batch_size", l.micro_batch_size}};
  j["model"] = {{"name", input.model.name}, {"params", input.model.num_params()}, {"n_layer", input.model.n_layer},
                {"n_head", input.model.n_head}, {"n_embd", input.model.n_embd}, {"seq_len", input.model.seq_len}};
  j["cluster"] = {{"name", input.cluster.name}, {"gpus_per_node", input.cluster.gpus_per_node},
                  {"nodes", input.cluster.nodes}, {"gpu_memory", input.cluster.gpu_memory},
                  {"peak_flops", input.cluster.peak_flops}};
  j["global_batch"] = input.global_batch;
  j["dtype"] = input.dtype;
  j["world"] = world;
  j["micro_batches"] = micro_batches;
  j["memory_per_gpu"] = mem_json(worst);
  j["memory_per_stage"] = nlohmann::json::array();
  for (const auto& r : per_stage) j["memory_per_stage"].push_back(mem_json(r));
  j["comm_bytes_per_step"] = comm;
  j["comm_bytes_by_link"] = {{"intra_node", intra_bytes}, {"inter_node", inter_bytes}};
  j["bubble"] = bubble;
  j["compute_s"] = compute_s;
  j["comm_exposed_s"] = comm_exposed_s;
  j["step_s"] = step_s;
  j["tokens_per_s"] = tokens_per_s;
  j["mfu"] = mfu;
  j["fits"] = fits;
  j["notes"] = notes;
  return j;
}

std::string describe(const Plan& p) {
  auto gib = [](double b) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / double(1ll << 30));
    return std::string(buf);
  };
  std::ostringstream o;
  const PlanInput& in = p.input;
  o << "model " << in.model.name << ": " << double(in.model.num_params()) / 1e6 << "M params";
  if (in.model.has_shape())
    o << " (" << in.model.n_layer << (in.model.n_layer == 1 ? " layer" : " layers") << ", width " << in.model.n_embd
      << ", " << in.model.n_head << (in.model.n_head == 1 ? " head" : " heads") << ", seq "
      << in.model.seq_len << ")";
  o << " | " << in.dtype << " | global batch " << in.global_batch << "\n";
  o << "cluster " << in.cluster.name << ": " << in.cluster.nodes << " x " << in.cluster.gpus_per_node << " GPUs, "
    << gib(in.cluster.gpu_memory) << " each | layout " << in.layout.label() << " (" << p.world << " GPUs, "
    << p.micro_batches << (p.micro_batches == 1 ? " micro-batch" : " micro-batches") << " per step)\n";
  o << "memory per GPU (busiest pipeline rank):\n";
  const RankMemory& w = p.worst;
  o << "  params " << gib(double(w.param)) << " | grads " << gib(double(w.grad)) << " | optimizer "
    << gib(double(w.optim_state)) << " | activations " << gib(w.activation) << " | buffers " << gib(w.buffers)
    << " | total " << gib(w.total()) << (p.fits ? "  -> fits\n" : "  -> does NOT fit\n");
  o << "communication per step (pipeline rank 0, bytes sent):";
  for (const auto& [k, b] : p.comm)
    if (k != "recv") o << " " << k << " " << gib(double(b));
  if (p.comm.count("recv")) o << " (and received: " << gib(double(p.comm.at("recv"))) << ")";
  o << "\n  busiest rank: intra-node " << gib(p.intra_bytes) << ", inter-node " << gib(p.inter_bytes) << "\n";
  char buf[256];
  if (p.timed())
    std::snprintf(buf, sizeof buf,
                  "time: compute %.3f s, pipeline bubble %.1f%% of busy time, exposed communication %.3f s -> step %.3f s, "
                  "%.0f tokens/s, MFU %.1f%%\n",
                  p.compute_s, 100 * p.bubble, p.comm_exposed_s, p.step_s, p.tokens_per_s, 100 * p.mfu);
  else
    std::snprintf(buf, sizeof buf, "time: exposed communication %.3f s a step (compute, tokens/s and MFU: give --seq-len)\n",
                  p.comm_exposed_s);
  o << buf;
  for (const auto& n : p.notes) o << "note: " << n << "\n";
  return o.str();
}

}  // namespace sg::report

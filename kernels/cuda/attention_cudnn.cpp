// Causal scaled-dot-product attention through cuDNN's fused flash-attention engines, built with the
// backend graph API (cudnn_graph.h). The alternative to the hand-written kernels of
// kernels/cuda/attention*.cuh, selected by cuda::set_attention_backend (`--attention cudnn`).
//
// cuDNN has no "attention" call here: it pattern-matches an operation graph. The forward graph is
//   S = Q K^T (f32) -> S * scale -> [causal: select(row >= col, S, lowest)]
//     -> softmax as max / sub / exp / sum / div, with Stats = max + log(sum) (f32, [B,H,T,1])
//     -> O = P V  (P in the i/o type, bf16 or f16)
// and the backward graph rebuilds P = exp(S * scale - Stats) from the saved Stats, then
//   dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dO * O)) * scale,  dK = dS^T Q,  dQ = dS K
// with dQ accumulated in an f32 buffer (the `dQ_accum` the engine expects to start at zero: older
// cuDNN needs a memset, 9.6.0 and newer zero it themselves; set_dq_accumulator) and copied out by
// an identity pointwise op. Q, K, V, dQ, dK, dV take AttentionArgs' q layout and O,
// dO its o layout (a packed [B,T,3,H,D] projection and a [B,T,H,D] output are strides here, no
// copies); K (and V in backward) enter transposed, [B,H,D,T], as strided views of the same
// buffers. dQ_accum is contiguous. Every tensor is 4-D; scalars are [1,1,1,1]
// f32 passed by value. These are the shapes and types cuDNN 9's fused attention engines accept
// (bf16/f16, head dim <= 128 and a multiple of 8).
//
// Built plans are cached per (device, B, H, T, D, dtype, causal, direction, layouts); the scale is a
// by-value scalar supplied at execution, so it is not part of the key. Workspace comes from the
// caching allocator as `workspace` on the compute stream.
#include <cudnn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "core/storage.h"
#include "kernels/cuda/runtime.h"

namespace sg::cuda {

namespace {

std::string last_error_detail() {
  char msg[512] = {0};
  cudnnGetLastErrorString(msg, sizeof(msg));
  return msg[0] ? str(" [", msg, "]") : std::string();
}

// cuDNN refuses this graph/layout (NOT_SUPPORTED or BAD_PARAM category): a contiguous copy may still run.
struct NoPlan : Error {
  using Error::Error;
};

bool refusal(cudnnStatus_t st) {
  const int c = CUDNN_STATUS_CATEGORY(int(st));
  return c == CUDNN_STATUS_NOT_SUPPORTED || c == CUDNN_STATUS_BAD_PARAM;
}

void check(cudnnStatus_t st, const char* call, const char* file, int line) {
  if (st == CUDNN_STATUS_SUCCESS) return;
  std::string m = str(call, " failed: ", cudnnGetErrorString(st), last_error_detail(), " (", file, ":", line, ")");
  if (refusal(st)) throw NoPlan(m);
  throw Error(m);
}

}  // namespace

#define SG_CUDNN_CHECK(call) ::sg::cuda::check((call), #call, __FILE__, __LINE__)

namespace {

using Dims4 = std::array<int64_t, 4>;

// One backend descriptor, destroyed with its owner.
class Desc {
 public:
  explicit Desc(cudnnBackendDescriptorType_t type) { SG_CUDNN_CHECK(cudnnBackendCreateDescriptor(type, &d_)); }
  Desc(Desc&& o) noexcept : d_(o.d_) { o.d_ = nullptr; }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  Desc& operator=(Desc&&) = delete;
  ~Desc() {
    if (d_) cudnnBackendDestroyDescriptor(d_);
  }
  cudnnBackendDescriptor_t get() const { return d_; }
  // Sets one attribute; the error names the attribute (attr_name) rather than the generic call.
  void set(cudnnBackendAttributeName_t attr, const char* attr_name, cudnnBackendAttributeType_t type, int64_t count,
           const void* values) {
    const cudnnStatus_t st = cudnnBackendSetAttribute(d_, attr, type, count, values);
    if (st != CUDNN_STATUS_SUCCESS) {
      std::string m = str("cudnnBackendSetAttribute(", attr_name, ") failed: ", cudnnGetErrorString(st),
                          last_error_detail());
      if (refusal(st)) throw NoPlan(m);
      throw Error(m);
    }
  }
  void finalize() { SG_CUDNN_CHECK(cudnnBackendFinalize(d_)); }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

#define SG_CUDNN_SET(desc, attr, type, count, values) (desc).set(attr, #attr, type, count, values)

// Fixed uids of the tensors the caller binds at execution; virtual tensors count up from kVirtual.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kScale, kDO, kDQ, kDK, kDV, kOne, kLowest, kDQAccum,
  kVirtual = 100,
};

cudnnDataType_t cudnn_type(DType t) {
  switch (t) {
    case DType::bf16: return CUDNN_DATA_BFLOAT16;
    case DType::f16: return CUDNN_DATA_HALF;
    default: break;
  }
  if (t == DType::f32) throw Error("attention (cudnn): f32 is not supported; use --attention flash");
  kernels::unsupported("attention (cudnn)", t, "cuda");
}

Dims4 contiguous_strides(const Dims4& d) { return {d[1] * d[2] * d[3], d[2] * d[3], d[3], 1}; }

// An operation graph under construction: owns every descriptor until the plan is built.
class GraphBuilder {
 public:
  using Tensor = cudnnBackendDescriptor_t;

  Tensor tensor(int64_t uid, cudnnDataType_t dt, const Dims4& dims, const Dims4& strides, bool is_virtual,
                bool by_value = false, bool reorder_f16x16 = false) {
    Desc& t = keep(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t alignment = 16;
    SG_CUDNN_SET(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt);
    SG_CUDNN_SET(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data());
    SG_CUDNN_SET(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data());
    SG_CUDNN_SET(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    SG_CUDNN_SET(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
    SG_CUDNN_SET(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual);
    if (by_value) SG_CUDNN_SET(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value);
    if (reorder_f16x16) {
      const cudnnBackendTensorReordering_t mode = CUDNN_TENSOR_REORDERING_F16x16;
      SG_CUDNN_SET(t, CUDNN_ATTR_TENSOR_REORDERING_MODE, CUDNN_TYPE_TENSOR_REORDERING_MODE, 1, &mode);
    }
    t.finalize();
    return t.get();
  }
  // An intermediate the engine keeps on chip; contiguous unless strides are given.
  Tensor temp(cudnnDataType_t dt, const Dims4& dims) { return temp(dt, dims, contiguous_strides(dims)); }
  Tensor temp(cudnnDataType_t dt, const Dims4& dims, const Dims4& strides) {
    return tensor(next_virtual_++, dt, dims, strides, true);
  }
  Tensor scalar(int64_t uid) { return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true); }

  // y = a b (batched over the first two dims), f32 accumulation.
  void matmul(Tensor a, Tensor b, Tensor c) {
    Desc& m = keep(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    SG_CUDNN_SET(m, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    m.finalize();
    Desc& op = keep(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    const cudnnBackendDescriptor_t md = m.get();
    SG_CUDNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a);
    SG_CUDNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    SG_CUDNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c);
    SG_CUDNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &md);
    add_op(op);
  }

  // y = mode(x[, b[, t]]) elementwise with broadcasting; `prec` is the math type (f32, or i32/bool
  // for index generation and comparisons). axis: the dimension GEN_INDEX enumerates.
  void pointwise(cudnnPointwiseMode_t mode, Tensor x, Tensor b, Tensor t, Tensor y,
                 cudnnDataType_t prec = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    Desc& pw = keep(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    SG_CUDNN_SET(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    SG_CUDNN_SET(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec);
    if (axis >= 0) SG_CUDNN_SET(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    pw.finalize();
    Desc& op = keep(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    const cudnnBackendDescriptor_t pd = pw.get();
    SG_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pd);
    SG_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    if (b) SG_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    if (t) SG_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t);
    SG_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    add_op(op);
  }
  Tensor unary(cudnnPointwiseMode_t mode, Tensor x, const Dims4& dims, cudnnDataType_t out = CUDNN_DATA_FLOAT) {
    Tensor y = temp(out, dims);
    pointwise(mode, x, nullptr, nullptr, y);
    return y;
  }
  Tensor binary(cudnnPointwiseMode_t mode, Tensor x, Tensor b, const Dims4& dims,
                cudnnDataType_t out = CUDNN_DATA_FLOAT) {
    Tensor y = temp(out, dims);
    pointwise(mode, x, b, nullptr, y);
    return y;
  }

  // y [.., 1] = op over the last axis of x.
  void reduction(cudnnReduceTensorOp_t how, Tensor x, Tensor y) {
    Desc& r = keep(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    SG_CUDNN_SET(r, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &how);
    SG_CUDNN_SET(r, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    r.finalize();
    Desc& op = keep(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    const cudnnBackendDescriptor_t rd = r.get();
    SG_CUDNN_SET(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    SG_CUDNN_SET(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    SG_CUDNN_SET(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &rd);
    add_op(op);
  }

  // y = x seen with other dims/strides (here: a transpose of the last two axes), no data movement.
  void reshape(Tensor x, Tensor y) {
    Desc& op = keep(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    SG_CUDNN_SET(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    SG_CUDNN_SET(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    add_op(op);
  }

  // scores with the strictly-upper triangle (col > row) replaced by the lowest float.
  Tensor causal_mask(Tensor s, const Dims4& dims, Tensor lowest) {
    Tensor row = temp(CUDNN_DATA_INT32, dims), col = temp(CUDNN_DATA_INT32, dims);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, row, CUDNN_DATA_INT32, 2);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, col, CUDNN_DATA_INT32, 3);
    Tensor keep_it = temp(CUDNN_DATA_BOOLEAN, dims);
    pointwise(CUDNN_POINTWISE_CMP_GE, row, col, nullptr, keep_it, CUDNN_DATA_BOOLEAN);
    Tensor out = temp(CUDNN_DATA_FLOAT, dims);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, lowest, keep_it, out);  // out = keep ? s : lowest
    return out;
  }

  const std::vector<cudnnBackendDescriptor_t>& ops() const { return ops_; }
  std::deque<Desc>& descriptors() { return descs_; }

 private:
  Desc& keep(cudnnBackendDescriptorType_t type) { return descs_.emplace_back(type); }
  void add_op(Desc& op) {
    op.finalize();
    ops_.push_back(op.get());
  }
  std::deque<Desc> descs_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  int64_t next_virtual_ = kVirtual;
};

struct Shape {
  int64_t B, H, T, D;
  kernels::AttentionArgs::Strides q, o;  // layouts of q, k, v, dq, dk, dv and of out, dout
  Dims4 bhtd() const { return {B, H, T, D}; }
  Dims4 bhtt() const { return {B, H, T, T}; }
  Dims4 rows() const { return {B, H, T, 1}; }
  Dims4 q_strides() const { return {q.b, q.h, q.t, 1}; }
  Dims4 o_strides() const { return {o.b, o.h, o.t, 1}; }
  // [B,H,D,T]: the transpose of a q-layout [B,H,T,D] tensor, as strides.
  Dims4 bhdt() const { return {B, H, D, T}; }
  Dims4 q_transposed_strides() const { return {q.b, q.h, 1, q.t}; }
  // [B,H,T,T] transposed in its last two axes, as strides.
  Dims4 bhtt_transposed_strides() const { return {H * T * T, T * T, 1, T}; }
};

void build_forward(GraphBuilder& g, const Shape& s, cudnnDataType_t io, bool causal) {
  auto Q = g.tensor(kQ, io, s.bhtd(), s.q_strides(), false);
  auto KT = g.tensor(kK, io, s.bhdt(), s.q_transposed_strides(), false);
  auto V = g.tensor(kV, io, s.bhtd(), s.q_strides(), false);
  auto O = g.tensor(kO, io, s.bhtd(), s.o_strides(), false);
  auto stats = g.tensor(kStats, CUDNN_DATA_FLOAT, s.rows(), contiguous_strides(s.rows()), false);
  auto scale = g.scalar(kScale);

  auto S = g.temp(CUDNN_DATA_FLOAT, s.bhtt());
  g.matmul(Q, KT, S);
  S = g.binary(CUDNN_POINTWISE_MUL, S, scale, s.bhtt());
  if (causal) S = g.causal_mask(S, s.bhtt(), g.scalar(kLowest));
  // Softmax with its statistics: Stats = max + log(sum(exp(S - max))).
  auto max = g.temp(CUDNN_DATA_FLOAT, s.rows());
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, S, max);
  auto e = g.unary(CUDNN_POINTWISE_EXP, g.binary(CUDNN_POINTWISE_SUB, S, max, s.bhtt()), s.bhtt());
  auto sum = g.temp(CUDNN_DATA_FLOAT, s.rows());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum);
  g.pointwise(CUDNN_POINTWISE_ADD, max, g.unary(CUDNN_POINTWISE_LOG, sum, s.rows()), nullptr, stats);
  auto P = g.binary(CUDNN_POINTWISE_DIV, e, sum, s.bhtt(), io);  // the second matmul takes P in the i/o type
  g.matmul(P, V, O);
}

void build_backward(GraphBuilder& g, const Shape& s, cudnnDataType_t io, bool causal) {
  auto Q = g.tensor(kQ, io, s.bhtd(), s.q_strides(), false);
  auto KT = g.tensor(kK, io, s.bhdt(), s.q_transposed_strides(), false);
  auto VT = g.tensor(kV, io, s.bhdt(), s.q_transposed_strides(), false);
  auto O = g.tensor(kO, io, s.bhtd(), s.o_strides(), false);
  auto dO = g.tensor(kDO, io, s.bhtd(), s.o_strides(), false);
  auto stats = g.tensor(kStats, CUDNN_DATA_FLOAT, s.rows(), contiguous_strides(s.rows()), false);
  auto dQ = g.tensor(kDQ, io, s.bhtd(), s.q_strides(), false);
  auto dK = g.tensor(kDK, io, s.bhtd(), s.q_strides(), false);
  auto dV = g.tensor(kDV, io, s.bhtd(), s.q_strides(), false);
  auto dQ_accum = g.tensor(kDQAccum, CUDNN_DATA_FLOAT, s.bhtd(), contiguous_strides(s.bhtd()), false, false, true);
  auto scale = g.scalar(kScale), one = g.scalar(kOne);

  // delta = rowsum(dO * O), the softmax-backward term (times 1: the engine's no-dropout form).
  auto delta = g.temp(CUDNN_DATA_FLOAT, s.rows());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, g.binary(CUDNN_POINTWISE_MUL, dO, O, s.bhtd()), delta);
  delta = g.binary(CUDNN_POINTWISE_MUL, delta, one, s.rows());

  // P = exp(S * scale - Stats), rebuilt from the forward's statistics.
  auto S = g.temp(CUDNN_DATA_FLOAT, s.bhtt());
  g.matmul(Q, KT, S);
  S = g.binary(CUDNN_POINTWISE_MUL, S, scale, s.bhtt());
  if (causal) S = g.causal_mask(S, s.bhtt(), g.scalar(kLowest));
  auto P = g.unary(CUDNN_POINTWISE_EXP, g.binary(CUDNN_POINTWISE_SUB, S, stats, s.bhtt()), s.bhtt());

  // dV = P^T dO
  auto PT = g.temp(io, s.bhtt(), s.bhtt_transposed_strides());
  g.reshape(P, PT);
  g.matmul(PT, dO, dV);

  // dS = P * (dO V^T - delta) * scale
  auto dP = g.temp(CUDNN_DATA_FLOAT, s.bhtt());
  g.matmul(dO, VT, dP);
  dP = g.binary(CUDNN_POINTWISE_MUL, dP, one, s.bhtt());
  dP = g.binary(CUDNN_POINTWISE_SUB, dP, delta, s.bhtt());
  auto dS = g.binary(CUDNN_POINTWISE_MUL, dP, P, s.bhtt());
  dS = g.binary(CUDNN_POINTWISE_MUL, dS, scale, s.bhtt());

  // dK = dS^T Q
  auto dST = g.temp(io, s.bhtt(), s.bhtt_transposed_strides());
  g.reshape(dS, dST);
  g.matmul(dST, Q, dK);

  // dQ = dS K, accumulated in f32 and copied out.
  auto K = g.temp(CUDNN_DATA_FLOAT, s.bhtd(), s.q_strides());  // KT's memory viewed as [B,H,T,D]
  g.reshape(KT, K);
  g.matmul(dS, K, dQ_accum);
  g.pointwise(CUDNN_POINTWISE_IDENTITY, dQ_accum, nullptr, nullptr, dQ);
}

cudnnHandle_t handle_for(Device d) {
  return once_per_device<cudnnHandle_t>(d, [] {
    cudnnHandle_t h;
    SG_CUDNN_CHECK(cudnnCreate(&h));
    return h;
  });
}

// A built execution plan with everything it was built from.
struct Plan {
  GraphBuilder graph;
  std::unique_ptr<Desc> op_graph, plan;
  std::deque<Desc> configs;
  int64_t workspace = 0;
};

using PlanKey = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int, bool, bool, std::array<int64_t, 6>>;

// The first engine config cuDNN's heuristics rank highest that builds into a plan.
void make_plan(Plan& p, cudnnHandle_t handle, const char* what) {
  p.op_graph = std::make_unique<Desc>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  const auto& ops = p.graph.ops();
  SG_CUDNN_SET(*p.op_graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, int64_t(ops.size()),
               ops.data());
  SG_CUDNN_SET(*p.op_graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
  p.op_graph->finalize();
  const cudnnBackendDescriptor_t graph = p.op_graph->get();

  std::string tried;
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    SG_CUDNN_SET(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph);
    SG_CUDNN_SET(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
    heur.finalize();
    int64_t count = 0;
    SG_CUDNN_CHECK(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                            0, &count, nullptr));
    if (count == 0) continue;
    p.configs.clear();
    std::vector<cudnnBackendDescriptor_t> cfgs;
    for (int64_t i = 0; i < count; ++i) cfgs.push_back(p.configs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR).get());
    SG_CUDNN_CHECK(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                            count, &count, cfgs.data()));
    for (int64_t i = 0; i < count; ++i) {
      auto plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      SG_CUDNN_SET(*plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
      SG_CUDNN_SET(*plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfgs[i]);
      // An engine that cannot run this graph says so here: note it and try the next one.
      const cudnnStatus_t st = cudnnBackendFinalize(plan->get());
      if (st != CUDNN_STATUS_SUCCESS) {
        tried += str(tried.empty() ? "" : "; ", "config ", i, ": ", cudnnGetErrorString(st), last_error_detail());
        continue;
      }
      SG_CUDNN_CHECK(cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                              CUDNN_TYPE_INT64, 1, &count, &p.workspace));
      p.plan = std::move(plan);
      return;
    }
  }
  throw NoPlan(str(what, ": cuDNN has no engine for this attention graph",
                  tried.empty() ? std::string(" (the heuristics returned no configuration)") : " (" + tried + ")",
                  "; cuDNN's fused attention needs bf16/f16, head dim <= 128 and a multiple of 8, and sm_80 or newer"));
}

// The cached plan for this shape and direction, built on first use.
Plan& plan_for(const kernels::AttentionArgs& a, Device d, bool backward) {
  static std::mutex mu;
  static std::map<PlanKey, std::unique_ptr<Plan>> cache;
  const cudnnDataType_t io = cudnn_type(a.dtype);
  const char* what = backward ? "attention_backward (cudnn)" : "attention (cudnn)";
  SG_CHECK(a.D % 8 == 0 && a.D <= 128, what, ": head dim D = ", a.D,
           " is not supported (cuDNN's fused attention needs D <= 128 and a multiple of 8); use --attention flash");
  const kernels::AttentionArgs::Strides q = a.q_layout(), o = a.o_layout();
  const PlanKey key{d.index, a.B, a.H, a.T, a.D, int(a.dtype), a.causal, backward,
                    std::array<int64_t, 6>{q.b, q.h, q.t, o.b, o.h, o.t}};
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = cache[key];
  if (slot) return *slot;
  auto p = std::make_unique<Plan>();
  const Shape s{a.B, a.H, a.T, a.D, q, o};
  if (backward)
    build_backward(p->graph, s, io, a.causal);
  else
    build_forward(p->graph, s, io, a.causal);
  make_plan(*p, handle_for(d), what);
  slot = std::move(p);
  return *slot;
}

bool contiguous_layouts(const kernels::AttentionArgs& a) {
  const auto c = [&](const kernels::AttentionArgs::Strides& s) {
    return s.b == a.H * a.T * a.D && s.h == a.T * a.D && s.t == a.D;
  };
  return c(a.q_layout()) && c(a.o_layout());
}

// Runs a plan with the given (uid, pointer) bindings on the stream.
void execute(const Plan& p, Device d, cudaStream_t stream, std::vector<int64_t> uids, std::vector<void*> ptrs) {
  const Storage workspace(size_t(std::max<int64_t>(p.workspace, 1)), d, MemCategory::workspace);
  cudnnHandle_t h = handle_for(d);
  // A handle is one host thread's at a time (cuDNN's rule), and DataParallel may run two threads
  // on one device: the stream set and the launch go together. Both only enqueue work.
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  SG_CUDNN_CHECK(cudnnSetStream(h, stream));
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  void* ws = workspace.data();
  SG_CUDNN_SET(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, int64_t(uids.size()), uids.data());
  SG_CUDNN_SET(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, int64_t(ptrs.size()), ptrs.data());
  SG_CUDNN_SET(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
  pack.finalize();
  SG_CUDNN_CHECK(cudnnBackendExecute(h, p.plan->get(), pack.get()));
}

}  // namespace

namespace {
std::atomic<bool> g_force_contiguous{false};
}

void force_cudnn_contiguous_layouts(bool force) { g_force_contiguous = force; }

bool cudnn_attention_takes_layout(const kernels::AttentionArgs& a, Device d, bool backward) {
  if (a.dtype == DType::f32 || a.D % 8 != 0 || a.D > 128) return true;  // run(a) throws the precise error
  // Every tensor is declared 16-byte aligned (CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT): pointers and the
  // b/h/t strides (in bytes) must honour that, or the copies (fresh, aligned buffers) run instead.
  const int64_t per16 = 16 / int64_t(dtype_size(a.dtype));
  const auto ok_ptr = [](const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const auto ok_strides = [&](const kernels::AttentionArgs::Strides& s) {
    return per16 > 0 && s.b % per16 == 0 && s.h % per16 == 0 && s.t % per16 == 0;
  };
  // (The log-sum-exp is not copied: cudnn_attention_forward/backward check it.)
  const bool aligned = ok_ptr(a.q) && ok_ptr(a.k) && ok_ptr(a.v) && ok_ptr(a.out) &&
                       (!backward || (ok_ptr(a.dout) && ok_ptr(a.dq) && ok_ptr(a.dk) && ok_ptr(a.dv))) &&
                       ok_strides(a.q_layout()) && ok_strides(a.o_layout());
  if (!aligned) return false;
  if (contiguous_layouts(a)) return true;  // what every engine takes; its errors are the caller's
  if (g_force_contiguous) return false;
  static std::mutex mu;
  static std::map<PlanKey, bool> answers;
  const kernels::AttentionArgs::Strides q = a.q_layout(), o = a.o_layout();
  const PlanKey key{d.index, a.B, a.H, a.T, a.D, int(a.dtype), a.causal, backward,
                    std::array<int64_t, 6>{q.b, q.h, q.t, o.b, o.h, o.t}};
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = answers.find(key);
    if (it != answers.end()) return it->second;
  }
  bool takes = true;
  try {
    plan_for(a, d, backward);
  } catch (const NoPlan& e) {
    takes = false;
    static std::once_flag warned;
    std::call_once(warned, [&] {
      std::fprintf(stderr, "shardgrad: cuDNN builds no %s plan for q, k, v strides (%lld, %lld, %lld) and out strides "
                   "(%lld, %lld, %lld); such calls run on contiguous copies (%s)\n", backward ? "backward" : "forward",
                   (long long)q.b, (long long)q.h, (long long)q.t, (long long)o.b, (long long)o.h, (long long)o.t,
                   e.what());
    });
  }
  std::lock_guard<std::mutex> lock(mu);
  answers[key] = takes;
  return takes;
}

// The stats (log-sum-exp, f32 [B, H, T]) are declared 16-byte aligned like every tensor of the graph.
static void check_stats(const float* stats) {
  SG_CHECK(reinterpret_cast<uintptr_t>(stats) % 16 == 0, "attention (cudnn): the log-sum-exp buffer at ",
           static_cast<const void*>(stats), " is not 16-byte aligned, as cuDNN's graph declares it");
}

namespace {
std::atomic<int> g_dq_accumulator{int(DqAccumulator::memset)};
}  // namespace

bool cudnn_zeroes_dq_accumulator() { return cudnnGetVersion() >= 90600; }

void set_dq_accumulator(DqAccumulator how) {
  const size_t v = cudnnGetVersion();
  SG_CHECK(how == DqAccumulator::memset || cudnn_zeroes_dq_accumulator(), "attention (cudnn): dQ accumulator '",
           name(how), "' needs cuDNN 9.6.0 or newer to zero it; this is ", v / 10000, ".", v / 100 % 100, ".", v % 100,
           " (use memset)");
  g_dq_accumulator = int(how);
}

DqAccumulator dq_accumulator() { return DqAccumulator(g_dq_accumulator.load()); }

void cudnn_attention_forward(const kernels::AttentionArgs& a, float* stats, Device d, cudaStream_t stream) {
  check_stats(stats);
  const Plan& p = plan_for(a, d, false);
  float scale = float(a.scale), lowest = std::numeric_limits<float>::lowest();  // by value: host pointers
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kScale};
  std::vector<void*> ptrs{const_cast<void*>(a.q), const_cast<void*>(a.k), const_cast<void*>(a.v), a.out, stats,
                          &scale};
  if (a.causal) uids.push_back(kLowest), ptrs.push_back(&lowest);
  execute(p, d, stream, uids, ptrs);
}

void cudnn_attention_backward(const kernels::AttentionArgs& a, const float* stats, Device d, cudaStream_t stream) {
  check_stats(stats);
  const Plan& p = plan_for(a, d, true);
  // dQ is summed over key blocks into an f32 buffer that starts at zero: set so here (memset), or
  // by the engine itself (cuDNN 9.6.0 and newer; a memset of B·H·T·D floats saved, 201 MB a layer
  // for GPT-2 at batch 64).
  const Storage dq_accum(size_t(a.B * a.H * a.T * a.D) * sizeof(float), d, MemCategory::workspace);
  const DqAccumulator how = dq_accumulator();
  if (how != DqAccumulator::engine)
    SG_CUDA_CHECK(cudaMemsetAsync(dq_accum.data(), how == DqAccumulator::memset ? 0 : 0xff, dq_accum.nbytes(), stream));
  float scale = float(a.scale), one = 1.0f, lowest = std::numeric_limits<float>::lowest();
  std::vector<int64_t> uids{kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kDQAccum, kScale, kOne};
  std::vector<void*> ptrs{const_cast<void*>(a.q), const_cast<void*>(a.k), const_cast<void*>(a.v),
                          a.out,                  const_cast<void*>(a.dout), const_cast<float*>(stats),
                          a.dq,                   a.dk,                   a.dv,
                          dq_accum.data(),        &scale,                 &one};
  if (a.causal) uids.push_back(kLowest), ptrs.push_back(&lowest);
  execute(p, d, stream, uids, ptrs);
}

}  // namespace sg::cuda

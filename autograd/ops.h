// The public ops: every tensor computation a model, optimizer or strategy does goes through here.
// Each op checks its operands (naming the op and the shapes), dispatches to the device's kernel
// through the op table, and — when an input requires grad and a tape is active — records a Node
// whose backward keeps only what it needs. Ops on bf16/f16 CPU tensors compute in f32.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "core/tensor.h"

namespace sg {

// ---- creation and data movement (never recorded) ----
Tensor empty(const Shape& shape, DType dtype = DType::f32, Device device = Device::cpu());
Tensor full(const Shape& shape, double value, DType dtype = DType::f32, Device device = Device::cpu());
Tensor zeros(const Shape& shape, DType dtype = DType::f32, Device device = Device::cpu());
Tensor ones(const Shape& shape, DType dtype = DType::f32, Device device = Device::cpu());
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor arange(int64_t n, DType dtype = DType::i64, Device device = Device::cpu());
// Philox draws: element i of the flattened tensor uses counter first + i in the given stream.
Tensor randn(const Shape& shape, uint64_t seed, uint64_t stream, double mean = 0, double std = 1,
             DType dtype = DType::f32, Device device = Device::cpu(), uint64_t first = 0);
Tensor rand(const Shape& shape, uint64_t seed, uint64_t stream, double lo = 0, double hi = 1,
            DType dtype = DType::f32, Device device = Device::cpu(), uint64_t first = 0);
// randn's draws written over t (contiguous, not recorded): element i takes counter first + i.
void normal_(const Tensor& t, uint64_t seed, uint64_t stream, double mean = 0, double std = 1, uint64_t first = 0);

template <class T>
Tensor from_vector(const std::vector<T>& v, const Shape& shape, Device device = Device::cpu());
template <class T>
std::vector<T> to_vector(const Tensor& t);  // any dtype, any layout, any device
double item(const Tensor& t);                // one-element tensor as double

Tensor to(const Tensor& t, DType dtype);     // differentiable cast
Tensor to(const Tensor& t, Device device);   // differentiable device move
Tensor contiguous(const Tensor& t);          // differentiable; a no-op handle when already contiguous
Tensor clone(const Tensor& t);               // differentiable copy

// In-place, never recorded (optimizer steps, gradient buffers, communication buffers). On a tensor
// that requires grad they are refused while a tape records (what its nodes saved would change
// unseen); write under a NoGradGuard. There are no version counters: a tensor that requires no
// grad but that a node saved (a weight frozen for the step) must not be written before backward.
void copy_(const Tensor& dst, const Tensor& src);  // same shape; converts dtype; any layouts
void fill_(const Tensor& t, double value);
void zero_(const Tensor& t);
void add_(const Tensor& t, const Tensor& other, double alpha = 1.0);  // t += alpha * other
void mul_(const Tensor& t, double s);

// ---- views (zero-copy, differentiable) ----
Tensor reshape(const Tensor& t, Shape shape);  // one -1 allowed; copies only if the layout needs it
Tensor view(const Tensor& t, Shape shape);     // like reshape, but refuses to copy
Tensor transpose(const Tensor& t, int64_t d0, int64_t d1);
Tensor permute(const Tensor& t, const std::vector<int64_t>& dims);
Tensor narrow(const Tensor& t, int64_t dim, int64_t start, int64_t length);
Tensor expand(const Tensor& t, const Shape& shape);
Tensor unsqueeze(const Tensor& t, int64_t dim);
Tensor squeeze(const Tensor& t, int64_t dim);
Tensor flatten(const Tensor& t);
Tensor cat(const std::vector<Tensor>& ts, int64_t dim);
std::vector<Tensor> chunk(const Tensor& t, int64_t n, int64_t dim);  // views

// ---- elementwise (broadcasting, differentiable) ----
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);  // not differentiable: refused on inputs that need a gradient
Tensor add(const Tensor& a, double s);
Tensor mul(const Tensor& a, double s);
Tensor neg(const Tensor& a);
Tensor exp(const Tensor& a);
Tensor log(const Tensor& a);
Tensor sqrt(const Tensor& a);
Tensor tanh(const Tensor& a);
Tensor square(const Tensor& a);
Tensor pow(const Tensor& a, double p);
Tensor relu(const Tensor& a);
Tensor gelu(const Tensor& a);  // tanh approximation, as GPT-2
Tensor silu(const Tensor& a);

// ---- reductions ----
Tensor sum(const Tensor& a);  // all elements -> shape []
Tensor sum(const Tensor& a, std::vector<int64_t> dims, bool keepdim = false);
Tensor mean(const Tensor& a);
Tensor mean(const Tensor& a, std::vector<int64_t> dims, bool keepdim = false);
Tensor amax(const Tensor& a, int64_t dim, bool keepdim = false);  // not differentiable (as maximum)
Tensor sum_to(const Tensor& a, const Shape& shape);                // undo a broadcast
double sum_squares(const Tensor& a);                                // f64 on the CPU, f32 on a GPU
// sum_i weights[i] * sum_squares(xs[i]) (weights default to 1; undefined tensors count zero), with
// one host round trip per device and dtype instead of one per tensor: squared global norms. On the
// CPU, for tensors of one dtype, the same bits as adding the single-tensor sum_squares in order.
double sum_squares(const std::vector<Tensor>& xs, const std::vector<double>& weights = {});

// ---- linear algebra ----
// a [..., M, K] @ b [..., K, N] with broadcast batch dims; b may be 2-D.
Tensor matmul(const Tensor& a, const Tensor& b);
// y = x W^T + b with W [out, in] (PyTorch's nn.Linear layout); b may be undefined. With residual
// (the output's shape, x's dtype and device): add(residual, linear(x, w, b)), the add in the
// GEMM's epilogue (GemmArgs::residual; on the CPU the same values bit for bit in f32 and f64; a
// GPU rounds the sum once), the residual's gradient the output's, handed on as it is.
//
// Sequence parallelism's input (Megatron): given a Regather, linear, linear_gelu and mlp take x as
// this rank's sequence shard and regather.gather(x) as their input, in the forward and again in
// the backward for the weight gradient, so that the node keeps the shard, not the whole sequence;
// the input's gradient goes back through regather.scatter. Both run unrecorded (tensor
// parallelism's all-gather and reduce-scatter along the sequence).
struct Regather {
  std::function<Tensor(const Tensor&)> gather, scatter;
  explicit operator bool() const { return bool(gather); }
};
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& residual = Tensor(),
              const Regather& regather = {});
// gelu(linear(x, w, b)) in one GEMM (the bias and GELU in its epilogue; the same values on the CPU,
// bit for bit); keeps the pre-activation for the backward, as gelu would.
Tensor linear_gelu(const Tensor& x, const Tensor& w, const Tensor& b, const Regather& regather = {});
// A transformer's MLP, linear(linear_gelu(x, w1, b1), w2, b2), as one node (b1, b2 may be
// undefined). The same forward values; the backward folds the GELU derivative and c_fc's bias
// gradient into the GEMM that computes c_proj's input gradient, and each bias gradient into its
// weight-gradient GEMM (bit for bit the two-op form's gradients on the CPU in f32 and f64).
// With residual (the shape of the output, x's dtype and device): add(residual, mlp(...)), the add
// done by c_proj's GEMM (its residual epilogue) instead of another pass over the output; the
// residual's gradient is the output's, handed on as it is.
Tensor mlp(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
           const Tensor& residual = Tensor(), const Regather& regather = {});

// ---- neural-network ops ----
Tensor softmax(const Tensor& x);      // over the last dim
Tensor log_softmax(const Tensor& x);  // over the last dim
// Over the last dim; w and b [C] may each be undefined (no gain: PyTorch's elementwise_affine=False;
// no bias).
Tensor layernorm(const Tensor& x, const Tensor& w, const Tensor& b, double eps = 1e-5);
// The residual add and the LayerNorm after it in one pass: {r, y} with r = x + residual and
// y = layernorm(r, w, b, eps). Same values as add then layernorm (bit for bit on the CPU in f32 and
// f64); on a GPU the sum is stored once and read back once instead of written, read, and read again.
std::pair<Tensor, Tensor> add_layernorm(const Tensor& x, const Tensor& residual, const Tensor& w, const Tensor& b,
                                        double eps = 1e-5);
Tensor rmsnorm(const Tensor& x, const Tensor& w, double eps = 1e-6);
Tensor embedding(const Tensor& weight, const Tensor& idx);  // weight [V, C], idx int -> [..., C]

struct CrossEntropyOptions {
  int64_t vocab = -1;          // real vocabulary: columns >= vocab are padding and never count
  int64_t ignore_index = -1;   // targets equal to this contribute nothing
  bool sum = false;            // false: mean over counted targets (0 when none counts, where
                               // PyTorch gives NaN: a micro-batch of padding adds nothing); true: plain sum
  double scale = 1.0;          // multiplies the result (e.g. 1 / global token count)
};
// logits [..., Vp], targets [...] (i32/i64): the logits' leading dims, or those flattened into one
// (rows). Fused: probabilities are never materialised.
// Pass the logits with std::move when nothing else will read them (a model head's output): the
// forward then writes their gradient over them in the same pass (the fused classifier), and they
// are read from memory once. Logits the caller still holds are never written.
Tensor cross_entropy(Tensor logits, const Tensor& targets, const CrossEntropyOptions& opt = {});
int64_t count_targets(const Tensor& targets, int64_t ignore_index);
// The checks every loss over class logits makes of its targets, named by `op`: i32/i64, one per
// row of logits [..., V], shaped as the logits' leading dims or flat [rows]. Returns rows.
int64_t check_class_targets(const char* op, const Tensor& logits, const Tensor& targets);

// Dropout with a Philox mask from the dropout generator's next stream; identity when p == 0 or
// the generator is off (evaluation).
Tensor dropout(const Tensor& x, double p);
// Dropout of a model activation x [rows, T, C] at call site `site` (a fixed number per place in
// the model): element (r, t, c) keeps when Philox(seed, stream(step, site, row0 + r),
// (t0 + t) C + c) >= p, with (step, row0, t0) the generator's place. The mask is thus a function
// of where the element sits in the step's global batch, not of which rank, micro-batch or call
// order computes it: every layout (dp, tp with sequence parallelism, pp, any micro-batching)
// draws the single-process run's masks.
Tensor dropout(const Tensor& x, double p, int64_t site);
// Causal (or full) attention on q, k, v [B, H, T, D]; scale defaults to 1/sqrt(D).
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal = true, double scale = 0);
// Causal self-attention straight from a packed projection qkv [B, T, 3C] (q, k, v side by side,
// each C = n_head * D split into heads along C, as GPT-2's c_attn lays them out) to y [B, T, C]
// with the heads merged: the kernels read and write those layouts in place, so the head split and
// merge copies, forward and backward, do not exist. Same values as attention() on the split heads.
Tensor attention_qkv(const Tensor& qkv, int64_t n_head, bool causal = true, double scale = 0);

// Where the rows a site dropout draws for sit: the training step, the step's global batch row of
// the tensor's first row, and the sequence position of its first position (sequence parallelism
// holds a slice of T). The trainer sets it per micro-batch, the pipeline per action.
struct DropoutPlace {
  int64_t step = 0;
  int64_t row0 = 0;
  int64_t t0 = 0;
};
// The generator dropout draws from (per thread): the seed, the next stream of plain dropout, the
// place of site dropout, and whether dropout is on. Recompute saves and restores it so a re-run
// region draws the same masks.
struct DropoutGenerator {
  uint64_t seed = 0;
  uint64_t next_stream = 0;
  DropoutPlace place;
  bool active = true;  // off: dropout is the identity (evaluation)
  static DropoutGenerator seeded(uint64_t seed, uint64_t next_stream = 0) {
    DropoutGenerator g;
    g.seed = seed, g.next_stream = next_stream;
    return g;
  }
};
DropoutGenerator& dropout_generator();
// Evaluation: dropout is the identity while this lives (what PyTorch's model.eval() does).
class DropoutOff {
 public:
  DropoutOff() : was_(dropout_generator().active) { dropout_generator().active = false; }
  ~DropoutOff() { dropout_generator().active = was_; }
  DropoutOff(const DropoutOff&) = delete;
  DropoutOff& operator=(const DropoutOff&) = delete;

 private:
  bool was_;
};

}  // namespace sg

// Tape-based autograd. An op whose inputs require grad records a Node on the tape that is active
// on this thread. Several tapes may be live at once (one per pipeline micro-batch in flight);
// each is walked backward on its own. Nodes keep only what their backward needs (saved tensors
// are detached handles, so no Node ever owns the graph above it through a saved output).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace sg::autograd {

using TensorList = std::vector<Tensor>;
// Given the gradients of the node's outputs (undefined entries mean zero), return one gradient
// per input edge (undefined = no gradient for that input).
using BackwardFn = std::function<TensorList(const TensorList& grad_outputs)>;

struct Edge {
  std::shared_ptr<Node> producer;      // non-leaf input: the node that made it
  int output_nr = 0;
  std::shared_ptr<TensorImpl> leaf;    // leaf input that requires grad (parameter, pipeline input, ...)
  bool active() const { return producer || leaf; }
};

struct Node {
  std::string name;
  std::vector<Edge> edges;       // one per differentiable input, in the op's input order
  TensorList grad_outputs;       // accumulated gradients of this node's outputs
  std::vector<Shape> output_shapes;
  BackwardFn backward;
  // An input edge whose gradient the backward adds itself (-1: none). The tape then takes the
  // gradient that input has gathered so far out of its producer's slot (from its other
  // consumers), or for a leaf its .grad when that handle alone holds it (earlier contributions,
  // earlier backward passes included; not under Tape::grad), and passes it after the output
  // gradients (undefined when there is none), and the backward returns the sum for that edge,
  // which a leaf then keeps as its .grad: a kernel that can add it in the same pass (LayerNorm's,
  // through residual_layernorm_backward's dr; the embedding's scatter-add, over the tied head's
  // weight gradient) saves the tape's separate add and a zero-filled buffer.
  int absorb_edge = -1;
  void release() { backward = nullptr; }
};

class Tape {
 public:
  Tape() = default;
  Tape(const Tape&) = delete;
  Tape& operator=(const Tape&) = delete;
  ~Tape();

  void record(std::shared_ptr<Node> node) { nodes_.push_back(std::move(node)); }
  size_t size() const { return nodes_.size(); }
  bool empty() const { return nodes_.empty(); }

  // d(loss)/d(leaves): gradients accumulate (+=) into each leaf's .grad, whose grad-ready hooks
  // fire as soon as the leaf's last consumer on this tape has run. The tape is consumed.
  void backward(const Tensor& loss);
  void backward(const TensorList& outputs, const TensorList& grad_outputs);
  // Like torch.autograd.grad: returns d(outputs)/d(wrt) without touching any .grad. wrt may hold
  // leaves and tensors recorded on this tape, a tensor more than once; one the outputs do not
  // depend on (or that requires no grad) gets an undefined gradient (PyTorch's allow_unused=True).
  // For both: an undefined grad_output counts as zero. A gradient that reaches a tensor recorded
  // on another tape waits in that tape until it is walked; a tape already walked or destroyed
  // cannot carry it on, and backward says so.
  TensorList grad(const TensorList& outputs, const TensorList& grad_outputs, const TensorList& wrt);
  void clear();
  // The leaves (tensors that require grad and have no grad_fn) the recorded nodes take as inputs,
  // each once, in first-use order.
  TensorList leaves() const;

 private:
  void run(const TensorList& outputs, const TensorList& grad_outputs, const TensorList* wrt, TensorList* wrt_grads);
  std::vector<std::shared_ptr<Node>> nodes_;
};

// Makes a tape the one ops record on, for this thread, while the guard lives.
class TapeScope {
 public:
  explicit TapeScope(Tape& t);
  ~TapeScope();
  TapeScope(const TapeScope&) = delete;
  TapeScope& operator=(const TapeScope&) = delete;

 private:
  Tape* prev_;
};
Tape* active_tape();

// Sets whether ops record on this thread while it lives (nested guards restore the previous mode).
class GradModeGuard {
 public:
  explicit GradModeGuard(bool enabled);
  ~GradModeGuard();
  GradModeGuard(const GradModeGuard&) = delete;
  GradModeGuard& operator=(const GradModeGuard&) = delete;

 private:
  bool prev_;
};
struct NoGradGuard : GradModeGuard {
  NoGradGuard() : GradModeGuard(false) {}
};
bool grad_enabled();

// True when an op on these inputs must be recorded.
bool needs_grad(const TensorList& inputs);
// Records a node for outputs computed from inputs; outputs get grad_fn set. Inputs that do not
// require grad get inactive edges (their gradient is never computed).
// absorb_edge: see Node::absorb_edge.
void record(const std::string& name, const TensorList& inputs, const TensorList& outputs, BackwardFn backward,
            int absorb_edge = -1);

// A handle on the same bytes without autograd history (what nodes save).
Tensor detach(const Tensor& t);

// Whether t is the only handle on its bytes: one Tensor object, not a view, its storage held by no
// other tensor, not a parameter. The tape keeps such a gradient as a leaf's .grad instead of
// copying it (a backward that returns one gradient for two inputs fails the test), and a backward
// may overwrite a saved tensor that passes it (no one else can read those bytes again).
bool sole_owner(const Tensor& t);

// Whether g is the 1 that backward(loss) seeds the loss with, as it is (not a caller's
// grad_output, nor anything computed from one). A node whose forward already applied its backward
// for an upstream 1 (the fused classifier) hands its result on unscaled when it gets this.
bool is_unit_seed(const Tensor& g);

}  // namespace sg::autograd

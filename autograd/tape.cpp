#include "autograd/tape.h"

#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "autograd/ops.h"
#include "core/error.h"

namespace sg::autograd {

static thread_local Tape* t_tape = nullptr;
static thread_local bool t_grad_enabled = true;

TapeScope::TapeScope(Tape& t) : prev_(t_tape) { t_tape = &t; }
TapeScope::~TapeScope() { t_tape = prev_; }
Tape* active_tape() { return t_tape; }

GradModeGuard::GradModeGuard(bool enabled) : prev_(t_grad_enabled) { t_grad_enabled = enabled; }
GradModeGuard::~GradModeGuard() { t_grad_enabled = prev_; }
bool grad_enabled() { return t_grad_enabled; }

bool needs_grad(const TensorList& inputs) {
  if (!t_grad_enabled || !t_tape) return false;
  for (const auto& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

Tensor detach(const Tensor& t) {
  if (!t.defined()) return t;
  return t.with_layout(t.layout());
}

void record(const std::string& name, const TensorList& inputs, const TensorList& outputs, BackwardFn backward,
            int absorb_edge) {
  SG_CHECK(absorb_edge < int(inputs.size()), "internal: node '", name, "' absorbs input ", absorb_edge, " of ",
           inputs.size());
  auto node = std::make_shared<Node>();
  node->name = name;
  node->backward = std::move(backward);
  node->absorb_edge = absorb_edge;
  for (const auto& in : inputs) {
    Edge e;
    if (in.defined() && in.requires_grad()) {
      if (in.grad_fn()) {
        e.producer = in.grad_fn();
        e.output_nr = in.output_nr();
      } else {
        e.leaf = in.impl_ptr();
      }
    }
    node->edges.push_back(std::move(e));
  }
  node->grad_outputs.resize(outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) {
    TensorImpl* o = outputs[i].impl();
    o->requires_grad = true;
    o->grad_fn = node;
    o->output_nr = int(i);
    node->output_shapes.push_back(outputs[i].shape());
  }
  t_tape->record(std::move(node));
}

Tape::~Tape() { clear(); }

TensorList Tape::leaves() const {
  TensorList out;
  std::unordered_set<const TensorImpl*> seen;
  for (const auto& n : nodes_)
    for (const Edge& e : n->edges)
      if (e.leaf && seen.insert(e.leaf.get()).second) out.emplace_back(e.leaf);
  return out;
}

void Tape::clear() {
  for (auto& n : nodes_) n->release();
  nodes_.clear();
}

bool sole_owner(const Tensor& g) {
  return g.impl_ptr().use_count() == 1 && g.storage().use_count() == 1 && g.offset() == 0 && g.is_contiguous() &&
         g.nbytes() == g.storage()->nbytes() && g.storage()->category() != MemCategory::param;
}

namespace {
thread_local const TensorImpl* t_unit_seed = nullptr;  // the seed of this thread's backward(loss)

void accumulate(Tensor& slot, const Tensor& g) {
  if (!g.defined()) return;
  slot = slot.defined() ? sg::add(slot, g) : g;
}
}  // namespace

bool is_unit_seed(const Tensor& g) { return g.defined() && g.impl() == t_unit_seed; }

void Tape::backward(const Tensor& loss) {
  SG_CHECK(loss.numel() == 1, "backward: loss must have one element, got ", loss.describe(),
           " (pass grad_outputs for a non-scalar output)");
  NoGradGuard ng;
  const Tensor seed = sg::ones_like(loss);
  struct Seed {  // set for this run only, however it ends (runs do not nest on a thread)
    explicit Seed(const TensorImpl* s) { t_unit_seed = s; }
    ~Seed() { t_unit_seed = nullptr; }
  } scope(seed.impl());
  run({loss}, {seed}, nullptr, nullptr);
}

void Tape::backward(const TensorList& outputs, const TensorList& grad_outputs) {
  run(outputs, grad_outputs, nullptr, nullptr);
}

TensorList Tape::grad(const TensorList& outputs, const TensorList& grad_outputs, const TensorList& wrt) {
  TensorList out(wrt.size());
  run(outputs, grad_outputs, &wrt, &out);
  return out;
}

void Tape::run(const TensorList& outputs, const TensorList& grad_outputs, const TensorList* wrt,
               TensorList* wrt_grads) {
  SG_CHECK(outputs.size() == grad_outputs.size(), "backward: ", outputs.size(), " outputs but ",
           grad_outputs.size(), " grad_outputs");
  NoGradGuard no_grad;  // backward itself is never recorded
  std::unordered_map<Node*, size_t> position;
  for (size_t i = 0; i < nodes_.size(); ++i) position[nodes_[i].get()] = i;

  // Seed the outputs.
  std::vector<char> needed(nodes_.size(), 0);
  for (size_t i = 0; i < outputs.size(); ++i) {
    const Tensor& o = outputs[i];
    SG_CHECK(o.defined() && o.requires_grad(), "backward: output ", i, " does not require grad");
    const Tensor& g = grad_outputs[i];
    SG_CHECK(!g.defined() || g.shape() == o.shape(), "backward: grad_output ", i, " has shape ",
             shape_str(g.shape()), " but output has ", shape_str(o.shape()));
    if (!o.grad_fn()) continue;  // a leaf output: delivered below
    auto it = position.find(o.grad_fn().get());
    SG_CHECK(it != position.end() || o.grad_fn()->backward, "backward through '", o.grad_fn()->name,
             "' a second time: an earlier backward consumed its tape (record the forward again)");
    SG_CHECK(it != position.end(), "backward: output ", i, " was not recorded on this tape");
    needed[it->second] = 1;
    accumulate(o.grad_fn()->grad_outputs[size_t(o.output_nr())], g);
  }

  // Which nodes can receive a gradient (reverse record order is a topological order), and how
  // many of them consume each leaf: a leaf's gradient is final when that count reaches zero.
  std::unordered_map<TensorImpl*, int> pending;
  for (size_t i = nodes_.size(); i-- > 0;) {
    if (!needed[i]) continue;
    for (const Edge& e : nodes_[i]->edges) {
      if (e.producer) {
        auto it = position.find(e.producer.get());
        if (it != position.end()) needed[it->second] = 1;
      } else if (e.leaf) {
        ++pending[e.leaf.get()];
      }
    }
  }

  // grad(): where each wrt tensor's gradient is read. A leaf's as the tape delivers it; an
  // intermediate's from its node's output slot just before that node runs, when every consumer
  // has added to it. A tensor listed twice gets it twice.
  std::unordered_multimap<TensorImpl*, size_t> wrt_leaf;
  std::unordered_multimap<Node*, std::pair<int, size_t>> wrt_node;  // node -> (output, index in wrt)
  if (wrt)
    for (size_t i = 0; i < wrt->size(); ++i) {
      const Tensor& t = (*wrt)[i];
      if (!t.defined() || !t.requires_grad()) continue;  // no gradient: left undefined
      if (!t.grad_fn()) wrt_leaf.emplace(t.impl(), i);
      else wrt_node.emplace(t.grad_fn().get(), std::pair{t.output_nr(), i});
    }

  // The slot of an input's gradient in the node that made it. That node may be on another tape
  // that is still to be walked (the gradient waits there); one already walked or destroyed has
  // nothing left to carry it on.
  auto producer_slot = [](const Node& n, size_t k) -> Tensor& {
    const Edge& e = n.edges[k];
    SG_CHECK(e.producer->backward && size_t(e.output_nr) < e.producer->grad_outputs.size(), "backward: input ", k,
             " of '", n.name, "' was made by '", e.producer->name, "' on a tape that has already been walked ",
             "backward or destroyed, so its gradient cannot reach what that tape recorded (record the whole forward ",
             "on one tape, or walk that tape after this one)");
    return e.producer->grad_outputs[size_t(e.output_nr)];
  };

  auto deliver_leaf = [&](const std::shared_ptr<TensorImpl>& leaf, const Tensor& g) {
    if (wrt) {
      auto [first, last] = wrt_leaf.equal_range(leaf.get());
      for (auto it = first; it != last; ++it) accumulate((*wrt_grads)[it->second], g);
      return;
    }
    if (!g.defined()) return;
    Tensor& slot = leaf->grad;
    if (!slot.defined()) {
      if (sole_owner(g)) {  // nobody else can see g's bytes: keep them instead of copying
        g.storage()->recategorize(leaf->grad_category);
        slot = g;
      } else {
        MemScope scope(leaf->grad_category);
        slot = sg::clone(g);
      }
    } else {
      sg::add_(slot, g);
    }
  };

  for (size_t i = 0; i < outputs.size(); ++i)
    if (!outputs[i].grad_fn()) deliver_leaf(outputs[i].impl_ptr(), grad_outputs[i]);

  for (size_t i = nodes_.size(); i-- > 0;) {
    if (!needed[i]) continue;
    Node& n = *nodes_[i];
    if (wrt) {
      auto [first, last] = wrt_node.equal_range(&n);
      for (auto it = first; it != last; ++it)
        accumulate((*wrt_grads)[it->second.second], n.grad_outputs[size_t(it->second.first)]);
    }
    bool any = false;
    for (const auto& g : n.grad_outputs) any = any || g.defined();
    TensorList in_grads;
    bool absorbed = false;
    if (any) {
      SG_CHECK(n.backward, "backward through '", n.name, "' a second time (its saved tensors were released)");
      if (n.absorb_edge >= 0) {  // hand over what the input has gathered so far (moved: n alone holds it)
        const Edge& e = n.edges[size_t(n.absorb_edge)];
        Tensor pending;
        if (e.producer) pending = std::exchange(producer_slot(n, size_t(n.absorb_edge)), Tensor());
        else if (e.leaf && !wrt && e.leaf->grad.defined() && sole_owner(e.leaf->grad))
          pending = std::exchange(e.leaf->grad, Tensor());
        absorbed = pending.defined();
        n.grad_outputs.push_back(std::move(pending));
      }
      // Taken out of the node first: a gradient the node hands straight on (a view's, an add's) is
      // then held by in_grads alone, and a leaf can keep it instead of a copy.
      const TensorList outs = std::exchange(n.grad_outputs, TensorList());
      in_grads = n.backward(outs);
      SG_CHECK(!absorbed || (size_t(n.absorb_edge) < in_grads.size() && in_grads[size_t(n.absorb_edge)].defined()),
               "internal: node '", n.name, "' dropped the gradient it was handed for input ", n.absorb_edge);
      SG_CHECK(in_grads.size() == n.edges.size(), "internal: node '", n.name, "' returned ", in_grads.size(),
               " gradients for ", n.edges.size(), " inputs");
    }
    for (size_t k = 0; k < n.edges.size(); ++k) {
      const Edge& e = n.edges[k];
      const Tensor g = any ? std::move(in_grads[k]) : Tensor();  // moved: g alone may own it
      if (e.producer) {
        if (g.defined()) accumulate(producer_slot(n, k), g);
      } else if (e.leaf) {
        if (absorbed && int(k) == n.absorb_edge) {  // the sum with the leaf's own .grad, which n took
          if (g.storage()->category() != e.leaf->grad_category) g.storage()->recategorize(e.leaf->grad_category);
          e.leaf->grad = g;
        } else {
          deliver_leaf(e.leaf, g);
        }
        if (--pending[e.leaf.get()] == 0 && !wrt && e.leaf->grad.defined()) {
          Tensor leaf(e.leaf);
          for (auto& hook : e.leaf->grad_ready_hooks) hook(leaf);
        }
      }
    }
    n.grad_outputs.clear();
    n.release();
  }
  clear();
}

}  // namespace sg::autograd

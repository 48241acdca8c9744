#include "parallel/pp/executor.h"

#include <algorithm>
#include <chrono>
#include <map>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "core/trace.h"
#include "parallel/tp/layers.h"

namespace sg::parallel::pp {

namespace {
bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }
}  // namespace

bool holds_parameter(const Schedule& schedule, int rank, const std::string& name, int64_t n_layer) {
  const int S = schedule.stages();
  auto holds = [&](int stage) { return schedule.rank_of(stage) == rank; };
  if (name == "wte.weight") return holds(0) || holds(S - 1);
  if (starts_with(name, "wpe.")) return holds(0);
  if (starts_with(name, "ln_f.")) return holds(S - 1);
  SG_CHECK(starts_with(name, "h.") && n_layer % S == 0, "pipeline: parameter '", name, "' is not one of a GPT's ",
           n_layer, " blocks split into ", S, " stages");
  const int64_t layer = std::stoll(name.substr(2, name.find('.', 2) - 2));  // "h.<i>."
  return holds(int(layer / (n_layer / S)));
}

PipelineExecutor::PipelineExecutor(nn::GPT& model, Schedule schedule, std::shared_ptr<comm::ProcessGroup> pp_group)
    : model_(model), schedule_(std::move(schedule)), group_(std::move(pp_group)) {
  SG_CHECK(group_->size() == schedule_.ranks, "pipeline: the schedule has ", schedule_.ranks, " ranks, the group ",
           group_->size());
  SG_CHECK(schedule_.ranks > 1 || schedule_.chunks == 1, "pipeline: ", schedule_.name, " with ", schedule_.chunks,
           " chunks on one rank would send its activations to itself: give it one chunk (or several ranks)");
  // Every rank runs the same schedule: a mismatch would pair sends and receives of different
  // micro-batches (truncated messages, or a silent deadlock). One small all-gather, once.
  {
    const int64_t kind = schedule_.name == "gpipe" ? 0 : schedule_.name == "1f1b" ? 1 : 2;
    const std::vector<int64_t> mine = {kind, schedule_.ranks, schedule_.micro_batches, schedule_.chunks,
                                       model_.config.n_layer};
    const auto all = group_->gather_uncounted(mine);
    for (size_t q = 0; q < all.size(); ++q)
      SG_CHECK(all[q] == mine, "pipeline: rank ", q, " of the pipeline group runs another schedule (kind, p, m, v, ",
               "layers = ", shape_str(all[q]), ") than this rank (", schedule_.name, ", ", shape_str(mine), ")");
  }
  const int S = schedule_.stages();
  SG_CHECK(model_.config.n_layer % S == 0, "--pp: ", model_.config.n_layer, " layers cannot be split into ", S,
           " stages evenly");
  for (auto& [name, p] : model_.named_parameters()) {
    if (holds_parameter(schedule_, group_->rank(), name, model_.config.n_layer)) {
      owned_.emplace_back(name, p);
    } else {
      // Not ours: drop the storage so the ledger holds only this rank's share; any use fails loudly.
      p.impl()->storage = std::make_shared<Storage>(0, p.device(), MemCategory::param);
      p.impl()->layout = Layout{{0}, {1}, 0};
    }
  }
}

// Message tags: one per (micro-batch, stage boundary) and direction, wrapped below the backend's
// largest tag (the largest itself is the tied embedding's), the direction kept apart by the low
// bit. Tags may repeat after the wrap: between two ranks, each direction's messages are sent and
// received in the same order (the k-th forward of a stage's rank feeds the k-th forward of the
// next stage's, and so for the backwards), and MPI's messages with one tag do not overtake.
int PipelineExecutor::tag(int stage, int micro, bool grad) const {
  const int64_t boundaries = std::max(1, group_->max_tag() / 2);
  return int(((int64_t(micro) * schedule_.stages() + stage) % boundaries) * 2 + (grad ? 1 : 0));
}

int PipelineExecutor::blocks_per_stage() const { return int(model_.config.n_layer) / schedule_.stages(); }

Tensor PipelineExecutor::stage_forward(int s, const Tensor& input, const Tensor& targets, double scale) {
  const int L = blocks_per_stage(), S = schedule_.stages();
  Tensor x = s == 0 ? model_.embed(input) : input;
  for (int b = s * L; b < (s + 1) * L; ++b) x = model_.h[size_t(b)]->forward(x, model_.recompute);
  if (s != S - 1) return x;
  if (!targets.defined()) return model_.head(x);
  return model_.loss_from_logits(model_.head(x), targets, true, scale);
}

Tensor PipelineExecutor::receive_input(int stage, int micro, const Tensor& idx, int64_t rows) {
  // Under sequence parallelism the activations between stages are this tp rank's T/tp positions.
  const int64_t T = model_.config.sequence_parallel ? idx.size(1) / model_.config.tp : idx.size(1);
  Tensor input = empty({rows, T, model_.config.n_embd}, model_.wpe->weight.dtype(), idx.device());
  group_->recv(input, schedule_.rank_of(stage - 1), tag(stage, micro, false))->wait();
  return input;
}

Tensor PipelineExecutor::receive_output_grad(const Tensor& output, int stage, int micro) {
  Tensor g = empty(output.shape(), output.dtype(), output.device());
  group_->recv(g, schedule_.rank_of(stage + 1), tag(stage + 1, micro, true))->wait();
  return g;
}

Tensor PipelineExecutor::forward(const Tensor& idx, const Tensor& targets, double scale) {
  const int S = schedule_.stages(), last = schedule_.rank_of(S - 1);
  // Stages in order: a rank waits only on a lower stage, which the rank holding it runs before any
  // higher one, so the chain never deadlocks (with several stages per rank, too).
  std::vector<std::pair<std::shared_ptr<comm::Work>, Tensor>> sends;
  Tensor result;
  for (int s = 0; s < S; ++s) {
    if (!holds_stage(s)) continue;
    const Tensor input = s == 0 ? idx : receive_input(s, 0, idx, idx.size(0));
    if (before_forward) before_forward(s);
    Tensor out = stage_forward(s, input, targets, scale);
    if (s == S - 1) result = to(out, DType::f32);
    else sends.emplace_back(group_->send(out, schedule_.rank_of(s + 1), tag(s + 1, 0, false)), out);
  }
  for (auto& [w, t] : sends) w->wait();
  // The last stage's result to every rank of the pipeline: its shape first, then the values.
  std::vector<int64_t> header(5, 0);  // rank, then up to 4 sizes
  if (group_->rank() == last) {
    header[0] = result.dim();
    for (int64_t d = 0; d < result.dim(); ++d) header[size_t(d + 1)] = result.size(d);
  }
  Tensor shape = from_vector<int64_t>(header, {5});
  group_->broadcast(shape, last)->wait();
  if (group_->rank() != last) {
    const int64_t* h = shape.data<int64_t>();
    result = empty(Shape(h + 1, h + 1 + h[0]), DType::f32, idx.device());
  }
  group_->broadcast(result, last)->wait();
  return result;
}

double PipelineExecutor::run(const Tensor& idx, const Tensor& targets, double scale) {
  const int m = schedule_.micro_batches, S = schedule_.stages(), rank = group_->rank();
  SG_CHECK(idx.size(0) % m == 0, "pipeline: ", idx.size(0), " rows do not split into ", m, " micro-batches");
  const int64_t rows = idx.size(0) / m;
  struct InFlight {
    std::unique_ptr<autograd::Tape> tape;
    Tensor input, output;
  };
  std::map<std::pair<int, int>, InFlight> live;  // (stage, micro)
  // Sends in flight, with the tensors they read (kept alive until the send completes).
  std::vector<std::pair<std::shared_ptr<comm::Work>, Tensor>> sends;
  std::vector<Tensor> losses;  // the last stage's, one per micro-batch
  timeline_ = Timeline{};
  timeline_.per_rank.resize(size_t(schedule_.ranks));
  const auto t0 = std::chrono::steady_clock::now();
  auto now = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  // Dropout's place: the caller's first row of these rows, moved to each action's micro-batch.
  DropoutPlace& place = dropout_generator().place;
  const int64_t first_row = place.row0;
  for (const Action& a : schedule_.per_rank[size_t(rank)]) {
    Tensor mi = narrow(idx, 0, a.micro * rows, rows), mt = narrow(targets, 0, a.micro * rows, rows);
    if (before_action)
      before_action(a.stage * blocks_per_stage(), (a.stage + 1) * blocks_per_stage() - 1, a.phase == Phase::forward);
    // What the action needs from another stage is received before its clock starts: the wait is
    // the bubble, and counting it as the action's work would hide it.
    Tensor received;
    auto it = live.end();
    if (a.phase == Phase::forward && a.stage > 0) {
      received = receive_input(a.stage, a.micro, idx, rows);
    } else if (a.phase == Phase::backward) {
      it = live.find({a.stage, a.micro});
      SG_CHECK(it != live.end(), "pipeline: backward of stage ", a.stage, " micro-batch ", a.micro, " before its forward");
      if (a.stage < S - 1) received = receive_output_grad(it->second.output, a.stage, a.micro);
    }
    const double start = now();
    trace::Scope ts(a.phase == Phase::forward ? "F" : "B", "pipeline", {{"stage", a.stage}, {"micro", a.micro}});
    place.row0 = first_row + a.micro * rows;
    if (a.phase == Phase::forward) {
      InFlight f;
      f.tape = std::make_unique<autograd::Tape>();
      if (a.stage == 0) {
        f.input = mi;
      } else {
        f.input = received;
        f.input.set_requires_grad(true);  // a leaf: its .grad is what goes back upstream
        // An activation's gradient, not a parameter's: charged as one from its delivery on.
        f.input.impl()->grad_category = MemCategory::activation;
      }
      {
        autograd::TapeScope scope(*f.tape);
        if (before_forward) before_forward(a.stage);
        f.output = stage_forward(a.stage, f.input, mt, scale);
      }
      if (a.stage == S - 1) losses.push_back(autograd::detach(f.output));  // read after the schedule: no sync here
      else sends.emplace_back(group_->send(f.output, schedule_.rank_of(a.stage + 1), tag(a.stage + 1, a.micro, false)), f.output);
      live[{a.stage, a.micro}] = std::move(f);
    } else {
      InFlight& f = it->second;
      if (a.stage == S - 1) f.tape->backward(f.output);
      else f.tape->backward({f.output}, {received});
      if (a.stage > 0) {
        const Tensor dx = f.input.grad();
        sends.emplace_back(group_->send(dx, schedule_.rank_of(a.stage - 1), tag(a.stage, a.micro, true)), dx);
      }
      live.erase(it);  // the stage's activations for this micro-batch go now
    }
    timeline_.per_rank[size_t(rank)].push_back({a, start, now()});
    // Completed sends give their tensors back now, not at the step's end: kept, they would hold
    // every micro-batch's output and input gradient, m deep under 1F1B as under GPipe.
    std::erase_if(sends, [](auto& s) {
      if (!s.first->test()) return false;
      s.first->wait();  // done: returns at once, or rethrows the send's error
      return true;
    });
    // After each action (bench's memory-over-time chart): the schedule's activations in flight,
    // m micro-batches' deep under GPipe, at most the stages' under 1F1B.
    trace::memory(idx.device());
  }
  place.row0 = first_row;
  for (auto& [w, t] : sends) w->wait();
  timeline_.makespan = now();
  // Every rank reports the pipeline's loss (only the last stage computed it).
  double loss = 0;
  for (const Tensor& t : losses) loss += item(t);
  Tensor l = from_vector<double>({loss}, {1});
  group_->all_reduce(l, comm::ReduceOp::sum)->wait();
  return item(l);
}

int PipelineExecutor::tied_peer() const {
  const int first = schedule_.rank_of(0), last = schedule_.rank_of(schedule_.stages() - 1);
  if (first == last) return -1;  // both uses on one rank: already one gradient
  const int rank = group_->rank();
  return rank == first ? last : rank == last ? first : -1;
}

Tensor PipelineExecutor::add_peer(const Tensor& t, int peer) {
  Tensor other = empty(t.shape(), t.dtype(), t.device());
  const int tied_tag = group_->max_tag();  // above every activation tag
  auto s = group_->send(t, peer, tied_tag);
  group_->recv(other, peer, tied_tag)->wait();
  s->wait();
  return add(t, other);
}

void PipelineExecutor::reduce_tied_embedding() {
  const int peer = tied_peer();
  if (peer < 0) return;
  const Tensor& w = model_.wte ? model_.wte->weight : model_.tp_wte->weight;  // this tp rank's rows
  Tensor g = w.grad();
  if (!g.defined()) g = zeros_like(w);
  w.set_grad(add_peer(g, peer));
}

void PipelineExecutor::sum_tied(const Tensor& t) {
  const int peer = tied_peer();
  if (peer < 0) return;
  SG_CHECK(t.defined(), "pipeline: rank ", group_->rank(), " holds the tied embedding but has no tensor to sum");
  autograd::NoGradGuard ng;
  copy_(t, add_peer(t, peer));
}

double PipelineExecutor::grad_sum_squares() const {
  std::vector<Tensor> grads;
  const bool first = holds_stage(0);
  for (const auto& [name, p] : owned_)
    if (name != "wte.weight" || first) grads.push_back(p.grad());  // wte counted once, on the first stage
  return sum_squares(grads);
}

}  // namespace sg::parallel::pp

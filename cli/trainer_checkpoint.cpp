// The trainer's checkpoints: what --resume inherits from the run it continues, the model config a
// checkpoint records, and this rank's pieces of the training state (parallel/sharded_checkpoint.h),
// written and read back whatever the layout that saved them.
#include <cstdio>
#include <cstdlib>
#include <set>

#include "autograd/tape.h"
#include "cli/trainer.h"
#include "parallel/checkpoint.h"
#include "parallel/sharded_checkpoint.h"
#include "parallel/tp/layers.h"

namespace sg::cli {

using nlohmann::json;

namespace {

// The flags that say what a run trains on and how it learns (not where or on what layout). A
// checkpoint records those its run was given; `--resume` takes them where the command line does
// not give them, so `train --resume DIR --steps N` goes on with the run's own data, batch,
// schedule, optimizer and seed. A flag on the command line still wins (other data, a longer run).
const char* const kRunFlags[] = {"data",  "shuffle",      "seq-len",      "dropout", "batch-size", "steps",
                                 "lr",    "lr-schedule",  "decay-steps", "warmup-steps", "min-lr",  "beta1",      "beta2",
                                 "eps",   "weight-decay", "clip",         "seed",    "dtype",      "eval-every",
                                 "eval-batches", "eval-problems", "on-nonfinite", "initial-loss-scale",
                                 "loss-scale-window", "loss-scale-growth", "loss-scale-backoff", "min-loss-scale",
                                 "loss-scale",   "sample-tokens", "tokenizer",
                                 "hellaswag", "hellaswag-examples"};

// What a checkpoint records of the model (config_from_metadata reads it back).
// The padding only where one was given (an --init-from file's): the default follows the layout
// that resumes (nn::padded_vocab_rows), and the checkpoint holds the real rows only.
std::map<std::string, std::string> config_metadata(const nn::GPTConfig& c, const std::string& data) {
  std::map<std::string, std::string> m = {{"format", "shardgrad-gpt2"},
                                          {"n_layer", std::to_string(c.n_layer)},
                                          {"n_head", std::to_string(c.n_head)},
                                          {"n_embd", std::to_string(c.n_embd)},
                                          {"block_size", std::to_string(c.block_size)},
                                          {"vocab_size", std::to_string(c.vocab_size)},
                                          {"data", data}};
  if (c.padded_vocab > 0) m["padded_vocab"] = std::to_string(c.padded_vocab);
  return m;
}

}  // namespace

nn::GPTConfig config_from_metadata(const std::map<std::string, std::string>& m, const std::string& where) {
  auto get = [&](const char* k) -> int64_t {
    auto it = m.find(k);
    SG_CHECK(it != m.end(), "train: checkpoint ", where, " does not record '", k, "' in its metadata");
    try {
      return std::stoll(it->second);
    } catch (const std::exception&) {
      throw Error(str("train: checkpoint ", where, ": metadata '", k, "' is not a number: '", it->second, "'"));
    }
  };
  nn::GPTConfig c;
  c.name = "checkpoint";
  c.n_layer = get("n_layer");
  c.n_head = get("n_head");
  c.n_embd = get("n_embd");
  c.block_size = get("block_size");
  c.vocab_size = get("vocab_size");
  if (m.count("padded_vocab")) c.padded_vocab = get("padded_vocab");
  try {
    c.validate();
  } catch (const Error& e) {
    throw Error(str("train: checkpoint ", where, ": its metadata describe no valid model: ", e.what()));
  }
  return c;
}

void refuse_unknown_tensors(const ckpt::Checkpoint& ck, const nn::GPTConfig& c) {
  const std::vector<std::string> names = nn::gpt_parameter_names(c);
  const std::set<std::string> params(names.begin(), names.end());
  std::vector<std::string> unknown;
  for (const std::string& n : ck.names()) {
    // optimizer state is "<param>.<one word>" (ckpt::is_optimizer_state knows the words)
    const bool known = params.count(n) || (ckpt::is_optimizer_state(n) && params.count(n.substr(0, n.rfind('.'))));
    if (!known) unknown.push_back(n);
  }
  if (unknown.empty()) return;
  std::string listed;
  for (size_t i = 0; i < unknown.size() && i < 5; ++i) listed.append(i ? ", '" : "'").append(unknown[i]).append("'");
  if (unknown.size() > 5) listed.append(str(" and ", unknown.size() - 5, " more"));
  throw Error(str("train: checkpoint ", ck.path(), " holds ", unknown.size(), " tensor", unknown.size() > 1 ? "s" : "",
                  " that a GPT-2 of ", c.n_layer, " layer", c.n_layer > 1 ? "s" : "",
                  " and its optimizer state do not: ", listed,
                  "; it was not written by this model, and resuming would drop them"));
}

bool first_launched_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "RANK"})
    if (const char* r = std::getenv(name); r && *r) return std::atoi(r) == 0;
  return true;
}

std::unique_ptr<ckpt::Checkpoint> resume_checkpoint(const Args& a) {
  // Every rank opens the checkpoint before the world is joined; one names the steps passed over.
  const bool report = first_launched_rank();
  if (a.str("resume") == "auto") {
    SG_CHECK(!a.str("save").empty(), "train: --resume auto needs --save (the run directory to look in)");
    // A run that failed before its first save (or during it) leaves no step directory: step 0.
    return ckpt::step_dirs(a.str("save")).empty() ? nullptr : ckpt::open_checkpoint("auto:" + a.str("save"), report);
  }
  return a.str("resume").empty() ? nullptr : ckpt::open_checkpoint(a.str("resume"), report);
}

void inherit_run_flags(Args& a, const ckpt::Checkpoint* ck) {
  if (!ck || !ck->state().contains("train_flags")) return;  // older checkpoints recorded none
  const json& saved = ck->state()["train_flags"];
  SG_CHECK(saved.is_object(), "train: checkpoint ", ck->path(), ": its training state is malformed: train_flags is ",
           "not an object");
  for (const char* f : kRunFlags) {
    if (a.given(f) || !saved.contains(f)) continue;
    SG_CHECK(saved[f].is_string(), "train: checkpoint ", ck->path(), ": its training state is malformed: train_flags.",
             f, " is ", saved[f].dump(), ", not a string");
    a.inherit(f, saved[f].get<std::string>());
  }
}

// This rank's share of the training state as pieces of global tensors. Replicated copies are
// written once: parameters (and, without ZeRO, optimizer state) by the first data-parallel
// replica; tp-replicated tensors by tp rank 0; the tied embedding by the first pipeline stage.
std::vector<ckpt::Piece> Trainer::state_pieces() const {
  auto base_of = [](const std::string& n) {
    for (const char* suf : {".exp_avg_sq", ".exp_avg", ".master"}) {
      const std::string x(suf);
      if (n.size() > x.size() && n.compare(n.size() - x.size(), x.size(), x) == 0) return n.substr(0, n.size() - x.size());
    }
    return n;
  };
  auto unique_here = [&](const std::string& name) {
    const std::string base = base_of(name);
    if (pipe_ && base == "wte.weight" && !pipe_->holds_stage(0)) return false;
    if (tp_ > 1 && parallel::tp::gpt_param_split(base).replicated() && groups_.tp->rank() != 0) return false;
    return true;
  };
  std::vector<ckpt::Piece> out;
  auto add = [&](std::vector<ckpt::Piece> ps) {
    for (auto& p : ps)
      if (unique_here(p.name)) out.push_back(std::move(p));
  };
  if (fsdp_) {
    add(fsdp_->state_pieces());
    return out;
  }
  const auto params = held_parameters();
  if (dp_rank_ == 0)
    for (const auto& [n, p] : params) add(ckpt::pieces_of(view_of(n, p.shape()), p));
  if (zero_) {
    add(zero_->state_pieces([this](const std::string& n, const Shape& sh) { return view_of(n, sh); }));
  } else if (dp_rank_ == 0) {
    for (const auto& [n, t] : opt_->state()) {
      const std::string base = base_of(n);
      add(ckpt::pieces_of(ckpt::renamed(view_of(base, t.shape()), n), t));
    }
    if (dtype_ != DType::f32)
      for (const auto& [n, m] : master_) add(ckpt::pieces_of(ckpt::renamed(view_of(n, m.shape()), n + ".master"), m));
  }
  return out;
}

ckpt::LocalView Trainer::view_of(const std::string& name, const Shape& local_shape) const {
  return ckpt::gpt_param_view(name, local_shape, cfg_.vocab_size, tp_ > 1 ? groups_.tp->rank() : 0, tp_);
}

void Trainer::load_parameters(const ckpt::Checkpoint& ck) {
  autograd::NoGradGuard ng;
  for (auto& [n, p] : model_->named_parameters()) {
    if (p.device() == staging_device()) continue;  // another pipeline stage's: never materialised here
    // An f32 run resumed from a bf16/f16 one goes on from the saved f32 masters, not from their
    // rounded copies (a half-precision run reads its masters in load_optimizer).
    const bool master = dtype_ == DType::f32 && ck.has(n + ".master");
    ckpt::read_local(ck, master ? ckpt::renamed(view_of(n, p.shape()), n + ".master") : view_of(n, p.shape()), p);
  }
}

void Trainer::load_optimizer(const ckpt::Checkpoint& ck, int64_t optimizer_step) {
  autograd::NoGradGuard ng;
  if (fsdp_) return fsdp_->load_state(ck, optimizer_step);
  if (zero_) return zero_->load_state(ck, optimizer_step, [this](const std::string& n, const Shape& sh) { return view_of(n, sh); });
  io::NamedTensors st;
  for (const auto& [n, m] : master_) {
    for (const char* suf : {".exp_avg", ".exp_avg_sq"}) {
      Tensor t = zeros(m.shape(), DType::f32, m.device());
      ckpt::read_local(ck, ckpt::renamed(view_of(n, m.shape()), n + suf), t);
      st.emplace_back(n + suf, t);
    }
    // f32 masters were saved exactly; a checkpoint without them (saved in f32) seeds them.
    if (dtype_ != DType::f32 && ck.has(n + ".master")) ckpt::read_local(ck, ckpt::renamed(view_of(n, m.shape()), n + ".master"), m);
    else if (dtype_ != DType::f32) ckpt::read_local(ck, view_of(n, m.shape()), m);
  }
  opt_->load_state(st, optimizer_step);
}

// Every rank writes its pieces; rank 0 commits the step directory (parallel/sharded_checkpoint.h).
void Trainer::save(int64_t next_step) {
  json s;
  s["step"] = next_step;
  s["optimizer_step"] = opt_ ? opt_->steps() : zero_ ? zero_->steps() : fsdp_->steps();
  s["train_position"] = train_->position();
  s["train_position_in_rows"] = true;  // row-drawing data: rows (before 2026-11-29: batches)
  s["dropout_stream"] = dropout_generator().next_stream;
  if (dtype_ == DType::f16) {  // the loss scaler's state: fp16's alone
    s["loss_scale"] = scaler_.scale;
    s["loss_scale_clean_steps"] = scaler_.clean_steps;
    s["skipped_steps"] = scaler_.skipped_steps;
  }
  s["nonfinite_skipped"] = nonfinite_skipped_;
  s["seed"] = seed_;
  s["dtype"] = dtype_name(dtype_);
  s["data"] = data_opt_.spec;
  s["argv"] = args_.argv_copy;
  json flags = json::object();
  for (const char* f : kRunFlags)
    if (args_.given(f))
      flags[f] = std::string(f) == "data" ? saved_data_spec()
                 : (std::string(f) == "tokenizer" || std::string(f) == "hellaswag") && !args_.str(f).empty()
                     ? std::filesystem::absolute(args_.str(f)).lexically_normal().string()  // from any folder
                     : args_.str(f);
  s["train_flags"] = flags;
  s["layout"] = {{"strategy", strategy_}, {"world", world_size_}, {"dp", dp_size_}, {"tp", tp_}, {"pp", pp_}};
  const std::vector<ckpt::Piece> mine = state_pieces();
  const auto meta = config_metadata(cfg_, saved_data_spec());
  const int keep = int(args_.i64("keep"));
  std::string where;
  // A rank blocked writing its files to a slow disk, and its peers waiting for it at the save's
  // barriers: --checkpoint-timeout's when given.
  parallel::watchdog::Patience patience(args_.f64("checkpoint-timeout"), "--checkpoint-timeout");
  if (metrics_) {
    where = ckpt::save_sharded(save_dir_, next_step, mine, s, meta, *metrics_, keep);
  } else {
    where = ckpt::save_sharded(save_dir_, next_step, mine, s, meta, 0, 1, [] {}, keep);
  }
  if (lead()) std::printf("saved checkpoint %s\n", where.c_str());
}

}  // namespace sg::cli

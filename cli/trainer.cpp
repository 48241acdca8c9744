// The trainer's loop (cli/trainer.h): one line per step, evaluations, checkpoints, and one training
// step under any layout.
// One step: the loader's global batch -> micro-batches (gradient accumulation) -> forward/backward
// on a tape each -> global-norm clipping -> AdamW on f32 master weights -> progress line.
// ddp averages gradients over ranks; zero1/zero2 shard the optimizer state (and gradients) instead,
// and run AdamW on this rank's shard only (parallel/zero.h); zero3 shards the parameters too,
// gathering one unit (a block, or the root: embeddings and ln_f) at a time (parallel/fsdp.h).
#include <omp.h>
#include <signal.h>

#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "bench/report/step_metrics.h"
#include "bench/report/timeline_svg.h"
#include "cli/commands.h"
#include "cli/sampling.h"
#include "cli/trainer.h"
#include "core/trace.h"
#include "io/file.h"
#include "io/synthetic.h"
#include "kernels/ops.h"
#include "kernels/profile.h"
#include "parallel/functional.h"
#include "parallel/tp/layers.h"

namespace sg::cli {

using nlohmann::json;

std::string human_bytes(int64_t b) {
  char buf[32];
  if (b >= (int64_t(1) << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", double(b) / double(int64_t(1) << 30));
  else if (b >= (1 << 20) || b == 0) std::snprintf(buf, sizeof buf, "%.1f MiB", double(b) / double(1 << 20));
  else if (b >= 1024) std::snprintf(buf, sizeof buf, "%.1f KiB", double(b) / 1024.0);
  else std::snprintf(buf, sizeof buf, "%lld B", (long long)b);
  return buf;
}


json ledger_json(Device d) {
  MemStats s = Ledger::global().stats(d);
  json j;
  for (int c = 0; c < kNumMemCategories; ++c)
    j[mem_category_name(MemCategory(c))] = {{"current", s.current[size_t(c)]}, {"peak", s.peak[size_t(c)]}};
  j["total"] = {{"current", s.total_current}, {"peak", s.total_peak}};
  return j;
}

namespace {

// text on one line, as a C string literal would write it: \n, \t, \", \\ and \xNN for other control bytes.
std::string escaped(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '"' || c == '\\') out += {'\\', char(c)};
    else if (c < 0x20 || c == 0x7f) out += str("\\x", "0123456789abcdef"[c >> 4], "0123456789abcdef"[c & 15]);
    else out += char(c);
  }
  return out;
}

// The lowest and highest of the ranks' peak ledger bytes ("2.9-4.0 MiB"; one figure when equal).
std::string peak_range(const json& ranks) {
  int64_t lo = INT64_MAX, hi = 0;
  for (const auto& r : ranks) {
    const int64_t p = r["mem"]["total"]["peak"].get<int64_t>();
    lo = std::min(lo, p), hi = std::max(hi, p);
  }
  const std::string a = human_bytes(lo), b = human_bytes(hi);
  if (a == b) return b;
  const size_t unit_a = a.rfind(' '), unit_b = b.rfind(' ');
  return a.substr(unit_a) == b.substr(unit_b) ? a.substr(0, unit_a) + "-" + b : a + "-" + b;
}

// --profile-ops: the step's op-table calls by entry, the costliest first (device time on a GPU,
// host time on the CPU), and what the step spent outside the table.
void print_op_profile(const std::map<std::string, kernels::OpTime>& ops, double step_ms, int64_t step, Device d) {
  const bool gpu = d.is_cuda();
  std::vector<std::pair<std::string, kernels::OpTime>> rows(ops.begin(), ops.end());
  const auto cost = [&](const kernels::OpTime& o) { return gpu ? o.device_ms : o.host_ms; };
  std::sort(rows.begin(), rows.end(), [&](const auto& x, const auto& y) { return cost(x.second) > cost(y.second); });
  kernels::OpTime all;
  for (const auto& [name, o] : rows) {
    all.calls += o.calls;
    all.host_ms += o.host_ms;
    all.device_ms += o.device_ms;
    all.flops += o.flops;
  }
  std::printf("op profile, step %lld on %s: %.2f ms (%s)\n", (long long)step, d.str().c_str(), step_ms,
              gpu ? "device ms: the compute stream between events queued around each call"
                  : "host ms: wall time in each call");
  std::printf("  %-28s %7s %10s%s %7s %9s\n", "entry", "calls", "host ms", gpu ? " device ms" : "", "share",
              gpu ? "TFLOP/s" : "GFLOP/s");
  const auto line = [&](const std::string& name, const kernels::OpTime& o) {
    std::printf("  %-28s %7lld %10.3f", name.c_str(), (long long)o.calls, o.host_ms);
    if (gpu) std::printf(" %9.3f", o.device_ms);
    std::printf(" %6.1f%%", step_ms > 0 ? 100.0 * cost(o) / step_ms : 0.0);
    if (o.flops > 0 && cost(o) > 0) std::printf(" %9.1f", o.flops / (cost(o) * (gpu ? 1e9 : 1e6)));
    std::printf("\n");
  };
  for (const auto& [name, o] : rows) line(name, o);
  line("all entries", all);
  std::printf("  %-28s %7s %10.3f%s %6.1f%%\n", "outside the op table", "", step_ms - cost(all), gpu ? "          " : "",
              step_ms > 0 ? 100.0 * (step_ms - cost(all)) / step_ms : 0.0);
}

// A stop asked for by a signal (with --save): the first SIGUSR1, SIGTERM or SIGINT (Ctrl-C) is
// recorded and the run stops after the step it is in, saving it; a second one ends the process at
// once, as the signal would have without us. SA_RESTART: reads, writes and MPI's waits go on
// undisturbed. A SIGINT ignored from the start (a background job of a shell, nohup) stays ignored.
volatile std::sig_atomic_t stop_signal = 0;

extern "C" void on_stop_signal(int sig) {
  if (stop_signal) {
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  stop_signal = sig;
}

struct StopSignals {
  struct sigaction old_usr1 {}, old_term {}, old_int {};
  StopSignals() {
    stop_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sa.sa_flags = SA_RESTART;
    ::sigemptyset(&sa.sa_mask);
    ::sigaction(SIGUSR1, &sa, &old_usr1);
    ::sigaction(SIGTERM, &sa, &old_term);
    ::sigaction(SIGINT, nullptr, &old_int);
    if (old_int.sa_handler != SIG_IGN) ::sigaction(SIGINT, &sa, nullptr);
  }
  ~StopSignals() {
    ::sigaction(SIGUSR1, &old_usr1, nullptr);
    ::sigaction(SIGTERM, &old_term, nullptr);
    ::sigaction(SIGINT, &old_int, nullptr);
  }
};

const char* stop_signal_name(int sig) { return sig == SIGUSR1 ? "SIGUSR1" : sig == SIGTERM ? "SIGTERM" : "SIGINT"; }

json op_profile_json(const std::map<std::string, kernels::OpTime>& ops) {
  json out = json::object();
  for (const auto& [name, o] : ops)
    out[name] = {{"calls", o.calls}, {"host_ms", o.host_ms}, {"device_ms", o.device_ms}, {"flops", o.flops}};
  return out;
}

}  // namespace

int Trainer::run() {
  try {
    for (const char* flag : {"log-json", "timeline", "trace"})  // their folders exist before the work, not after it
      if (!args_.str(flag).empty()) io::make_parent_folder(args_.str(flag), std::string("train: --") + flag);
    setup();
  } catch (const Error& e) {
    throw ExitStatusError(kRefusedBeforeStart, e.what());  // launch does not restart it
  }
  std::unique_ptr<std::ofstream> log;
  if (!args_.str("log-json").empty() && lead()) {
    // Resumed: the log goes on from the checkpoint's step. Lines of later steps (an earlier
    // attempt that failed after its last checkpoint, as launch restarts) are dropped first, so each
    // step is logged once.
    if (start_step_ && std::filesystem::exists(args_.str("log-json"))) {
      std::istringstream lines(io::read_file(args_.str("log-json"), "train: --log-json"));
      std::string kept;
      int64_t dropped = 0;
      for (std::string line; std::getline(lines, line);) {
        // a line cut short by the crash, or not one of train's records, goes too
        const json rec = json::parse(line, nullptr, false);
        if (rec.is_object() && rec.contains("step") && rec["step"].is_number_integer() &&
            rec["step"].get<int64_t>() <= start_step_)
          kept += line + "\n";
        else
          ++dropped;
      }
      io::write_text_atomic(args_.str("log-json"), "train: --log-json", kept);
      if (dropped)
        std::printf("note: --log-json %s: dropped its %lld lines after step %lld (the run goes on from there)\n",
                    args_.str("log-json").c_str(), (long long)dropped, (long long)start_step_);
    }
    log = std::make_unique<std::ofstream>(args_.str("log-json"), start_step_ ? std::ios::app : std::ios::trunc);
    SG_CHECK(log->good(), "train: cannot write --log-json ", args_.str("log-json"));
  }
  if (lead()) {
    // The whole model's size; under tp/pp rank 0 holds a part of it (before any dp sharding).
    const int64_t whole = cfg_.num_params(), held = model_->num_parameters();
    std::printf("shardgrad train | model %s: %lld layer%s, %lld head%s, width %lld, vocab %lld (padded %lld), %.2fM params%s\n",
                cfg_.name.c_str(), (long long)cfg_.n_layer, cfg_.n_layer == 1 ? "" : "s", (long long)cfg_.n_head,
                cfg_.n_head == 1 ? "" : "s", (long long)cfg_.n_embd,
                (long long)cfg_.vocab_size, (long long)cfg_.vocab_rows(), double(whole) / 1e6,
                held == whole ? "" : str(" (rank 0's tp/pp part: ", std::lround(held / 1e4) / 100.0, "M)").c_str());
    const std::string layout = layout_label();
    std::printf("data %s | batch %lld x %lld tokens (micro-batch %lld%s) | %s %s | %d threads | %s | steps %lld..%lld\n",
                train_->describe().c_str(), (long long)B_, (long long)T_, (long long)micro_,
                pp_ > 1 ? str(", ", B_ / dp_size_ / micro_, " per step").c_str() : "", device_.str().c_str(),
                dtype_name(dtype_), omp_get_max_threads(), layout.c_str(), (long long)start_step_, (long long)steps_);
    if (!io::is_generated_spec(data_opt_.spec)) std::printf("held out: %s\n", val_->describe().c_str());
    if (world_size_ == 1 && strategy_ != "single" && strategy_ != "dp")
      std::printf("note: --strategy %s on 1 rank shards and reduces nothing (launch it with mpirun -np N)\n",
                  strategy_.c_str());
    // A run no longer than its warmup never leaves it: its last step takes the peak rate, undecayed.
    if (sched_.kind != "constant" && steps_ > 1 && sched_.warmup_steps >= steps_)
      std::printf("note: --warmup-steps %lld covers all %lld steps: the learning rate rises to its peak at the last step "
                  "and never decays (give fewer warmup steps)\n",
                  (long long)sched_.warmup_steps, (long long)steps_);
    // mpirun -np N of a one-process strategy: N copies of one run, each unaware of the others.
    const char* launched = std::getenv("OMPI_COMM_WORLD_SIZE");
    if (!distributed() && launched && std::atoi(launched) > 1 && first_launched_rank())
      std::printf("note: mpirun started %s processes, but --strategy %s trains in each on its own: %s copies of one "
                  "run (give --strategy ddp, zero1/2/3, fsdp..., --tp or --pp to train one model together)\n",
                  launched, strategy_.c_str(), launched);
  }
  std::fflush(stdout);
  // From the first step on; before it a signal has its default effect (nothing to save yet).
  std::optional<StopSignals> stop_signals;
  if (!args_.str("save").empty() && !sim_) stop_signals.emplace();
  int stopped_on = 0;
  const int64_t eval_every = args_.i64("eval-every");
  const double peak_fl = peak_flops(), flops_per_token = cfg_.flops_per_token(T_);  // 0: no MFU
  for (int64_t step = start_step_; step < steps_; ++step) {
    const double lr = sched_.at(step);
    Ledger::global().reset_peaks(device_);
    trace::Scope step_scope("step", "compute", {{"step", step + 1}});
    trace::memory(device_);  // the step's starting point (bench's memory-over-time chart)
    parallel::watchdog::beat("forward/backward", step);
    parallel::maybe_inject(fault_, rank_, step + 1);
    auto t0 = std::chrono::steady_clock::now();
    double norm = 0;
    bool applied = true;
    std::optional<kernels::OpProfiler> profiler;
    if (step + 1 == args_.i64("profile-ops")) profiler.emplace(device_);
    const double scale = scaler_.scale;  // fp16: the loss scale this step runs at
    const double loss = train_step(step, lr, norm, applied);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const bool profiled = profiler.has_value();
    std::map<std::string, kernels::OpTime> op_times;
    if (profiled) {
      op_times = profiler->take();
      profiler.reset();
    }
    const double tps = double(B_ * T_) / (ms / 1000.0);
    const double mfu = peak_fl > 0 ? tps * flops_per_token / peak_fl : 0;
    trace::memory(device_);
    // Every rank's ledger (collective): the line shows the range of the ranks' peaks, which differ
    // under pipelines and uneven shards.
    const json ranks = report::step_metrics(device_, traffic_groups(), metrics_.get(),
                                            pipe_ ? &pipe_->last_timeline() : nullptr, pipe_ ? groups_.pp->rank() : -1)["ranks"];
    const std::string peak = peak_range(ranks);
    if (lead())
      std::printf("step %5lld/%lld | loss %.4f | lr %.2e | norm %.3f | %7.1f ms | %8.0f tok/s%s | peak%s %s%s%s\n",
                (long long)step + 1, (long long)steps_, loss, lr, norm, ms, tps,
                peak_fl > 0 ? str(" | MFU ", std::round(1000 * mfu) / 10, "%").c_str() : "", ranks.size() > 1 ? "/rank" : "",
                peak.c_str(), dtype_ == DType::f16 ? str(" | scale ", scale).c_str() : "",
                applied ? "" : overflowed_ ? " | skipped (overflow)" : " | skipped (non-finite)");
    if (profiled && lead()) print_op_profile(op_times, ms, step + 1, device_);
    std::fflush(stdout);
    json rec = {{"step", step + 1}, {"loss", loss}, {"lr", lr}, {"grad_norm", norm}, {"step_ms", ms},
                {"tokens_per_s", tps}, {"mem", ledger_json(device_)}, {"skipped", !applied}};
    if (dtype_ == DType::f16) rec["loss_scale"] = scale;
    if (peak_fl > 0) rec["mfu"] = mfu;
    if (profiled) rec["op_profile"] = op_profile_json(op_times);
    if (args_.str("offload") != "none") rec["mem_host"] = ledger_json(Device::cpu(0));  // the offloaded state
    if (fsdp_) rec["fsdp"] = {{"gathers_ahead", fsdp_->gathers_ahead()}};  // since the start: --prefetch at work
    rec["ranks"] = ranks;
    const bool last = step + 1 == steps_;
    if (last && pipe_ && !args_.str("timeline").empty()) write_timeline();
    if ((eval_every && (step + 1) % eval_every == 0) || last) {
      json ev = evaluate(step + 1);
      if (lead()) {
        std::printf("eval  step %lld | val loss %.4f", (long long)step + 1, ev["val_loss"].get<double>());
        if (ev.contains("accuracy")) std::printf(" | task accuracy %.1f%%", 100.0 * ev["accuracy"].get<double>());
        if (ev.contains("hellaswag"))
          std::printf(" | hellaswag %.4f (%lld/%lld)", ev["hellaswag"]["accuracy"].get<double>(),
                      (long long)ev["hellaswag"]["correct"].get<int64_t>(), (long long)ev["hellaswag"]["examples"].get<int64_t>());
        std::printf("\n");
        if (last && ev.contains("examples"))
          for (const auto& line : ev["examples"]) std::printf("  %s\n", line.get<std::string>().c_str());
        if (ev.contains("sample"))
          std::printf("sample step %lld | %lld tokens after \"%s\":\n%s\n---\n", (long long)step + 1,
                      (long long)sample_tokens_, escaped(ev["sample_prompt"].get<std::string>()).c_str(),
                      ev["sample"].get<std::string>().c_str());
        std::fflush(stdout);
      }
      rec["eval"] = ev;
    }
    if (log) {
      *log << rec.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";  // a sample's bytes may not be UTF-8
      log->flush();
    }
    // Saving is this rank's own work (writing its pieces), not a wait on its peers: a rank that
    // stops making progress here is the one that failed; its barriers name the waits for peers.
    if (saves_after(step + 1)) {
      parallel::watchdog::beat("the checkpoint save", step);
      save(step + 1);  // collective: every rank writes its own pieces
    }
    // An early stop: --stop-at's step, or a signal (every rank learns of it here, after the same step).
    if (!last && (step + 1 == stop_at_ || (stop_signals && (stopped_on = agreed_stop_signal())))) {
      if (pipe_ && !args_.str("timeline").empty()) write_timeline();  // of the last step run
      if (!saves_after(step + 1) && stopped_on) {
        parallel::watchdog::beat("the checkpoint save", step);
        save(step + 1);
      }
      if (lead())
        std::printf("stopped at step %lld of %lld (%s); %s\n", (long long)step + 1, (long long)steps_,
                    !stopped_on ? "--stop-at" : stop_signal_name(stopped_on),
                    args_.str("save").empty() ? "no --save: nothing to resume from"
                                              : str("go on with --save ", args_.str("save"), " --resume auto").c_str());
      std::fflush(stdout);
      break;
    }
  }
  if (const std::string path = args_.str("trace"); !path.empty()) {  // every rank's part, merged by rank 0
    trace::finish(path, rank_, world_size_, [&] {
      parallel::watchdog::Waiting w("the trace barrier");
      if (metrics_) metrics_->barrier()->wait();
    });
    if (lead()) std::printf("trace: written to %s (open it in https://ui.perfetto.dev or chrome://tracing)\n", path.c_str());
  }
  return stopped_on ? kStoppedOnSignal : 0;
}

double Trainer::train_step(int64_t step, double lr, double& grad_norm, bool& applied) {
  io::Batch b = train_->next(B_, T_);
  const int64_t counted = count_targets(b.targets, -1);
  SG_CHECK(counted > 0, "train: step ", step, " has no targets to predict");
  double loss_scale = dtype_ == DType::f16 ? scaler_.scale : 1.0;
  if (fault_.kind == "nan" && fault_.rank == rank_ && fault_.step == step + 1)
    loss_scale = std::numeric_limits<double>::quiet_NaN();  // --inject-fault kind=nan: this rank's gradients
  // This rank's rows of the global batch (all of it without data parallelism).
  const int64_t local = B_ / dp_size_, n_micro = local / micro_;
  Tensor idx = to(narrow(b.inputs, 0, dp_rank_ * local, local), device_);
  Tensor tgt = to(narrow(b.targets, 0, dp_rank_ * local, local), device_);
  // Dropout's place: this step, this rank's first row of the global batch and (under sequence
  // parallelism) its first position; each micro-batch (pipeline action) moves the row on.
  DropoutPlace& place = dropout_generator().place;
  place = DropoutPlace{step, dp_rank_ * local, cfg_.sequence_parallel ? groups_.tp->rank() * (T_ / tp_) : 0};
  if (pipe_) return pipeline_step(step, idx, tgt, counted, loss_scale, lr, grad_norm, applied);
  // With ddp the gradients are averaged over ranks, so each rank's loss is scaled by the world
  // size: the average of the ranks' gradients is then the gradient of the global batch's mean.
  const double rank_scale = double(dp_size_);
  double loss_sum = 0;
  // Read after the backward passes, not between forward and backward: item() waits for the device,
  // and on a GPU the backward's first kernels would then start only after the host caught up.
  std::vector<Tensor> losses;
  for (int64_t m = 0; m < n_micro; ++m) {
    Tensor mi = narrow(idx, 0, m * micro_, micro_), mt = narrow(tgt, 0, m * micro_, micro_);
    place.row0 = dp_rank_ * local + m * micro_;
    if (ddp_) ddp_->set_sync(m == n_micro - 1);  // no_sync for all but the last micro-batch
    // under SP the replicated gradients are summed over tp before ZeRO reduces them over dp
    if (zero_) zero_->set_sync(shard_accumulation_ || (m == n_micro - 1 && !cfg_.sequence_parallel));
    if (fsdp_) fsdp_->set_sync(!fsdp_no_sync_ || m == n_micro - 1);
    if (dp_) {
      trace::Scope ts("forward+backward", "compute", {{"micro", m}});
      loss_sum += dp_->forward_backward(mi, mt, loss_scale / double(counted)) / loss_scale;
      continue;
    }
    autograd::Tape tape;
    Tensor loss;
    {
      autograd::TapeScope scope(tape);
      // Sum over this micro-batch / tokens in the whole batch: the accumulated gradient is the
      // gradient of the global batch's mean loss, whatever the micro-batch split.
      trace::Scope ts("forward", "compute", {{"micro", m}});
      loss = model_->loss(mi, mt, true, rank_scale * loss_scale / double(counted));
      trace::memory(device_);
    }
    {
      trace::Scope ts("backward", "compute", {{"micro", m}});
      tape.backward(loss);
      trace::memory(device_);
    }
    if (shard_accumulation_ && m < n_micro - 1) zero_->reduce_micro_batch();
    losses.push_back(autograd::detach(loss));
  }
  // Read when the gradient norm has been queued as well, just before the step is accepted: the
  // host then waits for the device once (in the norm), not also between backward and norm, where
  // the GPU would sit idle while the host caught up and launched the norm's kernels.
  const auto read_loss = [&] {
    for (const Tensor& l : losses) loss_sum += item(l) / (loss_scale * rank_scale);
    return dp_loss(loss_sum);
  };
  if (ddp_) {
    parallel::watchdog::Waiting w("the gradient all-reduce");
    ddp_->finish_gradients();
  }
  if (cfg_.sequence_parallel && !fsdp_) parallel::tp::sync_sequence_parallel_grads(*model_, *groups_.tp);
  if (fsdp_) {  // the units were reduce-scattered during backward, micro-batch by micro-batch
    {
      parallel::watchdog::Waiting w("the gradient reduce-scatter");
      fsdp_->finish_gradients();
      if (cfg_.sequence_parallel) fsdp_->sum_replicated_gradients(*groups_.tp);
      grad_norm = tp_ > 1 ? std::sqrt(world_sum(fsdp_->grad_sum_squares(parallel::mesh_grad_weight(groups_.tp->rank(), true))))
                          : fsdp_->grad_norm();
    }
    grad_norm /= loss_scale;
    loss_sum = read_loss();
    applied = accept_step(step, loss_sum, grad_norm);
    trace::Scope opt_scope("optimizer", "compute");
    if (applied) fsdp_->step(lr, optim::clip_coefficient(grad_norm, args_.f64("clip")) / loss_scale);
    fsdp_->zero_grad();
    return loss_sum;
  }
  if (zero_) {
    {
      parallel::watchdog::Waiting w("the gradient reduce-scatter");
      if (cfg_.sequence_parallel) zero_->reduce_now();
      else zero_->finish_gradients();
      // partial sums of squares all-reduced over the shards (and the model-parallel ranks)
      grad_norm = (tp_ > 1 ? std::sqrt(world_sum(zero_->grad_sum_squares(parallel::mesh_grad_weight(groups_.tp->rank(), true))))
                           : zero_->grad_norm()) / loss_scale;
    }
    loss_sum = read_loss();
    applied = accept_step(step, loss_sum, grad_norm);
    if (applied) {
      parallel::watchdog::Waiting w("the parameter all-gather");
      trace::Scope ts("optimizer", "compute");
      zero_->step(lr, optim::clip_coefficient(grad_norm, args_.f64("clip")) / loss_scale);
    }
    zero_->zero_grad();
    return loss_sum;
  }
  if (dtype_ != DType::f32) {
    // The f32 masters take the model's bf16/f16 gradients as they are: the norm divides by the
    // loss scale and the update's scale carries it, AdamW widens each gradient as it reads it and
    // writes the model's weights back in the same pass (AdamW::set_copies). No f32 gradient copies.
    take_half_gradients();
  }
  if (tp_ > 1) {
    grad_norm = model_parallel_grad_norm() / loss_scale;
  } else {
    std::vector<Tensor> ps;
    for (auto& [n, p] : master_) ps.push_back(p);
    grad_norm = optim::global_grad_norm(ps) / loss_scale;
  }
  loss_sum = read_loss();
  applied = accept_step(step, loss_sum, grad_norm);
  if (applied) {
    trace::Scope ts("optimizer", "compute");
    opt_->step(lr, optim::clip_coefficient(grad_norm, args_.f64("clip")) / loss_scale);
  }
  model_->zero_grad();
  for (auto& [n, p] : master_) p.set_grad(Tensor());
  return loss_sum;
}

// One pipeline step: the executor runs this rank's actions over the micro-batches; the tied
// embedding's two gradients are summed; the global norm sums every rank's share.
double Trainer::pipeline_step(int64_t step, const Tensor& idx, const Tensor& tgt, int64_t counted, double loss_scale,
                              double lr, double& grad_norm, bool& applied) {
  if (!args_.str("timeline").empty()) metrics_->barrier()->wait();  // a common time origin
  double loss;
  {  // its waits are the sends' and receives' own (ProcessGroup's): a stage that hangs in compute is blamed
    if (ddp_) ddp_->set_sync(false);  // micro-batch backwards interleave: reduce once at the end
    if (zero_) zero_->set_sync(false);
    // Scaled by dp like the plain path: the dp average of the ranks' gradients is the global mean's.
    trace::Scope ts("forward+backward", "compute");
    // fp16: the loss scale rides in the loss's scale as on the plain path.
    loss = pipe_->run(idx, tgt, loss_scale * double(dp_size_) / double(counted)) / (loss_scale * double(dp_size_));
    if (!fsdp_) pipe_->reduce_tied_embedding();  // fsdp: on the shard gradients, below
  }
  if (cfg_.sequence_parallel && !fsdp_) parallel::tp::sync_sequence_parallel_grads(*model_, *groups_.tp);
  if (ddp_) {
    parallel::watchdog::Waiting w("the gradient all-reduce");
    ddp_->reduce_now();
  }
  loss = dp_loss(loss);
  const int tpr = groups_.tp ? groups_.tp->rank() : 0;
  if (fsdp_) {  // the Block units were reduce-scattered during backward; the roots are now
    {
      parallel::watchdog::Waiting w("the gradient reduce-scatter");
      fsdp_->finish_gradients();
      pipe_->sum_tied(fsdp_->tied_grad_shard());
      if (cfg_.sequence_parallel) fsdp_->sum_replicated_gradients(*groups_.tp);
    }
    grad_norm = std::sqrt(world_sum(fsdp_->grad_sum_squares(parallel::mesh_grad_weight(tpr, pipe_->holds_stage(0))))) /
                loss_scale;
    applied = accept_step(step, loss, grad_norm);
    trace::Scope opt_scope("optimizer", "compute");
    if (applied) fsdp_->step(lr, optim::clip_coefficient(grad_norm, args_.f64("clip")) / loss_scale);
    fsdp_->zero_grad();
    return loss;
  }
  if (zero_) {
    {
      parallel::watchdog::Waiting w("the gradient reduce-scatter");
      zero_->reduce_now();
    }
    grad_norm = std::sqrt(world_sum(zero_->grad_sum_squares(parallel::mesh_grad_weight(tpr, pipe_->holds_stage(0))))) /
                loss_scale;
    applied = accept_step(step, loss, grad_norm);
    parallel::watchdog::Waiting w("the parameter all-gather");
    if (applied) zero_->step(lr, optim::clip_coefficient(grad_norm, args_.f64("clip")) / loss_scale);
    zero_->zero_grad();
    return loss;
  }
  if (dtype_ != DType::f32) take_half_gradients();
  grad_norm = model_parallel_grad_norm() / loss_scale;
  applied = accept_step(step, loss, grad_norm);
  trace::Scope opt_scope("optimizer", "compute");
  if (applied) opt_->step(lr, optim::clip_coefficient(grad_norm, args_.f64("clip")) / loss_scale);
  for (auto& [n, p] : held_parameters()) p.set_grad(Tensor());
  for (auto& [n, p] : master_) p.set_grad(Tensor());
  return loss;
}

double Trainer::model_parallel_grad_norm() {
  std::vector<Tensor> grads;
  const bool first_stage = !pipe_ || pipe_->holds_stage(0);
  for (auto& [n, p] : master_) {
    if (n == "wte.weight" && !first_stage) continue;
    if (tp_ > 1 && parallel::tp::gpt_param_split(n).replicated() && groups_.tp->rank() != 0) continue;
    grads.push_back(p.grad());
  }
  Tensor t = from_vector<double>({sum_squares(grads)}, {1});
  mp_metrics_->all_reduce(t, comm::ReduceOp::sum)->wait();
  return std::sqrt(item(t));
}

// Whether to apply this step; every rank decides alike. fp16: an overflow is the loss scaler's
// business (back off, skip). Otherwise a
// non-finite loss or norm stops the run naming the step and this rank's first non-finite tensor
// (--on-nonfinite stop), or skips the step and counts it (skip).
bool Trainer::accept_step(int64_t step, double loss, double grad_norm) {
  bool loss_finite = std::isfinite(loss), norm_finite = std::isfinite(grad_norm);
  // The loss and norm are reduced, so ranks see the same values, but a value only one rank holds
  // (its own loss scale under a pipeline, where only the last stage seeds the backward with it)
  // must not make one stage step and another skip: the ranks decide together.
  if (metrics_ && world_size_ > 1) {
    Tensor bad = from_vector<double>({loss_finite ? 0.0 : 1.0, norm_finite ? 0.0 : 1.0}, {2});
    metrics_->all_reduce(bad, comm::ReduceOp::sum)->wait();
    const std::vector<double> v = to_vector<double>(bad);
    loss_finite = v[0] == 0.0, norm_finite = v[1] == 0.0;
  }
  const bool finite = loss_finite && norm_finite;
  // fp16: gradients that overflow at this scale are the loss scaler's (the step is skipped, the
  // scale backs off); a loss that is not finite is the forward's, which no scale mends: the policy's.
  overflowed_ = dtype_ == DType::f16 && loss_finite && !finite;
  if (dtype_ == DType::f16 && loss_finite) return scaler_.update(!finite);
  if (finite) return true;
  if (nonfinite_ == optim::NonFinitePolicy::skip) {
    ++nonfinite_skipped_;
    if (lead())
      std::printf("step %lld: non-finite %s: skipped (%lld skipped so far)\n", (long long)step + 1,
                  loss_finite ? "gradient norm" : "loss", (long long)nonfinite_skipped_);
    return false;
  }
  io::NamedTensors grads;
  for (auto& [n, p] : held_parameters())
    if (p.grad().defined()) grads.emplace_back(n, p.grad());
  optim::NonFinite bad = optim::first_nonfinite(grads);  // the gradient first: the loss is its symptom
  if (!bad.found()) bad = optim::first_nonfinite(loss, {});
  throw Error(bad.found() ? str("train: ", optim::nonfinite_message(bad, step + 1), " (--on-nonfinite stop)")
                          : str("train: step ", step + 1, ": the gradient norm is not finite (loss ", loss,
                                "); this rank's gradients are finite: the bad one is on another rank or was already "
                                "reduced (--on-nonfinite stop)"));
}

double Trainer::world_sum(double x) {
  Tensor t = from_vector<double>({x}, {1});
  metrics_->all_reduce(t, comm::ReduceOp::sum)->wait();
  return item(t);
}

int Trainer::agreed_stop_signal() {
  const int mine = int(stop_signal);
  if (!metrics_ || world_size_ == 1) return mine;
  Tensor t = from_vector<int32_t>({mine}, {1});  // SIGTERM (15) outranks SIGUSR1 (10), SIGINT (2), when several came
  metrics_->all_reduce(t, comm::ReduceOp::max)->wait();
  return int(item(t));
}

std::vector<double> Trainer::dp_sums(std::vector<double> shares) {
  if (dp_size_ == 1) return shares;
  const int64_t n = int64_t(shares.size());
  Tensor l = from_vector<double>(std::move(shares), {n});
  dp_metrics_->all_reduce(l, comm::ReduceOp::sum)->wait();
  return to_vector<double>(l);
}

Trainer::EvalShare Trainer::eval_share(int64_t n) const {
  EvalShare s;
  for (int64_t i = dp_rank_; i < n; i += dp_size_) s.items.push_back(i);
  s.most = (n + dp_size_ - 1) / dp_size_;
  return s;
}

// Gathers every rank's recorded (start, end) times of the last step and draws them (rank 0).
void Trainer::write_timeline() {
  const int pp_rank = groups_.pp->rank();
  const auto& mine = pipe_->last_timeline().per_rank[size_t(pp_rank)];
  std::vector<double> times;
  for (const auto& a : mine) times.insert(times.end(), {a.start, a.end});
  Tensor local = from_vector(times, {int64_t(times.size())});
  Tensor all = empty({int64_t(times.size()) * world_size_}, DType::f64);
  metrics_->all_gather(all, local)->wait();
  if (!lead()) return;
  auto sched = parallel::pp::make_schedule(args_.str("pp-schedule"), pp_, int((B_ / dp_size_) / micro_),
                                           int(args_.i64("virtual-stages")));
  parallel::pp::Timeline t;
  t.per_rank.resize(size_t(pp_));
  std::vector<double> v = to_vector<double>(all);
  for (int r = 0; r < pp_; ++r)
    for (size_t k = 0; k < sched.per_rank[size_t(r)].size(); ++k) {
      // pipeline rank r of the first replica (dp 0, tp 0) is world rank r * tp
      const size_t at = size_t(r) * size_t(tp_) * times.size() + 2 * k;
      const double start = v[at], end = v[at + 1];
      t.per_rank[size_t(r)].push_back({sched.per_rank[size_t(r)][k], start, end});
      t.makespan = std::max(t.makespan, end);
    }
  io::write_text_atomic(args_.str("timeline"), "train: --timeline",
                        report::timeline_svg(t, sched.name + " pipeline, measured: p=" + std::to_string(pp_) +
                                                    ", m=" + std::to_string(sched.micro_batches)));
  std::printf("timeline: measured bubble %.1f%% of busy time (formula (p-1)/(v m) = %.1f%%), written to %s\n",
              100.0 * t.bubble_fraction(), 100.0 * double(pp_ - 1) / double(sched.chunks * sched.micro_batches),
              args_.str("timeline").c_str());
}

Tensor Trainer::eval_logits(const Tensor& idx, bool on_host) {
  const int64_t n = idx.size(1), pad = cfg_.sequence_parallel ? (tp_ - n % tp_) % tp_ : 0;
  const Tensor x = to(pad ? cat({idx, zeros({idx.size(0), pad}, idx.dtype())}, 1) : idx, device_);
  Tensor logits = pipe_ ? pipe_->forward(x) : model_->forward(x);
  if (tp_ > 1) logits = parallel::all_gather_along(logits, -1, *groups_.tp);
  if (pad) logits = narrow(logits, 1, 0, n);
  return on_host ? to(logits, Device::cpu()) : logits;
}

namespace {
std::vector<int64_t> counts(const std::vector<double>& sums, size_t from) {  // counts carried in a sum of doubles
  std::vector<int64_t> out;
  for (size_t i = from; i < sums.size(); ++i) out.push_back(std::llround(sums[i]));
  return out;
}
}  // namespace

json Trainer::evaluate(int64_t step) {
  parallel::watchdog::beat("the evaluation", step - 1);  // a rank stuck here is named in it
  autograd::NoGradGuard ng;
  DropoutOff eval_mode;  // the model as it is, without dropout
  trace::Scope ts("evaluate", "compute");
  Ledger::global().reset_peaks(device_);  // out["mem"]: the evaluation's own (the step's is logged)
  json out;
  // The same held-out batches at every evaluation, this rank's share of them (every rank reads
  // them all: the data's position moves by whole batches).
  const int64_t nb = args_.i64("eval-batches");
  const EvalShare share = eval_share(nb);
  std::vector<io::Batch> all;
  val_->set_position(0);
  for (int64_t i = 0; i < nb; ++i) all.push_back(val_->next(B_, T_));
  const auto batch_loss = [&](const io::Batch& b) {
    // The mean over the counted targets, as a sum (times 1 / count) over training's micro-batches,
    // through the pipeline's stages too: the whole global batch in one forward would hold B / micro
    // times a training forward's activations and logits (GPT-2 124M at batch 512 and micro-batch
    // 64: 105 GB of f32 logits).
    const double scale = 1.0 / double(std::max<int64_t>(1, count_targets(b.targets, -1)));
    double sum = 0;
    for (int64_t r = 0; r < B_; r += micro_) {
      const Tensor idx = to(narrow(b.inputs, 0, r, micro_), device_), tgt = to(narrow(b.targets, 0, r, micro_), device_);
      sum += item(pipe_ ? pipe_->forward(idx, tgt, scale) : model_->loss(idx, tgt, true, scale));
    }
    return sum;
  };
  std::vector<double> sums(size_t(1 + dp_size_), 0.0);  // the losses, then each rank's batch count
  for (int64_t i : share.items) sums[0] += batch_loss(all[size_t(i)]);
  sums[size_t(1 + dp_rank_)] = double(share.items.size());
  // (a rank with a shorter share runs forwards that count nothing: see eval_share)
  if (fsdp_)
    for (int64_t k = int64_t(share.items.size()); k < share.most; ++k) (void)batch_loss(all[0]);
  sums = dp_sums(std::move(sums));
  out["val_loss"] = sums[0] / double(nb);
  out["val_batches_per_rank"] = counts(sums, 1);
  auto* task = dynamic_cast<const io::SyntheticDataset*>(val_.get());
  if (task && runs_prompts()) {
    // Under tp and pp every rank of the replica runs the same prompts in lockstep and sees the whole
    // vocabulary (eval_logits).
    auto logits_fn = [this](const Tensor& idx) { return eval_logits(idx); };
    out["accuracy"] = io::synthetic_accuracy(task->task(), logits_fn, args_.i64("eval-problems"), cfg_.block_size, seed_ + 1);
    out["examples"] = io::synthetic_examples(task->task(), logits_fn, 4, cfg_.block_size, seed_ + 2);
  }
  if (sample_tokens_ > 0 && runs_prompts()) out.update(sample(step));
  if (!choices_.empty()) out["hellaswag"] = hellaswag();
  out["mem"] = ledger_json(device_);
  return out;
}

json Trainer::hellaswag() {
  const auto start = std::chrono::steady_clock::now();
  const EvalShare share = eval_share(int64_t(choices_.size()));
  std::vector<io::ChoiceExample> mine;
  for (int64_t i : share.items) mine.push_back(choices_[size_t(i)]);
  auto shown = start;
  const auto progress = [&](int64_t done, int64_t total) {  // a line every 10 s of a long evaluation
    const auto now = std::chrono::steady_clock::now();
    if (!lead() || done == total || now - shown < std::chrono::seconds(10)) return;
    shown = now;
    std::printf("  hellaswag: %lld of %lld examples%s (%.0f s)\n", (long long)done, (long long)total,
                dp_size_ > 1 ? str(" (rank 0's share; the ", dp_size_, " data-parallel ranks score ", choices_.size(),
                                   " together)").c_str() : "",
                std::chrono::duration<double>(now - start).count());
    std::fflush(stdout);
  };
  // As many examples a forward as a training forward's rows hold (llm.c packs B / 4 of 4 endings).
  const int64_t per = std::max<int64_t>(1, micro_ / 4), multiple = cfg_.sequence_parallel ? tp_ : 1;
  const auto logits = [this](const Tensor& idx) { return eval_logits(idx, false); };
  const io::ChoiceScore s = io::score_choices(mine, logits, cfg_.vocab_size, cfg_.block_size, multiple, per, progress);
  // (a rank with fewer forwards runs forwards that count nothing: see eval_share)
  if (fsdp_) {
    const auto forwards = [&](int64_t examples) { return (examples + per - 1) / per; };
    const Tensor spare = io::choice_rows(choices_, 0, 1, cfg_.block_size, multiple).inputs;
    for (int64_t k = forwards(int64_t(mine.size())); k < forwards(share.most); ++k) (void)logits(spare);
  }
  std::vector<double> sums(size_t(2 + dp_size_), 0.0);  // right by mean, right by sum, then each rank's examples
  sums[0] = double(s.correct_norm);
  sums[1] = double(s.correct_sum);
  sums[size_t(2 + dp_rank_)] = double(s.examples);
  sums = dp_sums(std::move(sums));
  const int64_t n = int64_t(choices_.size());
  return {{"accuracy", sums[0] / double(n)}, {"accuracy_sum", sums[1] / double(n)}, {"correct", std::llround(sums[0])},
          {"examples", n}, {"per_rank", counts(sums, 2)},
          {"seconds", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()}};
}

int64_t Trainer::sample_prompt_length() const {
  // the synthetic task serves whole problems only: its prompt is the first one (the sampler's
  // window keeps its last block_size ids)
  if (auto* task = dynamic_cast<const io::SyntheticDataset*>(val_.get())) return task->task().problem_length();
  return std::min<int64_t>({16, std::max<int64_t>(1, cfg_.block_size / 2), B_ * T_});
}

json Trainer::sample(int64_t step) {
  const int64_t n_prompt = sample_prompt_length();
  val_->set_position(0);
  const std::vector<int64_t> prompt = to_vector<int64_t>(to(val_->next(1, n_prompt).inputs, DType::i64));
  std::vector<int64_t> ids = prompt, drawn;
  for (int64_t s = 0; s < sample_tokens_; ++s) {
    // the last block_size ids, afresh each time (no KV cache under every layout); under sequence
    // parallelism as many as still pad to a multiple of tp within block_size
    const int64_t span = cfg_.block_size - (cfg_.sequence_parallel ? cfg_.block_size % tp_ : 0);
    const int64_t start = std::max<int64_t>(0, int64_t(ids.size()) - span);
    std::vector<int64_t> window(ids.begin() + start, ids.end());
    const int64_t n = int64_t(window.size());
    Tensor logits = eval_logits(from_vector(std::move(window), {1, n}));
    std::vector<float> last = to_vector<float>(to(narrow(logits, 1, n - 1, 1), DType::f32));
    last.resize(size_t(sample_vocab_));  // the padded columns, and ids past the data's, are never drawn
    ids.push_back(draw_token(last, 1.0, 0, seed_ + 3, (uint64_t(step) << 20) + uint64_t(s)));
    drawn.push_back(ids.back());
  }
  return {{"sample_prompt", sample_decode_(prompt)}, {"sample", sample_decode_(drawn)}, {"sample_ids", drawn}};
}

std::string Trainer::layout_label() const {
  if (strategy_ == "dp") {  // one process: its replicas on the devices, the first holding the model
    std::string devices;
    for (const Device& d : dp_devices_) devices += (devices.empty() ? "" : ", ") + d.str();
    return str("dp over ", dp_devices_.size(), " devices (", devices, "; the peak is ", device_.str(), "'s)");
  }
  const std::string dp = strategy_ == "single" && dp_size_ == 1 ? "" : str(strategy_, " over dp ", dp_size_, " x ");
  std::string label = tp_ == 1 && pp_ == 1 ? str(strategy_, " x ", world_size_)
                                           : str(dp, "tp ", tp_, cfg_.sequence_parallel ? "+sp" : "", " x pp ", pp_, " (",
                                                 world_size_, " ranks)");
  // Where zero2 and the fsdp family accumulate the micro-batches' gradients (--grad-accumulation)
  if ((strategy_ == "zero2" || fsdp_family()) && pp_ == 1 && B_ / dp_size_ / micro_ > 1)
    label += shard_accumulation_ || (fsdp_family() && !fsdp_no_sync_) ? ", micro-batches reduced into the shard"
                                                                       : ", micro-batches accumulated unsharded";
  return label;
}

}  // namespace sg::cli

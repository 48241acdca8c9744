// CPU training step vs PyTorch eager: the shardgrad side of bench/torch_cpu_step.py.
//
// Same flags, defaults, model, optimizer and FLOP formula as the Python peer, so the two JSON lines
// compare directly:
//   one step = forward + loss on a Tape, backward, global-norm clip 1.0, AdamW (lr 3e-4, betas
//   (0.9, 0.95), eps 1e-8, weight decay 0.1 on dim >= 2), zero_grad;
//   model_flops_per_step = 6*N*B*T + 12*n_layer*B*T^2*C, N = params - wpe (wte counts: tied head).
// The vocabulary is not padded (padded_vocab = vocab), so N is the Python script's N.
// It also measures this CPU's Eigen SGEMM peak through the op table at the same thread count
// and reports cpu_mfu = model FLOP/s / that peak.
//
// --profile adds a breakdown: the step's phases (forward, backward, clip, optimizer, zero_grad)
// and, from one extra instrumented step per timed step, time per op kind. Forward op kinds come
// from a mirror of GPT::forward written here call by call (checked to give the same loss);
// backward op kinds from wrapping each recorded node's backward function with a timer. Nothing
// in the library is instrumented.
//
//   ./build/bench/sg_bench_train_step [--n-layer 4 --n-head 4 --n-embd 256 --seq-len 128
//       --batch-size 8 --vocab-size 256 --threads 2 --steps 20 --warmup 3 --seed 0]
//       [--json-out FILE] [--profile]
#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <tuple>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "kernels/ops.h"
#include "models/gpt.h"
#include "optim/optim.h"

using namespace sg;
using nlohmann::json;

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Options {
  int64_t n_layer = 4, n_head = 4, n_embd = 256, seq_len = 128, batch_size = 8, vocab_size = 256;
  int threads = 2;
  int64_t steps = 20, warmup = 3;
  uint64_t seed = 0;
  std::string json_out;
  bool profile = false;
};

Options parse(int argc, char** argv) {
  Options o;
  auto usage = [&](const std::string& why) {
    std::fprintf(stderr,
                 "%s\nusage: %s [--n-layer 4] [--n-head 4] [--n-embd 256] [--seq-len 128] [--batch-size 8]\n"
                 "  [--vocab-size 256] [--threads 2] [--steps 20] [--warmup 3] [--seed 0] [--json-out FILE] "
                 "[--profile]\n",
                 why.c_str(), argv[0]);
    std::exit(2);
  };
  for (int i = 1; i < argc; ++i) {
    std::string f = argv[i];
    if (f == "--profile") {
      o.profile = true;
      continue;
    }
    if (i + 1 >= argc) usage("missing value for " + f);
    std::string v = argv[++i];
    auto num = [&]() -> int64_t {
      try {
        size_t used = 0;
        int64_t x = std::stoll(v, &used);
        if (used != v.size()) throw std::invalid_argument(v);
        return x;
      } catch (const std::exception&) {
        usage(f + ": not an integer: '" + v + "'");
      }
      return 0;
    };
    if (f == "--n-layer") o.n_layer = num();
    else if (f == "--n-head") o.n_head = num();
    else if (f == "--n-embd") o.n_embd = num();
    else if (f == "--seq-len") o.seq_len = num();
    else if (f == "--batch-size") o.batch_size = num();
    else if (f == "--vocab-size") o.vocab_size = num();
    else if (f == "--threads") o.threads = int(num());
    else if (f == "--steps") o.steps = num();
    else if (f == "--warmup") o.warmup = num();
    else if (f == "--seed") o.seed = uint64_t(num());
    else if (f == "--json-out") o.json_out = v;
    else usage("unknown flag " + f);
  }
  if (o.n_head < 1 || o.n_embd % o.n_head) usage("--n-embd must be divisible by --n-head");
  if (o.steps < 1 || o.warmup < 0) usage("--steps must be >= 1 and --warmup >= 0");
  if (o.threads < 1) usage("--threads must be >= 1");
  return o;
}

// ---- GEMM peak: the op table's gemm (Eigen) on large row-major products, best of several ----

struct GemmPoint {
  int64_t M, N, K;
  double gflops;
};

std::vector<GemmPoint> gemm_peak(int reps) {
  const std::vector<std::array<int64_t, 3>> shapes = {{1024, 1024, 1024}, {2048, 3072, 768}, {2048, 768, 3072}};
  std::vector<GemmPoint> out;
  for (auto [M, N, K] : shapes) {
    Tensor A = randn({M, K}, 1, 1), B = randn({K, N}, 1, 2), C = empty({M, N});
    kernels::GemmArgs g;
    g.dtype = DType::f32;
    g.M = M;
    g.N = N;
    g.K = K;
    g.A = A.data_ptr();
    g.lda = K;
    g.B = B.data_ptr();
    g.ldb = N;
    g.C = C.data_ptr();
    g.ldc = N;
    const auto gemm = kernels::table(Device::cpu()).gemm;
    gemm(g);  // warm caches and Eigen's blocking buffers
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
      auto t0 = Clock::now();
      gemm(g);
      best = std::min(best, seconds_since(t0));
    }
    out.push_back({M, N, K, 2.0 * double(M) * double(N) * double(K) / best / 1e9});
  }
  return out;
}

// ---- profiling: per-op-kind time ----

using Timings = std::map<std::string, double>;

template <class F>
auto timed(Timings& t, const std::string& kind, F&& f) {
  auto t0 = Clock::now();
  auto r = f();
  t[kind] += seconds_since(t0);
  return r;
}

// GPT::loss, call by call, with each op kind timed (same modules, same ops, same order).
Tensor profiled_loss(const nn::GPT& m, const Tensor& idx, const Tensor& tgt, Timings& t) {
  const int64_t T = idx.size(1), H = m.config.n_head;
  SG_CHECK(m.config.dropout == 0, "--profile mirrors GPT::loss without dropout");
  Tensor x = timed(t, "embedding", [&] { return add(m.wte->forward(idx), narrow(m.wpe->weight, 0, 0, T)); });
  for (const auto& blk : m.h) {
    Tensor h1 = timed(t, "layernorm", [&] { return blk->ln_1->forward(x); });
    Tensor qkv = timed(t, "linear", [&] { return blk->attn->c_attn->forward(h1); });
    Tensor y = timed(t, "attention", [&] { return attention_qkv(qkv, H); });
    Tensor h = timed(t, "linear", [&] { return blk->attn->c_proj->forward(y, x); });  // x + attn in the GEMM
    Tensor h2 = timed(t, "layernorm", [&] { return blk->ln_2->forward(h); });
    x = timed(t, "mlp", [&] { return blk->mlp->forward(h2, h); });  // h + mlp in the GEMM
  }
  x = timed(t, "layernorm", [&] { return m.ln_f->forward(x); });
  Tensor logits = timed(t, "lm_head", [&] { return linear(x, m.wte->weight, Tensor()); });
  CrossEntropyOptions o;
  o.vocab = m.config.vocab_size;
  o.ignore_index = -1;
  return timed(t, "cross_entropy", [&] { return cross_entropy(logits, tgt, o); });
}

// Wraps the backward of every node reachable from loss with a timer keyed by the node's name.
void time_backward_nodes(const Tensor& loss, Timings& t) {
  std::vector<autograd::Node*> stack{loss.grad_fn().get()};
  std::set<autograd::Node*> seen{stack[0]};
  while (!stack.empty()) {
    autograd::Node* n = stack.back();
    stack.pop_back();
    autograd::BackwardFn inner = std::move(n->backward);
    std::string kind = n->name;
    n->backward = [inner = std::move(inner), kind, &t](const autograd::TensorList& g) {
      auto t0 = Clock::now();
      auto r = inner(g);
      t[kind] += seconds_since(t0);
      return r;
    };
    for (const auto& e : n->edges)
      if (e.producer && seen.insert(e.producer.get()).second) stack.push_back(e.producer.get());
  }
}

json timings_json(const Timings& t, double steps) {
  std::vector<std::pair<std::string, double>> v(t.begin(), t.end());
  std::sort(v.begin(), v.end(), [](auto& a, auto& b) { return a.second > b.second; });
  json j = json::object();
  for (auto& [k, s] : v) j[k] = s / steps * 1e3;
  return j;
}

void print_table(const char* title, const json& ms, double total_ms) {
  std::fprintf(stderr, "  %s (ms/step, %% of step)\n", title);
  std::vector<std::pair<std::string, double>> v;
  for (auto& [k, x] : ms.items()) v.emplace_back(k, x.get<double>());
  std::sort(v.begin(), v.end(), [](auto& a, auto& b) { return a.second > b.second; });
  for (auto& [k, x] : v) std::fprintf(stderr, "    %-22s %8.2f  %5.1f%%\n", k.c_str(), x, 100.0 * x / total_ms);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  omp_set_num_threads(o.threads);
  Eigen::setNbThreads(o.threads);

  const int64_t L = o.n_layer, H = o.n_head, C = o.n_embd, T = o.seq_len, B = o.batch_size, V = o.vocab_size;
  nn::GPTConfig cfg;
  cfg.name = "bench";
  cfg.n_layer = L;
  cfg.n_head = H;
  cfg.n_embd = C;
  cfg.block_size = T;
  cfg.vocab_size = V;
  cfg.padded_vocab = V;  // no padding: the FLOP count is the Python script's
  nn::GPT model(cfg);
  model.init_weights(o.seed);
  const auto named = model.named_parameters();
  const std::vector<Tensor> params = model.parameters();
  optim::AdamWConfig ac;
  ac.beta1 = 0.9;
  ac.beta2 = 0.95;
  ac.eps = 1e-8;
  ac.weight_decay = 0.1;
  optim::AdamW opt(named, ac);
  const double lr = 3e-4, clip = 1.0;

  // Pre-generated batches: B x (T+1) uniform tokens per step; idx = tokens[:, :-1], targets = tokens[:, 1:].
  const int64_t total = o.warmup + o.steps;
  std::mt19937_64 rng(o.seed);
  std::uniform_int_distribution<int64_t> tok(0, V - 1);
  std::vector<std::pair<Tensor, Tensor>> batches;
  for (int64_t s = 0; s < total; ++s) {
    std::vector<int64_t> idx(size_t(B * T)), tgt(size_t(B * T));
    for (int64_t b = 0; b < B; ++b) {
      std::vector<int64_t> row(size_t(T + 1));
      for (auto& x : row) x = tok(rng);
      for (int64_t t = 0; t < T; ++t) {
        idx[size_t(b * T + t)] = row[size_t(t)];
        tgt[size_t(b * T + t)] = row[size_t(t + 1)];
      }
    }
    batches.emplace_back(from_vector(idx, {B, T}), from_vector(tgt, {B, T}));
  }

  std::vector<double> times, losses;
  std::vector<double> t_fwd, t_bwd, t_clip, t_opt, t_zero;
  for (int64_t s = 0; s < total; ++s) {
    const auto& [idx, tgt] = batches[size_t(s)];
    auto t0 = Clock::now();
    Tensor loss;
    autograd::Tape tape;
    {
      autograd::TapeScope scope(tape);
      loss = model.loss(idx, tgt);
    }
    const double f = seconds_since(t0);
    tape.backward(loss);
    const double b = seconds_since(t0);
    const double norm = optim::global_grad_norm(params);
    const double c = seconds_since(t0);
    opt.step(lr, optim::clip_coefficient(norm, clip));
    const double op = seconds_since(t0);
    model.zero_grad();
    const double step = seconds_since(t0);
    if (s >= o.warmup) {
      times.push_back(step);
      losses.push_back(item(loss));  // outside the timed region
      t_fwd.push_back(f);
      t_bwd.push_back(b - f);
      t_clip.push_back(c - b);
      t_opt.push_back(op - c);
      t_zero.push_back(step - op);
    }
  }

  int64_t n_total = 0;
  for (const auto& p : params) n_total += p.numel();
  const int64_t n_flop = n_total - model.wpe->weight.numel();  // non-embedding + wte (tied head)
  const double flops = 6.0 * double(n_flop) * double(B * T) + 12.0 * double(L * B * T * T * C);
  const double med = median(times);
  double mean = 0;
  for (double x : times) mean += x;
  mean /= double(times.size());

  const auto peaks = gemm_peak(5);
  double peak = 0;
  json peak_shapes = json::array();
  for (const auto& p : peaks) {
    peak = std::max(peak, p.gflops);
    peak_shapes.push_back({{"M", p.M}, {"N", p.N}, {"K", p.K}, {"gflops", p.gflops}});
  }
  const double gflops = flops / med / 1e9;

  json env = json::object();
  for (const char* k : {"OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND"})
    if (const char* v = std::getenv(k)) env[k] = v;

  json out = {
      {"impl", "shardgrad"},
      {"torch_version", nullptr},
      {"blas", "Eigen " + std::to_string(EIGEN_WORLD_VERSION) + "." + std::to_string(EIGEN_MAJOR_VERSION) + "." +
                   std::to_string(EIGEN_MINOR_VERSION) + " (OpenMP)"},
      {"threads", o.threads},
      {"env", env},
      {"config",
       {{"n_layer", L}, {"n_head", H}, {"n_embd", C}, {"seq_len", T}, {"batch_size", B}, {"vocab_size", V},
        {"steps", o.steps}, {"warmup", o.warmup}, {"seed", o.seed}, {"dtype", "float32"}, {"lr", lr},
        {"weight_decay", ac.weight_decay}, {"clip", clip}}},
      {"n_params", n_total},
      {"n_params_flops", n_flop},
      {"median_step_ms", med * 1e3},
      {"min_step_ms", *std::min_element(times.begin(), times.end()) * 1e3},
      {"mean_step_ms", mean * 1e3},
      {"tokens_per_s", double(B * T) / med},
      {"model_flops_per_step", flops},
      {"flops_formula", "6*N*B*T + 12*n_layer*B*T*T*C, N = params - wpe"},
      {"gflops", gflops},
      {"first_loss", losses.front()},
      {"last_loss", losses.back()},
      {"gemm_peak_gflops", peak},
      {"gemm_peak_shapes", peak_shapes},
      {"cpu_mfu", gflops / peak},
  };

  if (o.profile) {
    json phases = {{"forward+loss", median(t_fwd) * 1e3},
                   {"backward", median(t_bwd) * 1e3},
                   {"clip (grad norm)", median(t_clip) * 1e3},
                   {"optimizer", median(t_opt) * 1e3},
                   {"zero_grad", median(t_zero) * 1e3}};
    // Instrumented steps (same batches as the timed ones): op kinds in forward and in backward.
    Timings fwd, bwd;
    double bwd_total = 0, fwd_total = 0, loss_gap = 0;
    for (int64_t s = o.warmup; s < total; ++s) {
      const auto& [idx, tgt] = batches[size_t(s)];
      autograd::Tape tape;
      Tensor loss;
      auto t0 = Clock::now();
      {
        autograd::TapeScope scope(tape);
        loss = profiled_loss(model, idx, tgt, fwd);
      }
      fwd_total += seconds_since(t0);
      {
        autograd::NoGradGuard ng;  // the mirror must compute what GPT::loss computes
        loss_gap = std::max(loss_gap, std::abs(item(loss) - item(model.loss(idx, tgt))));
      }
      time_backward_nodes(loss, bwd);
      t0 = Clock::now();
      tape.backward(loss);
      bwd_total += seconds_since(t0);
      model.zero_grad();
    }
    SG_CHECK(loss_gap < 1e-6, "profile: the instrumented forward differs from GPT::loss by ", loss_gap);
    const double n = double(o.steps);
    double nodes = 0;
    for (auto& [k, s] : bwd) nodes += s;
    bwd["(tape: grad accumulation, leaf delivery)"] = bwd_total - nodes;
    double ops = 0;
    for (auto& [k, s] : fwd) ops += s;
    fwd["(untimed glue)"] = fwd_total - ops;
    out["profile"] = {{"phases_ms", phases}, {"forward_ops_ms", timings_json(fwd, n)},
                      {"backward_nodes_ms", timings_json(bwd, n)}};
    std::fprintf(stderr, "profile: median step %.2f ms, model %.1f GFLOP/s, GEMM peak %.1f GFLOP/s, CPU MFU %.1f%%\n",
                 med * 1e3, gflops, peak, 100.0 * gflops / peak);
    print_table("phases", phases, med * 1e3);
    print_table("forward by op kind", out["profile"]["forward_ops_ms"], med * 1e3);
    print_table("backward by node kind", out["profile"]["backward_nodes_ms"], med * 1e3);
  }

  const std::string line = out.dump();
  std::printf("%s\n", line.c_str());
  if (!o.json_out.empty()) {
    std::ofstream f(o.json_out);
    SG_CHECK(f, "--json-out: cannot write ", o.json_out);
    f << line << "\n";
  }
  return 0;
}

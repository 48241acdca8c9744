// The storage pattern of a checkpoint, measured: for one GPT training state (parameters + AdamW
// m and v, f32), the bytes and files each rank writes and the wall time of the save and of the
// load back into the same layout, for
//   full        the state gathered to rank 0, which writes model + optim (the full format)
//   ddp         sharded format, replicated state: rank 0 writes everything, the others nothing
//   zero3       sharded format, every tensor cut into N flat runs: each rank writes 1/N
//   tp2xppN/2   sharded format, tensor parallel pairs x pipeline stages: each rank its stage's
//               layers, split ones by its tp piece, replicated ones by tp rank 0 only
// Run: mpirun -np N build/bench/sg_bench_ckpt_storage [DIR] [n_layer n_embd vocab]
// (the gather to rank 0 of the full layout is not timed: only what the filesystem sees).
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>

#include "autograd/ops.h"
#include "models/gpt.h"
#include "parallel/checkpoint.h"
#include "parallel/comm/mpi_backend.h"
#include "parallel/sharded_checkpoint.h"
#include "parallel/tp/layers.h"

using namespace sg;
using namespace sg::ckpt;
namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

double max_over(comm::ProcessGroup& g, double x) {
  Tensor t = from_vector<double>({x}, {1});
  g.all_reduce(t, comm::ReduceOp::max)->wait();
  return item(t);
}
double sum_over(comm::ProcessGroup& g, double x) {
  Tensor t = from_vector<double>({x}, {1});
  g.all_reduce(t)->wait();
  return item(t);
}

int64_t dir_bytes(const fs::path& p, int64_t* files) {
  int64_t b = 0;
  for (const auto& e : fs::directory_iterator(p))
    if (e.is_regular_file()) b += int64_t(e.file_size()), ++*files;
  return b;
}

int layer_of(const std::string& name) {  // "h.3.attn..." -> 3, others -1
  if (name.rfind("h.", 0) != 0) return -1;
  return std::stoi(name.substr(2, name.find('.', 2) - 2));
}

// The views of this rank under tp x pp (tp innermost), replicated state owned by tp rank 0.
std::vector<LocalView> tp_pp_views(const io::NamedTensors& state, int n_layer, int rank, int tp, int pp) {
  const int tp_rank = rank % tp, stage = rank / tp, per = n_layer / pp;
  std::vector<LocalView> out;
  for (const auto& [name, t] : state) {
    const std::string param = name.substr(0, name.find(".weight") != std::string::npos ? name.find(".weight") + 7
                                                                                          : name.find(".bias") + 5);
    const int l = layer_of(param);
    const int owner = l >= 0 ? l / per : (param.rfind("ln_f", 0) == 0 ? pp - 1 : 0);
    if (owner != stage) continue;
    const parallel::tp::Split s = parallel::tp::gpt_param_split(param);
    if (s.replicated()) {
      if (tp_rank == 0) out.push_back(whole_view(name, t.shape()));
    } else {
      out.push_back(split_view(name, t.shape(), s.dim, s.parts, tp_rank, tp));
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  comm::init();
  {
    auto world = comm::MpiProcessGroup::world();
    const int rank = world->rank(), size = world->size();
    const fs::path root = argc > 1 ? fs::path(argv[1]) : fs::temp_directory_path() / "sg_bench_ckpt";
    nn::GPTConfig cfg;
    cfg.n_layer = argc > 2 ? std::stoll(argv[2]) : 4;
    cfg.n_embd = argc > 3 ? std::stoll(argv[3]) : 256;
    cfg.vocab_size = argc > 4 ? std::stoll(argv[4]) : 8192;
    cfg.n_head = 4;
    cfg.block_size = 256;
    nn::GPT model(cfg);
    model.init_weights(1);
    // The global state: parameters (wte without padding) and AdamW's two moments.
    io::NamedTensors state;
    for (auto& [n, p] : model.named_parameters()) {
      Tensor g = n == "wte.weight" ? contiguous(narrow(p, 0, 0, cfg.vocab_size)) : p;
      state.emplace_back(n, g);
      state.emplace_back(n + ".exp_avg", g);
      state.emplace_back(n + ".exp_avg_sq", g);
    }
    int64_t total = 0;
    for (auto& [n, t] : state) total += int64_t(t.nbytes());
    if (rank == 0) {
      fs::remove_all(root);
      std::printf("state: %lld layers, width %lld, vocab %lld: %.1f MB (params + m + v, f32), %d ranks\n\n",
                  (long long)cfg.n_layer, (long long)cfg.n_embd, (long long)cfg.vocab_size, double(total) / 1e6, size);
      std::printf("| layout | files per rank (max) | MB per rank: rank 0 / max other | total MB | save s | load s |\n");
      std::printf("|---|---|---|---|---|---|\n");
    }
    world->barrier()->wait();
    const bool tppp = size % 2 == 0 && cfg.n_layer % (size / 2) == 0 && cfg.n_embd % 2 == 0;
    for (const std::string layout : {"full", "ddp", "zero3", "tp2xpp"}) {
      if (layout == "tp2xpp" && !tppp) continue;
      const fs::path run = root / layout;
      std::vector<LocalView> views;
      std::vector<std::pair<int64_t, int64_t>> runs;  // zero3: this rank's [lo, n) of each tensor
      std::vector<Piece> mine;
      if (layout == "ddp" && rank == 0)
        for (auto& [n, t] : state) views.push_back(whole_view(n, t.shape()));
      if (layout == "tp2xpp") views = tp_pp_views(state, int(cfg.n_layer), rank, 2, size / 2);
      for (const auto& v : views) {
        for (auto& [n, t] : state)
          if (n == v.name) {
            Tensor local = zeros(v.local_shape);
            read_local(MemorySource({{n, t}}), v, local);
            for (auto& p : pieces_of(v, local)) mine.push_back(p);
          }
      }
      if (layout == "zero3")
        for (auto& [n, t] : state) {
          const int64_t chunk = (t.numel() + size - 1) / size, lo = std::min(t.numel(), rank * chunk);
          const int64_t len = std::min(chunk, t.numel() - lo);
          runs.emplace_back(lo, len);
          if (len > 0)
            for (auto& p : pieces_of(whole_view(n, t.shape()), lo, contiguous(narrow(reshape(t, {t.numel()}), 0, lo, len))))
              mine.push_back(p);
        }
      world->barrier()->wait();
      auto t0 = Clock::now();
      std::string step;
      if (layout == "full") {
        if (rank == 0) {
          io::NamedTensors params, optim;
          for (auto& [n, t] : state) (is_optimizer_state(n) ? optim : params).emplace_back(n, t);
          step = save_checkpoint(run.string(), 1, params, {}, optim, {{"step", 1}});
        }
        world->barrier()->wait();
      } else {
        step = save_sharded(run.string(), 1, mine, {{"step", 1}}, {}, *world);
      }
      const double save_s = max_over(*world, std::chrono::duration<double>(Clock::now() - t0).count());
      // What this rank wrote.
      int64_t files = 0, bytes = 0;
      if (layout == "full") {
        if (rank == 0) bytes = dir_bytes(step, &files);
      } else {
        char name[40];
        std::snprintf(name, sizeof name, "rank_%05d.safetensors", rank);
        bytes = int64_t(fs::file_size(fs::path(step) / name));
        files = 1 + (rank == 0);  // + index.json
        if (rank == 0) bytes += int64_t(fs::file_size(fs::path(step) / "index.json"));
      }
      const double max_files = max_over(*world, double(files)), all = sum_over(*world, double(bytes));
      const double other = max_over(*world, rank == 0 ? 0.0 : double(bytes));
      // Load back into the same layout (full: every rank reads everything, as train does today).
      world->barrier()->wait();
      t0 = Clock::now();
      {
        auto c = open_checkpoint(run.string());
        if (layout == "full" || layout == "ddp") {
          for (auto& [n, t] : state) (void)c->tensor(n);
        } else if (layout == "zero3") {
          for (size_t i = 0; i < state.size(); ++i) {
            Tensor out = zeros({runs[i].second});
            read_local(*c, whole_view(state[i].first, state[i].second.shape()), runs[i].first, out);
          }
        } else {
          for (const auto& v : views) {
            Tensor local = zeros(v.local_shape);
            read_local(*c, v, local);
          }
        }
      }
      const double load_s = max_over(*world, std::chrono::duration<double>(Clock::now() - t0).count());
      if (rank == 0)
        std::printf("| %s | %.0f | %.2f / %.2f | %.2f | %.3f | %.3f |\n", layout.c_str(), max_files,
                    double(bytes) / 1e6, other / 1e6, all / 1e6, save_s, load_s);
      std::fflush(stdout);
    }
    world->barrier()->wait();
    if (rank == 0) fs::remove_all(root);
  }
  comm::finalize();
  MPI_Finalize();
  return 0;
}

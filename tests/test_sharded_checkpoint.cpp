// Sharded checkpoints: ranks (simulated in one process) write their pieces, rank 0 commits the
// index; any other layout reads them back; corrupt, truncated and edited checkpoints are refused
// by name; a crash before the manifest leaves the previous checkpoint in place.
#include "tests/catch.h"
#include <filesystem>
#include <fstream>
#include <numeric>
#include <nlohmann/json.hpp>
#include <sstream>

#include "autograd/ops.h"
#include "io/file.h"
#include "models/gpt.h"
#include "parallel/checkpoint.h"
#include "parallel/sharded_checkpoint.h"
#include "parallel/watchdog.h"

using namespace sg;
using namespace sg::ckpt;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

struct Dir {
  fs::path p = fs::temp_directory_path() / ("sg_sharded_" + std::to_string(::getpid()));
  Dir() { fs::remove_all(p); }
  ~Dir() { fs::remove_all(p); }
};

Tensor numbered(const Shape& s, float base) {
  const int64_t n = std::accumulate(s.begin(), s.end(), int64_t(1), std::multiplies<>());
  return reshape(add(to(arange(n), DType::f32), full({n}, base)), s);
}
bool same(const Tensor& a, const Tensor& b) { return a.shape() == b.shape() && to_vector<float>(a) == to_vector<float>(b); }

// A small model state in global names and layouts: a c_attn-like weight (3 blocks along dim 0),
// a row-parallel weight (split along dim 1), wte, a bias, and an optimizer moment.
std::map<std::string, Tensor> global_state(float base) {
  return {{"h.0.attn.c_attn.weight", numbered({12, 4}, base)},
          {"h.0.mlp.c_proj.weight", numbered({4, 8}, base + 100)},
          {"wte.weight", numbered({10, 4}, base + 200)},
          {"h.0.ln_1.bias", numbered({4}, base + 300)},
          {"h.0.attn.c_attn.weight.exp_avg", numbered({12, 4}, base + 400)}};
}

LocalView tp_view(const std::string& name, const Shape& g, int rank, int size) {
  if (name.rfind("h.0.attn.c_attn.weight", 0) == 0) return split_view(name, g, 0, 3, rank, size);
  if (name == "h.0.mlp.c_proj.weight") return split_view(name, g, 1, 1, rank, size);
  if (name == "wte.weight") return split_view(name, g, 0, 1, rank, size);
  return whole_view(name, g);
}

// Tensor parallelism over `size` ranks: every rank its tp pieces; replicated tensors from rank 0.
std::vector<std::vector<Piece>> tp_pieces(const std::map<std::string, Tensor>& g, int size) {
  std::vector<std::vector<Piece>> out(static_cast<size_t>(size));
  MemorySource src(g);
  for (int r = 0; r < size; ++r)
    for (const auto& [name, t] : g) {
      LocalView v = tp_view(name, t.shape(), r, size);
      if (v.parts.size() == 1 && v.local_shape == t.shape() && r != 0) continue;  // replicated: saved once
      Tensor local = zeros(v.local_shape);
      read_local(src, v, local);
      for (auto& p : pieces_of(v, local)) out[size_t(r)].push_back(p);
    }
  return out;
}

// ZeRO-3-like: each tensor's flat elements cut into `size` uneven runs, one per rank.
std::vector<std::vector<Piece>> flat_pieces(const std::map<std::string, Tensor>& g, int size) {
  std::vector<std::vector<Piece>> out(static_cast<size_t>(size));
  for (const auto& [name, t] : g) {
    LocalView v = whole_view(name, t.shape());
    Tensor flat = reshape(t, {t.numel()});
    int64_t lo = 0;
    for (int r = 0; r < size; ++r) {
      const int64_t n = r == size - 1 ? t.numel() - lo : std::min(t.numel() - lo, t.numel() / size + 1);
      for (auto& p : pieces_of(v, lo, contiguous(narrow(flat, 0, lo, n)))) out[size_t(r)].push_back(p);
      lo += n;
    }
  }
  return out;
}

std::string save_ranks(const fs::path& run, int64_t step, const std::vector<std::vector<Piece>>& ranks, int keep = 0) {
  for (size_t r = 0; r < ranks.size(); ++r) write_rank_shard(run.string(), step, int(r), ranks[r]);
  return commit_sharded(run.string(), step, int(ranks.size()), {{"step", step}, {"train_position", 7 * step}},
                        {{"n_head", "2"}}, keep);
}

std::string read_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

TEST_CASE("sharded checkpoints saved under tp on 2 ranks and flat shards on 4 read back into other layouts", "[ckpt]") {
  Dir d;
  auto g1 = global_state(0), g2 = global_state(1000);
  const std::string s1 = save_ranks(d.p, 1, tp_pieces(g1, 2));
  const std::string s2 = save_ranks(d.p, 2, flat_pieces(g2, 4));
  REQUIRE(fs::exists(fs::path(s1) / "rank_00001.safetensors"));
  REQUIRE(fs::exists(fs::path(s2) / "rank_00003.safetensors"));
  REQUIRE_FALSE(fs::exists(fs::path(s2) / "rank_00000.pieces.json"));  // piece lists are merged into the index
  // The run's latest is step 2; step 1 by its directory.
  auto c2 = open_checkpoint(d.p.string());
  REQUIRE(c2->state()["step"] == 2);
  REQUIRE(c2->state()["train_position"] == 14);
  REQUIRE(c2->metadata().at("n_head") == "2");
  REQUIRE(c2->names().size() == g2.size());
  auto c1 = open_checkpoint(s1);
  // A tensor the checkpoint does not hold is named with the checkpoint's directory.
  Tensor none = zeros({2});
  CHECK_THROWS_WITH(read_local(*c1, whole_view("not.there", {2}), none),
                    Catch::Contains("tensor 'not.there' is missing from " + s1));
  // tp 2 -> whole tensors, and -> flat runs of 3 ranks.
  for (const auto& [name, t] : g1) {
    INFO(name);
    CHECK(same(c1->tensor(name), t));
    LocalView v = whole_view(name, t.shape());
    Tensor flat = reshape(t, {t.numel()});
    const int64_t lo = t.numel() / 3, n = t.numel() / 3;
    Tensor run = zeros({n});
    read_local(*c1, v, lo, run);
    CHECK(same(run, contiguous(narrow(flat, 0, lo, n))));
  }
  // flat 4 -> tp 2 and tp 4 (where the shapes split).
  MemorySource want(g2);
  for (int size : {2, 4}) {
    for (int r = 0; r < size; ++r)
      for (const auto& [name, t] : g2) {
        if (name.rfind("h.0.attn.c_attn.weight", 0) == 0 && size == 4) continue;  // 12 rows: not 3 x 4
        if (name == "wte.weight" && size == 4) continue;
        INFO(name << " rank " << r << " of " << size);
        LocalView v = tp_view(name, t.shape(), r, size);
        Tensor got = zeros(v.local_shape), expect = zeros(v.local_shape);
        read_local(*c2, v, got);
        read_local(want, v, expect);
        CHECK(same(got, expect));
      }
  }
}

TEST_CASE("an empty tensor round-trips: named in the index with no bytes, read back with its shape", "[ckpt]") {
  Dir d;
  const Tensor w = reshape(to(arange(6), DType::f32), {2, 3});
  const Tensor e = zeros({0, 4});
  // rank 0 holds w and e (no elements), rank 1 an empty run of w as a flat shard might.
  std::vector<Piece> r0 = pieces_of(whole_view("w", w.shape()), w);
  for (auto& p : pieces_of(whole_view("e", e.shape()), e)) r0.push_back(p);
  const std::string step = save_ranks(d.p, 1, {r0, pieces_of(whole_view("w", w.shape()), 6, zeros({0}))});
  auto c = open_checkpoint(step);
  REQUIRE(c->has("e"));
  CHECK(c->shape("e") == Shape{0, 4});
  CHECK(c->tensor("e").shape() == Shape{0, 4});
  Tensor local = zeros({0, 4});
  read_local(*c, whole_view("e", {0, 4}), local);
  CHECK(same(c->tensor("w"), w));
}

TEST_CASE("the commit refuses pieces that overlap or leave gaps, naming the tensor", "[ckpt]") {
  Dir d;
  auto g = global_state(0);
  auto ranks = tp_pieces(g, 2);
  // Both replicas saving the replicated bias: its elements would be written twice.
  ranks[1].push_back(pieces_of(whole_view("h.0.ln_1.bias", {4}), g.at("h.0.ln_1.bias"))[0]);
  REQUIRE_THROWS_WITH(save_ranks(d.p, 1, ranks), Catch::Contains("'h.0.ln_1.bias'") && Catch::Contains("overlaps"));
  REQUIRE_FALSE(fs::exists(d.p / "step_00000001"));
  // A rank that lost its last piece of wte.
  ranks = tp_pieces(g, 2);
  for (auto it = ranks[1].begin(); it != ranks[1].end(); ++it)
    if (it->name == "wte.weight") {
      ranks[1].erase(it);
      break;
    }
  REQUIRE_THROWS_WITH(save_ranks(d.p, 1, ranks), Catch::Contains("'wte.weight'") && Catch::Contains("cover 20 of 40"));
  // A rank that did not write at all.
  ranks = tp_pieces(g, 2);
  write_rank_shard(d.p.string(), 3, 0, ranks[0]);
  REQUIRE_THROWS_WITH(commit_sharded(d.p.string(), 3, 2, json::object(), {}), Catch::Contains("rank 1 did not write"));
}

TEST_CASE("a corrupt, truncated or replaced shard file is refused naming the tensor and the file", "[ckpt]") {
  Dir d;
  auto g = global_state(0);
  const fs::path step = save_ranks(d.p, 1, tp_pieces(g, 2));
  const fs::path f1 = step / "rank_00001.safetensors";
  const std::string good = read_text(f1);
  // One flipped byte in the last piece's data.
  {
    std::string bad = good;
    bad[bad.size() - 2] = char(bad[bad.size() - 2] ^ 0x01);
    std::ofstream(f1, std::ios::binary | std::ios::trunc) << bad;
  }
  auto c = open_checkpoint(step.string());  // the index is fine; data is checked when read
  bool refused = false;
  for (const auto& name : c->names()) {
    try {
      (void)c->tensor(name);
    } catch (const Error& e) {
      const std::string msg = e.what();
      CHECK_THAT(msg, Catch::Contains("'" + name + "'") && Catch::Contains("rank_00001.safetensors") &&
                          Catch::Contains("fails its checksum"));
      refused = true;
    }
  }
  CHECK(refused);
  // Truncated.
  std::ofstream(f1, std::ios::binary | std::ios::trunc) << good.substr(0, good.size() - 5);
  c = open_checkpoint(step.string());
  CHECK_THROWS_WITH(c->tensor("wte.weight"), Catch::Contains("'wte.weight'") && Catch::Contains("rank_00001.safetensors") &&
                                                 Catch::Contains("truncated"));
  // Missing.
  fs::remove(f1);
  c = open_checkpoint(step.string());
  CHECK_THROWS_WITH(c->tensor("wte.weight"), Catch::Contains("rank_00001.safetensors"));
  // Rank 0's file where rank 1's belongs: the sizes differ (or, if equal, the checksums).
  fs::copy_file(step / "rank_00000.safetensors", f1);
  c = open_checkpoint(step.string());
  CHECK_THROWS_WITH(c->tensor("wte.weight"), Catch::Contains("rank_00001.safetensors"));
  // Untouched tensors still read: only the files a tensor needs are opened.
  std::ofstream(f1, std::ios::binary | std::ios::trunc) << good;
  CHECK(same(open_checkpoint(step.string())->tensor("h.0.ln_1.bias"), g.at("h.0.ln_1.bias")));
}

TEST_CASE("an edited index is refused: escaping paths, bad boxes, gaps, overlaps, unknown dtypes", "[ckpt]") {
  Dir d;
  const fs::path step = save_ranks(d.p, 1, tp_pieces(global_state(0), 2));
  const json index = json::parse(read_text(step / "index.json"));
  auto refused = [&](const std::function<void(json&)>& edit, const std::string& text) {
    json j = index;
    edit(j);
    std::ofstream(step / "index.json", std::ios::trunc) << j.dump();
    INFO(text);
    CHECK_THROWS_WITH(ShardedCheckpoint(step.string()), Catch::Contains(text));
  };
  const std::string w = "wte.weight";
  refused([&](json& j) { j["tensors"][w]["pieces"][0]["file"] = "../../etc/passwd.safetensors"; }, "is not listed");
  refused([&](json& j) { j["files"]["../x.safetensors"] = {{"bytes", 8}}; }, "'../x.safetensors' is not a plain");
  refused([&](json& j) { j["files"]["/tmp/x.safetensors"] = {{"bytes", 8}}; }, "is not a plain");
  refused([&](json& j) { j["tensors"][w]["pieces"][0]["offset"] = {9, 0}; }, "does not fit");
  refused([&](json& j) { j["tensors"][w]["pieces"][0]["box"] = {5, 4, 1}; }, "a box of rank 3");
  refused([&](json& j) { j["tensors"][w]["pieces"][0]["offset"] = {5, 0}; }, "'wte.weight'");  // both halves at row 5
  refused([&](json& j) { j["tensors"][w]["pieces"].erase(0); }, "cover 20 of 40");
  refused([&](json& j) { j["tensors"][w]["dtype"] = "F8"; }, "unknown dtype \"F8\"");
  refused([&](json& j) { j["tensors"][w]["shape"] = {10, 4, 1}; }, "a box of rank 2");
  refused([&](json& j) { j["tensors"][w]["pieces"][0]["numel"] = 21; }, "not inside its box");
  refused([&](json& j) { j["tensors"][w]["pieces"][0]["data_offsets"] = {0, 1u << 30}; }, "lie outside");
  refused([&](json& j) { j["tensors"][w]["pieces"][0]["checksum"] = 7; }, "checksum");
  refused([&](json& j) { j["version"] = 2; }, "version 2");
  refused([&](json& j) { j["files"] = json::array(); }, "files is not an object");
  refused([&](json& j) {
    auto& p = j["tensors"]["h.0.ln_1.bias"]["pieces"][0];
    p["data_offsets"] = j["tensors"][w]["pieces"][0]["data_offsets"];
    p["file"] = j["tensors"][w]["pieces"][0]["file"];
    p["data_offsets"][1] = p["data_offsets"][0].get<int64_t>() + 16;
  }, "share bytes");
  std::ofstream(step / "index.json", std::ios::trunc) << "{\"format\": \"shardgrad-sharded\", ";
  CHECK_THROWS_WITH(ShardedCheckpoint(step.string()), Catch::Contains("index.json is not valid JSON"));
}

TEST_CASE("a crash before the manifest leaves the previous checkpoint latest and auto", "[ckpt]") {
  Dir d;
  save_ranks(d.p, 1, tp_pieces(global_state(0), 2));
  // Step 2: both ranks wrote their files, rank 0 died before index.json.
  auto ranks = tp_pieces(global_state(1000), 2);
  write_rank_shard(d.p.string(), 2, 0, ranks[0]);
  write_rank_shard(d.p.string(), 2, 1, ranks[1]);
  REQUIRE(open_checkpoint(d.p.string())->state()["step"] == 1);
  REQUIRE(open_checkpoint("auto:" + d.p.string())->state()["step"] == 1);
  // The same through the collective save with an injected fault after this rank's file (one rank,
  // so the barrier is a no-op): the throw leaves step 2 uncommitted.
  parallel::Fault f = parallel::parse_fault("rank=0,step=2,kind=throw,during=save");
  parallel::maybe_inject(f, 0, 2);  // arms it; nothing fires at the step itself
  auto all = flat_pieces(global_state(1000), 1);
  REQUIRE_THROWS_WITH(save_sharded(d.p.string(), 2, all[0], {{"step", 2}}, {}, 0, 1, [] {}), Catch::Contains("injected fault"));
  REQUIRE_FALSE(fs::exists(d.p / "step_00000002"));
  REQUIRE(open_checkpoint("auto:" + d.p.string())->state()["step"] == 1);
  // Retrying the step afterwards commits it over the leftovers (the larger world's rank 1 file goes).
  REQUIRE(fs::exists(d.p / ".tmp-step_00000002" / "rank_00001.safetensors"));
  const std::string s2 = save_sharded(d.p.string(), 2, all[0], {{"step", 2}}, {}, 0, 1, [] {}, 1);
  REQUIRE_FALSE(fs::exists(fs::path(s2) / "rank_00001.safetensors"));
  REQUIRE_FALSE(fs::exists(d.p / "step_00000001"));  // keep 1
  auto c = open_checkpoint("auto:" + d.p.string());
  REQUIRE(c->state()["step"] == 2);
  CHECK(same(c->tensor("wte.weight"), global_state(1000).at("wte.weight")));
}

TEST_CASE("open_checkpoint reads the full format as global tensors in shardgrad layouts", "[ckpt]") {
  Dir d;
  // What train's full save writes: Hugging Face layouts (Conv1D [in, out], wte of vocab rows) for
  // the model, live layouts (wte padded to 12 rows) for the optimizer state.
  Tensor w = numbered({12, 4}, 0), wte = numbered({10, 4}, 50), m = numbered({12, 4}, 500);
  io::NamedTensors model = {{"wte.weight", wte}, {"h.0.attn.c_attn.weight", contiguous(transpose(w, 0, 1))}};
  io::NamedTensors optim = {{"h.0.attn.c_attn.weight.exp_avg", w}, {"wte.weight.exp_avg", m}};
  save_checkpoint(d.p.string(), 4, model, {{"n_head", "2"}}, optim, {{"step", 4}});
  auto c = open_checkpoint("auto:" + d.p.string());
  CHECK(c->state()["step"] == 4);
  CHECK_FALSE(c->state().contains("checksums"));
  CHECK(c->metadata().at("n_head") == "2");
  CHECK(same(c->tensor("h.0.attn.c_attn.weight"), w));
  CHECK(same(c->tensor("wte.weight"), wte));
  CHECK(same(c->tensor("wte.weight.exp_avg"), contiguous(narrow(m, 0, 0, 10))));
  // A tp-2 rank's piece of c_attn from the full checkpoint.
  LocalView v = split_view("h.0.attn.c_attn.weight", {12, 4}, 0, 3, 1, 2);
  Tensor got = zeros(v.local_shape), expect = zeros(v.local_shape);
  read_local(*c, v, got);
  read_local(MemorySource({{"h.0.attn.c_attn.weight", w}}), v, expect);
  CHECK(same(got, expect));
  // load_checkpoint (the full reader) refuses a sharded directory, pointing at open_checkpoint.
  const std::string s = save_ranks(d.p / "sharded", 1, tp_pieces(global_state(0), 2));
  CHECK_THROWS_WITH(load_checkpoint(s), Catch::Contains("open_checkpoint"));
}

TEST_CASE("export consolidates a sharded checkpoint into one Hugging Face file that --init-from reads", "[ckpt][cli]") {
  Dir d;
  nn::GPTConfig cfg;
  cfg.n_layer = 1;
  cfg.n_head = 2;
  cfg.n_embd = 16;
  cfg.block_size = 16;  // one 3-digit addition problem is 13 tokens
  cfg.vocab_size = 13;  // padded to 64 rows in the live model; 13 in the checkpoint
  nn::GPT model(cfg);
  model.init_weights(5);
  // Saved as four flat shards (ZeRO-3-like) of every parameter and an optimizer moment.
  std::vector<std::vector<Piece>> ranks(4);
  for (auto& [name, p] : model.named_parameters()) {
    LocalView v = gpt_param_view(name, p.shape(), cfg.vocab_size);
    for (const LocalView& w : {v, renamed(v, name + ".exp_avg")}) {
      Tensor flat = reshape(contiguous(p), {p.numel()});
      const int64_t chunk = (p.numel() + 3) / 4;
      for (int r = 0; r < 4; ++r) {
        const int64_t lo = std::min(p.numel(), r * chunk), n = std::min(chunk, p.numel() - lo);
        if (n > 0)
          for (auto& piece : pieces_of(w, lo, contiguous(narrow(flat, 0, lo, n)))) ranks[size_t(r)].push_back(piece);
      }
    }
  }
  for (size_t r = 0; r < ranks.size(); ++r) write_rank_shard(d.p.string(), 3, int(r), ranks[r]);
  commit_sharded(d.p.string(), 3, 4, {{"step", 3}},
                 {{"n_head", "2"}, {"padded_vocab", std::to_string(cfg.vocab_rows())}, {"format", "shardgrad-gpt2"}});
  const fs::path out = d.p / "exported" / "model.safetensors";  // export makes the folder
  const std::string cmd = std::string(SG_BINARY) + " export " + d.p.string() + " --out " + out.string();
  REQUIRE(std::system((cmd + " > /dev/null").c_str()) == 0);
  io::SafetensorsFile f = io::load_safetensors(out.string());
  CHECK(f.order.size() == model.named_parameters().size());  // no optimizer state
  CHECK(f.at("h.0.attn.c_attn.weight").shape() == Shape{16, 48});  // Conv1D [in, out]
  CHECK(f.at("wte.weight").shape() == Shape{13, 16});
  // What transformers' GPT2LMHeadModel.from_pretrained(folder) needs: format "pt" (its safetensors
  // loader refuses other formats) and config.json beside the file.
  CHECK(f.metadata.at("format") == "pt");
  CHECK(f.metadata.at("n_head") == "2");
  const fs::path config = out.parent_path() / "config.json";
  REQUIRE(fs::exists(config));
  const auto j = nlohmann::json::parse(io::read_file(config.string(), "test"));
  CHECK(j.at("model_type") == "gpt2");
  CHECK(j.at("n_layer") == 1);
  CHECK(j.at("n_head") == 2);
  CHECK(j.at("n_embd") == 16);
  CHECK(j.at("n_positions") == 16);
  CHECK(j.at("vocab_size") == 13);
  CHECK(j.at("activation_function") == "gelu_new");  // GELU's tanh form
  CHECK(j.at("eos_token_id").is_null());  // 13 rows: no <|endoftext|> (transformers' default is 50256)
  CHECK(j.at("bos_token_id").is_null());
  nn::GPT back(nn::config_from_hf(f));
  nn::load_hf_state(back, f);
  auto a = model.named_parameters(), b = back.named_parameters();
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].first);
    CHECK(same(a[i].second, b[i].second));
  }
  // The file is refused as an export target a second time; a second file in the folder keeps the
  // same model's config.json, another model's is refused; train starts from the file.
  CHECK(std::system((cmd + " > /dev/null 2>&1").c_str()) != 0);
  {
    const std::string again = std::string(SG_BINARY) + " export " + d.p.string() + " --out " +
                              (out.parent_path() / "second.safetensors").string();
    REQUIRE(std::system((again + " > /dev/null").c_str()) == 0);  // the same model's config: kept
    // ... also with keys of its own, as transformers' save_pretrained writes them
    nlohmann::json own = nlohmann::json::parse(io::read_file(config.string(), "test"));
    own["torch_dtype"] = "float32";
    own["transformers_version"] = "4.40.0";
    own["n_inner"] = nullptr;
    std::ofstream(config) << own.dump(2);
    const std::string fourth = std::string(SG_BINARY) + " export " + d.p.string() + " --out " +
                               (out.parent_path() / "fourth.safetensors").string();
    REQUIRE(std::system((fourth + " > /dev/null").c_str()) == 0);
    CHECK(nlohmann::json::parse(io::read_file(config.string(), "test")) == own);
    // a config.json of another model is refused before anything is written
    std::ofstream(config) << "{\"n_head\": 12}";
    const fs::path third = out.parent_path() / "third.safetensors";
    const std::string other = std::string(SG_BINARY) + " export " + d.p.string() + " --out " + third.string();
    CHECK(std::system((other + " > /dev/null 2>&1").c_str()) != 0);
    CHECK(!fs::exists(third));
    CHECK(io::read_file(config.string(), "test") == "{\"n_head\": 12}");
  }
  const std::string train = std::string(SG_BINARY) + " train --init-from " + out.string() +
                            " --steps 1 --seq-len 16 --batch-size 2 --threads 1 --eval-every 0 --eval-batches 1 "
                            "--eval-problems 2";
  INFO(train);
  // read back beside that other model's config.json: refused, naming it (the file records 2 heads)
  const fs::path said = d.p / "said.txt";
  CHECK(std::system((train + " > " + said.string() + " 2>&1").c_str()) != 0);
  CHECK(io::read_file(said.string(), "test").find("config.json: \"n_head\" is 12 but " + out.string() +
                                                  " (its metadata) records 2") != std::string::npos);
  fs::remove(out.parent_path() / "config.json");
  CHECK(std::system((train + " > /dev/null 2>&1").c_str()) == 0);
}

TEST_CASE("the fuzz seed corpus of the index reader: good seeds load, bad ones are refused", "[ckpt]") {
  // The rank file the fuzz target (tests/fuzz/sharded_index.cpp) writes: F32 [4] = 1, 2, 3, 4.
  Dir d;
  fs::create_directories(d.p);
  std::string header = R"({"w#0":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  const uint64_t n = header.size();
  const float values[4] = {1, 2, 3, 4};
  {
    std::ofstream f(d.p / "rank_00000.safetensors", std::ios::binary);
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << header;
    f.write(reinterpret_cast<const char*>(values), sizeof values);
  }
  const fs::path corpus = fs::path(SG_SOURCE_DIR) / "tests" / "fuzz" / "corpus" / "sharded_index";
  for (const char* good : {"good", "two_boxes"}) {
    INFO(good);
    fs::copy_file(corpus / good, d.p / "index.json", fs::copy_options::overwrite_existing);
    CHECK(same(ShardedCheckpoint(d.p.string()).tensor("w"), from_vector<float>({1, 2, 3, 4}, {2, 2})));
  }
  fs::copy_file(corpus / "escape", d.p / "index.json", fs::copy_options::overwrite_existing);
  CHECK_THROWS_WITH(ShardedCheckpoint(d.p.string()), Catch::Contains("is not a plain"));
  fs::copy_file(corpus / "gap", d.p / "index.json", fs::copy_options::overwrite_existing);
  CHECK_THROWS_WITH(ShardedCheckpoint(d.p.string()), Catch::Contains("are in no piece"));
  // 2^62 f32 elements: 2^64 bytes, which wrapped to 0 and passed as an empty piece (then a crash)
  fs::copy_file(corpus / "overflow", d.p / "index.json", fs::copy_options::overwrite_existing);
  CHECK_THROWS_WITH(ShardedCheckpoint(d.p.string()), Catch::Contains("[4611686018427387904] F32 is more bytes than a file can hold"));
}

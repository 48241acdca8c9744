// GPT-2 models: structure, init, Hugging Face names, padded vocabulary, recompute, and the
// golden test against PyTorch (tests/golden/make_gpt_golden.py wrote the reference).
#include "tests/catch.h"
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <unistd.h>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "io/safetensors.h"
#include "models/gpt.h"
#include "optim/optim.h"
#include "tests/support.h"

using namespace sg;
using testing::loss_and_grads;

namespace {

nn::GPTConfig small_config(int64_t padded = 0) {
  nn::GPTConfig c;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 32;
  c.block_size = 16;
  c.vocab_size = 61;
  c.padded_vocab = padded;
  return c;
}

}  // namespace

TEST_CASE("the vocabulary is padded to a multiple of 64 that tp divides", "[models]") {
  CHECK(nn::padded_vocab_rows(61) == 64);
  CHECK(nn::padded_vocab_rows(64) == 64);
  CHECK(nn::padded_vocab_rows(50257) == 50304);
  CHECK(nn::padded_vocab_rows(50257, 8) == 50304);  // powers of two up to 64: the same rows
  CHECK(nn::padded_vocab_rows(256, 3) == 384);       // a multiple of 192
  CHECK(nn::padded_vocab_rows(50257, 3) == 50304);   // 192 x 262
  CHECK(nn::padded_vocab_rows(256, 128) == 256);
  CHECK(nn::padded_vocab_rows(257, 128) == 384);
  nn::GPTConfig c = small_config();
  c.tp = 3, c.n_head = 3, c.n_embd = 48;
  CHECK(c.vocab_rows() == 192);
  c.padded_vocab = 64;  // a recorded padding, split 3 ways
  CHECK(c.vocab_rows() == 66);
  CHECK_NOTHROW(c.validate());
}

namespace {

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b, double floor = 1e-3) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(double(a[i]) - b[i]) / std::max(floor, std::abs(double(b[i]))));
  return m;
}

std::string golden_path() { return std::string(SG_SOURCE_DIR) + "/tests/golden/gpt_tiny.safetensors"; }

// The golden file's initial weights alone (it also holds inputs and expected values).
io::SafetensorsFile golden_weights(const io::SafetensorsFile& g) {
  io::SafetensorsFile w = g;
  for (const char* pre : {"input.", "expected.", "grad.", "adamw.", "after_adamw."})
    for (auto it = w.tensors.begin(); it != w.tensors.end();)
      it = it->first.rfind(pre, 0) == 0 ? w.tensors.erase(it) : std::next(it);
  return w;
}

}  // namespace

TEST_CASE("GPT parameters carry the Hugging Face GPT-2 names in registration order", "[models]") {
  nn::GPT m(small_config());
  auto names = m.named_parameters();
  REQUIRE(names.front().first == "wte.weight");
  REQUIRE(names[1].first == "wpe.weight");
  REQUIRE(names[2].first == "h.0.ln_1.weight");
  REQUIRE(names[4].first == "h.0.attn.c_attn.weight");
  REQUIRE(names.back().first == "ln_f.bias");
  REQUIRE(names.size() == 2 + 2 * 12 + 2);
  REQUIRE(m.num_parameters() == m.config.num_params());
  // the names from the config alone (what a checkpoint's resume holds its tensors to) are the model's
  for (int64_t layers : {1, 2, 3}) {
    nn::GPTConfig c = small_config();
    c.n_layer = layers;
    std::vector<std::string> built;
    for (auto& [n, p] : nn::GPT(c).named_parameters()) built.push_back(n);
    REQUIRE(nn::gpt_parameter_names(c) == built);
  }
}

TEST_CASE("GPT-2 124M preset has 124,475,904 parameters with the vocabulary padded to 50304", "[models]") {
  nn::GPTConfig c = nn::gpt_preset("gpt2");
  REQUIRE(c.vocab_rows() == 50304);
  REQUIRE(c.num_params() == 124475904);
  REQUIRE_THROWS_WITH(nn::gpt_preset("gpt3"), Catch::Contains("unknown preset 'gpt3'"));
  nn::GPTConfig bad = small_config();
  bad.n_head = 5;
  REQUIRE_THROWS_WITH(bad.validate(), Catch::Contains("n_embd 32 is not divisible by n_head 5"));
}

TEST_CASE("GPT-2 init: seeded, N(0, 0.02) weights, scaled residual projections, zero padded rows", "[models]") {
  nn::GPT a(small_config()), b(small_config(128));
  a.init_weights(7);
  b.init_weights(7);
  // the real vocabulary rows do not depend on how far the vocabulary is padded
  auto wa = to_vector<float>(a.wte->weight), wb = to_vector<float>(narrow(b.wte->weight, 0, 0, 64));
  REQUIRE(std::vector<float>(wa.begin(), wa.begin() + 61 * 32) == std::vector<float>(wb.begin(), wb.begin() + 61 * 32));
  auto pad = to_vector<float>(narrow(b.wte->weight, 0, 61, 128 - 61));
  for (float v : pad) REQUIRE(v == 0.0f);
  auto stddev = [](const Tensor& t) { return std::sqrt(sum_squares(t) / double(t.numel())); };
  REQUIRE(stddev(a.h[0]->mlp->c_fc->weight) == Approx(0.02).epsilon(0.1));
  REQUIRE(stddev(a.h[0]->mlp->c_proj->weight) == Approx(0.02 / std::sqrt(4.0)).epsilon(0.1));
  REQUIRE(item(sum(a.h[1]->ln_2->weight)) == 32.0);
  REQUIRE(sum_squares(a.h[1]->attn->c_attn->bias) == 0.0);
}

// What a pipeline rank does (cli: train --pp): build on meta, give memory to some parameters,
// initialise. The materialised parameters get the values of a model built whole; the others keep
// no memory; the ledger holds only what was materialised.
TEST_CASE("a GPT built on meta and materialised in part initialises those parameters as a whole model does", "[models]") {
  const Device staging = Device::meta(77);
  const int64_t before = Ledger::global().stats(Device::cpu()).cur(MemCategory::param);
  nn::GPT whole(small_config(128));
  whole.init_weights(7);
  const int64_t whole_bytes = Ledger::global().stats(Device::cpu()).cur(MemCategory::param) - before;
  nn::GPT part(small_config(128), DType::f32, staging);
  int64_t kept = 0;
  for (auto& [n, p] : part.named_parameters())
    if (n.rfind("h.1.", 0) == 0 || n == "wte.weight") {
      nn::materialize(p, Device::cpu());
      kept += int64_t(p.nbytes());
    }
  CHECK(Ledger::global().stats(Device::cpu()).cur(MemCategory::param) - before == whole_bytes + kept);
  part.init_weights(7);
  const auto want = whole.named_parameters();
  const auto got = part.named_parameters();
  REQUIRE(want.size() == got.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO(got[i].first);
    CHECK(got[i].second.shape() == want[i].second.shape());
    CHECK(got[i].second.requires_grad());
    if (got[i].second.device().is_cpu())
      CHECK(to_vector<float>(got[i].second) == to_vector<float>(want[i].second));
    else
      CHECK(got[i].second.device() == staging);
  }
  REQUIRE_THROWS_WITH(nn::materialize(whole.wte->weight, Device::cpu()), Catch::Contains("is not on a meta device"));
  Tensor on_meta = zeros({4, 8}, DType::f32, staging);
  REQUIRE_THROWS_WITH(nn::materialize(narrow(on_meta, 0, 1, 2), Device::cpu()), Catch::Contains("is a view into a larger storage"));
}

TEST_CASE("a GPT materialised in part reads from a Hugging Face file the tensors it holds, and only those", "[models]") {
  nn::GPT whole(small_config());
  whole.init_weights(11);
  const std::string path =
      (std::filesystem::temp_directory_path() / ("sg_models_part_" + std::to_string(::getpid()) + ".safetensors")).string();
  io::NamedTensors sd;
  for (auto& [n, t] : nn::hf_state_dict(whole)) sd.emplace_back("transformer." + n, t);
  sd.emplace_back("lm_head.weight", sd[0].second);  // the tied head, as some files carry it
  // A damaged tensor of a layer this model does not hold: never read, so it cannot stop the load.
  for (auto& [n, t] : sd)
    if (n == "transformer.h.0.mlp.c_fc.weight") t = full(t.shape(), std::numeric_limits<double>::quiet_NaN());
  io::save_safetensors(path, sd, {{"n_head", "4"}});
  const Device staging = Device::meta(78);
  nn::GPT part(small_config(), DType::f32, staging);
  for (auto& [n, p] : part.named_parameters())
    if (n.rfind("h.1.", 0) == 0 || n == "wte.weight" || n.rfind("ln_f.", 0) == 0) nn::materialize(p, Device::cpu());
  const io::SafetensorsFile f = io::load_safetensors(path, nn::hf_tensors_held(part));
  for (const auto& [n, t] : f.tensors) {
    INFO(n);
    const bool held = n.find("h.1.") != std::string::npos || n.find("wte.") != std::string::npos ||
                      n.find("ln_f.") != std::string::npos || n == "lm_head.weight";
    CHECK(t.device().is_cpu() == held);
  }
  nn::load_hf_state(part, f);
  const auto want = whole.named_parameters();
  const auto got = part.named_parameters();
  REQUIRE(want.size() == got.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO(got[i].first);
    if (got[i].second.device().is_cpu()) CHECK(to_vector<float>(got[i].second) == to_vector<float>(want[i].second));
  }
  // The whole model needs the damaged tensor: it is read, and refused.
  nn::GPT all(small_config());
  REQUIRE_THROWS_WITH(nn::load_hf_state(all, io::load_safetensors(path, nn::hf_tensors_held(all))),
                      Catch::Contains("'h.0.mlp.c_fc.weight' holds a non-finite value"));
  // A file read without a tensor the model holds is refused, not left at its initial values.
  REQUIRE_THROWS_WITH(nn::load_hf_state(all, io::load_safetensors(path, [](const std::string&) { return false; })),
                      Catch::Contains("'wte.weight' was not read, but the model holds it on cpu"));
  std::filesystem::remove(path);
}

TEST_CASE("a padded vocabulary changes no logit, loss or gradient", "[models]") {
  nn::GPT a(small_config(61)), b(small_config(128));
  a.init_weights(3);
  b.init_weights(3);
  Tensor idx = from_vector<int64_t>({1, 5, 60, 7, 0, 33, 2, 2, 9, 14, 59, 3}, {2, 6});
  Tensor tgt = from_vector<int64_t>({5, 60, 7, 0, 33, -1, 2, 9, 14, 59, 3, 8}, {2, 6});
  double la = loss_and_grads(a, idx, tgt), lb = loss_and_grads(b, idx, tgt);
  REQUIRE(la == Approx(lb).epsilon(1e-6));
  auto pa = a.named_parameters(), pb = b.named_parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    INFO(pa[i].first);
    Tensor gb = pb[i].first == "wte.weight" ? narrow(pb[i].second.grad(), 0, 0, 61) : pb[i].second.grad();
    REQUIRE(max_rel_diff(to_vector<float>(pa[i].second.grad()), to_vector<float>(gb)) < 1e-4);
  }
  auto padgrad = to_vector<float>(narrow(pb[0].second.grad(), 0, 61, 128 - 61));
  for (float v : padgrad) REQUIRE(v == 0.0f);
}

TEST_CASE("activation recompute (selective and full) leaves loss and gradients unchanged", "[models]") {
  nn::GPTConfig c = small_config();
  c.dropout = 0.1;  // masks must replay exactly in the re-run
  Tensor idx = from_vector<int64_t>({1, 5, 60, 7, 0, 33, 2, 2, 9, 14, 59, 3}, {2, 6});
  Tensor tgt = from_vector<int64_t>({5, 60, 7, 0, 33, 4, 2, 9, 14, 59, 3, 8}, {2, 6});
  std::vector<double> losses;
  std::vector<std::vector<float>> grads;
  for (auto rc : {nn::Recompute::none, nn::Recompute::selective, nn::Recompute::full}) {
    nn::GPT m(c);
    m.init_weights(11);
    m.recompute = rc;
    dropout_generator() = DropoutGenerator::seeded(99, 0);
    losses.push_back(loss_and_grads(m, idx, tgt));
    grads.push_back(to_vector<float>(m.h[0]->attn->c_attn->weight.grad()));
  }
  REQUIRE(losses[1] == losses[0]);
  REQUIRE(losses[2] == losses[0]);
  REQUIRE(max_rel_diff(grads[1], grads[0]) < 1e-5);
  REQUIRE(max_rel_diff(grads[2], grads[0]) < 1e-5);
}

TEST_CASE("activation recompute holds fewer activation bytes after forward: full < selective < none (ledger)", "[models]") {
  nn::GPTConfig c = small_config();
  c.n_layer = 4;
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < 4 * 16; ++i) ids.push_back((i * 7 + 3) % 61);
  Tensor idx = from_vector(ids, {4, 16});
  std::vector<double> held;
  for (auto rc : {nn::Recompute::none, nn::Recompute::selective, nn::Recompute::full}) {
    nn::GPT m(c);
    m.init_weights(11);
    m.recompute = rc;
    const int64_t before = Ledger::global().stats(Device::cpu()).cur(MemCategory::activation);
    autograd::Tape t;
    Tensor l;
    {
      autograd::TapeScope s(t);
      l = m.loss(idx, idx);
    }
    held.push_back(double(Ledger::global().stats(Device::cpu()).cur(MemCategory::activation) - before));
    t.backward(l);
  }
  INFO("none " << held[0] << " selective " << held[1] << " full " << held[2]);
  REQUIRE(held[1] < held[0]);  // the attention core's probabilities and its inputs are not kept
  // full keeps only each block's input [B, T, C] (plus the embedding and head): well under half
  REQUIRE(held[2] < 0.5 * held[1]);
}

TEST_CASE("forward_cached: a prompt, then one token at a time, gives forward's logits at every position", "[models]") {
  nn::GPT m(small_config());
  m.init_weights(3);
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < 2 * 16; ++i) ids.push_back((i * 11 + 4) % 61);
  const Tensor idx = from_vector(ids, {2, 16});
  autograd::NoGradGuard ng;
  const Tensor full = m.forward(idx);  // [2, 16, V]
  nn::KVCache cache;
  const Tensor prompt = m.forward_cached(narrow(idx, 1, 0, 5), cache);
  REQUIRE(cache.len == 5);
  // the prompt is forward() of those 5 positions; against the 16-position run the GEMMs sum over
  // other row blockings, so the two agree to rounding (f32: ~1e-5 here, 1e-4 allowed; a wrong
  // position, key or value is off by far more)
  CHECK(max_rel_diff(to_vector<float>(prompt), to_vector<float>(m.forward(narrow(idx, 1, 0, 5)))) < 1e-6);
  CHECK(max_rel_diff(to_vector<float>(prompt), to_vector<float>(narrow(full, 1, 0, 5))) < 1e-4);
  for (int64_t t = 5; t < 16; ++t) {
    INFO("position " << t);
    const Tensor one = m.forward_cached(narrow(idx, 1, t, 1), cache);
    CHECK(max_rel_diff(to_vector<float>(one), to_vector<float>(narrow(full, 1, t, 1))) < 1e-4);
  }
  REQUIRE(cache.len == 16);
  REQUIRE(cache.k[1].shape() == Shape{2, 4, 16, 8});
  REQUIRE_THROWS_WITH(m.forward_cached(narrow(idx, 1, 0, 1), cache), Catch::Contains("positions up to 17 exceed block_size 16"));
  nn::KVCache some;
  m.forward_cached(narrow(idx, 1, 0, 3), some);
  REQUIRE_THROWS_WITH(m.forward_cached(narrow(idx, 1, 3, 2), some), Catch::Contains("2 new positions after 3 cached ones"));
}

TEST_CASE("a Hugging Face model folder's config.json gives the head count its safetensors file does not record, what disagrees with the tensors is refused, and metadata that is not a number is refused by name", "[models][io]") {
  nn::GPT a(small_config());
  a.init_weights(5);
  const auto dir = std::filesystem::temp_directory_path() / ("sg_models_hfdir_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "model.safetensors").string();
  io::save_safetensors(path, nn::hf_state_dict(a), {});  // no n_head in the metadata, as Hugging Face's files
  REQUIRE_THROWS_WITH(nn::config_from_hf(io::load_safetensors(path)), Catch::Contains("pass --n-head"));
  std::ofstream(dir / "config.json") << R"({"model_type": "gpt2", "n_head": 4, "n_layer": 2})";
  CHECK(nn::config_from_hf(io::load_safetensors(path)).n_head == 4);
  CHECK(nn::config_from_hf(io::load_safetensors(path), 2).n_head == 2);  // --n-head, when given, wins
  // a head count the width does not divide names the file and the flag
  REQUIRE_THROWS_WITH(nn::config_from_hf(io::load_safetensors(path), 3),
                      Catch::Contains(path + ": ") && Catch::Contains("(the head count given with --n-head?)"));
  // GPT-2's own settings pass; those that make another model are refused naming the key, not ignored
  std::ofstream(dir / "config.json")
      << R"({"n_head": 4, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-05, "n_inner": null})";
  CHECK(nn::config_from_hf(io::load_safetensors(path)).n_head == 4);
  for (const auto& [json, key] : std::vector<std::pair<std::string, std::string>>{
           {R"({"n_head": 4, "activation_function": "relu"})", "activation_function"},
           {R"({"n_head": 4, "layer_norm_epsilon": 0.1})", "layer_norm_epsilon"},
           {R"({"n_head": 4, "n_inner": 100})", "n_inner"},
           {R"({"n_head": 4, "scale_attn_by_inverse_layer_idx": true})", "scale_attn_by_inverse_layer_idx"}}) {
    std::ofstream(dir / "config.json") << json;
    REQUIRE_THROWS_WITH(nn::config_from_hf(io::load_safetensors(path)),
                        Catch::Contains("\"" + key + "\": ") && Catch::Contains("makes another model than this GPT-2"));
  }
  // the folder's description of its model must be JSON, and agree with the file's tensors and metadata
  std::ofstream(dir / "config.json") << "not json";
  REQUIRE_THROWS_WITH(nn::config_from_hf(io::load_safetensors(path)),
                      Catch::Contains((dir / "config.json").string() + " (beside " + path + ") is not a JSON object"));
  for (const auto& [json, said] : std::vector<std::pair<std::string, std::string>>{
           {R"({"n_head": 4, "n_positions": 32})", "'n_positions' is 32 but " + path + "'s wpe.weight rows has 16"},
           {R"({"n_head": 4, "n_ctx": 8})", "'n_ctx' is 8 but"},
           {R"({"n_head": 4, "n_layer": 3})", "'n_layer' is 3 but " + path + " has 2"},
           {R"({"n_head": 4, "n_embd": 64})", "'n_embd' is 64 but"},
           {R"({"n_head": 4, "vocab_size": 50257})", "'vocab_size' is 50257 but"},
           {R"({"n_head": "4"})", "\"n_head\": \"4\" is not a whole number"}}) {
    std::ofstream(dir / "config.json") << json;
    REQUIRE_THROWS_WITH(nn::config_from_hf(io::load_safetensors(path)), Catch::Contains(said));
  }
  std::ofstream(dir / "config.json") << R"({"n_head": 8, "n_positions": 16, "n_layer": 2, "n_embd": 32, "vocab_size": 61})";
  CHECK(nn::config_from_hf(io::load_safetensors(path)).n_head == 8);  // the shapes agree: config.json's heads
  io::save_safetensors(path, nn::hf_state_dict(a), {{"n_head", "4"}});
  REQUIRE_THROWS_WITH(nn::config_from_hf(io::load_safetensors(path)),
                      Catch::Contains("\"n_head\" is 8 but " + path + " (its metadata) records 4"));
  std::filesystem::remove(dir / "config.json");
  // the file's own metadata must agree with its tensors too (a wpe cut short loaded as a shorter context)
  for (const char* key : {"block_size", "n_layer", "n_embd"}) {
    io::save_safetensors(path, nn::hf_state_dict(a), {{"n_head", "4"}, {key, "128"}});
    REQUIRE_THROWS_WITH(nn::config_from_hf(io::load_safetensors(path)),
                        Catch::Contains(path + " (its metadata): '" + key + "' is 128 but ") &&
                            Catch::Contains("the file and what it records of its model disagree"));
  }
  // metadata that is not a number is refused naming the file and the key (std::stoll said "stoll")
  for (const char* key : {"n_head", "padded_vocab"}) {
    std::map<std::string, std::string> meta{{"n_head", "4"}};
    meta[key] = "four";
    io::save_safetensors(path, nn::hf_state_dict(a), meta);
    REQUIRE_THROWS_WITH(nn::config_from_hf(io::load_safetensors(path)),
                        Catch::Contains(path + ": metadata '" + key + "' is not a number: 'four'"));
  }
  io::save_safetensors(path, nn::hf_state_dict(a), {{"n_head", "4"}, {"padded_vocab", "64"}});
  CHECK(nn::config_from_hf(io::load_safetensors(path)).padded_vocab == 64);
  std::filesystem::remove_all(dir);
}

TEST_CASE("Hugging Face state round trip, with 'transformer.' prefix and mask buffers accepted", "[models][io]") {
  nn::GPT a(small_config());
  a.init_weights(5);
  io::NamedTensors sd = nn::hf_state_dict(a);
  REQUIRE(sd[0].second.shape() == Shape{61, 32});  // wte without the padded rows
  REQUIRE(sd[4].first == "h.0.attn.c_attn.weight");
  REQUIRE(sd[4].second.shape() == Shape{32, 96});  // Conv1D [in, out]
  io::NamedTensors prefixed;
  for (auto& [n, t] : sd) prefixed.emplace_back("transformer." + n, t);
  prefixed.emplace_back("transformer.h.0.attn.bias", ones({1, 1, 16, 16}));
  auto path = (std::filesystem::temp_directory_path() / "sg_models_roundtrip.safetensors").string();
  io::save_safetensors(path, prefixed, {{"n_head", "4"}});
  io::SafetensorsFile f = io::load_safetensors(path);
  nn::GPTConfig c = nn::config_from_hf(f);
  REQUIRE(c.n_layer == 2);
  REQUIRE(c.vocab_size == 61);
  nn::GPT b(c);
  nn::load_hf_state(b, f);
  Tensor idx = from_vector<int64_t>({3, 4, 5}, {1, 3});
  REQUIRE(to_vector<float>(a.forward(idx)) == to_vector<float>(b.forward(idx)));
  // a missing tensor is named
  io::NamedTensors missing(sd.begin() + 1, sd.end());
  io::save_safetensors(path, missing);
  REQUIRE_THROWS_WITH(nn::load_hf_state(b, io::load_safetensors(path)), Catch::Contains("'wte.weight' is missing"));
  // a non-finite weight is named with its element, before any step could blame a gradient
  io::NamedTensors damaged = sd;
  std::vector<float> w = to_vector<float>(damaged[4].second);
  w[7] = std::numeric_limits<float>::quiet_NaN();
  damaged[4].second = from_vector<float>(w, damaged[4].second.shape());
  io::save_safetensors(path, damaged);
  REQUIRE_THROWS_WITH(nn::load_hf_state(b, io::load_safetensors(path)),
                      Catch::Contains("'h.0.attn.c_attn.weight' holds a non-finite value (element 7 is nan)"));
  // an lm_head.weight equal to wte is the tied head; another one is an output layer this model cannot hold
  io::NamedTensors headed = sd;
  headed.emplace_back("lm_head.weight", sd[0].second);
  io::save_safetensors(path, headed);
  nn::load_hf_state(b, io::load_safetensors(path));
  std::vector<float> head = to_vector<float>(sd[0].second);
  head[3] += 1.0f;
  headed.back().second = from_vector<float>(head, sd[0].second.shape());
  io::save_safetensors(path, headed);
  REQUIRE_THROWS_WITH(nn::load_hf_state(b, io::load_safetensors(path)),
                      Catch::Contains("'lm_head.weight' differs from 'wte.weight': an untied output layer"));
  std::filesystem::remove(path);
}

TEST_CASE("golden: tiny GPT logits, loss, every gradient and 3 AdamW steps match PyTorch", "[models][golden]") {
  io::SafetensorsFile g = io::load_safetensors(golden_path());
  nn::GPT m(small_config());  // vocabulary 61 padded to 64: the padding must not show
  nn::load_hf_state(m, golden_weights(g));
  Tensor idx = g.at("input.idx"), tgt = g.at("input.targets");
  {
    autograd::NoGradGuard ng;
    Tensor logits = narrow(m.forward(idx), 2, 0, 61);
    REQUIRE(max_rel_diff(to_vector<float>(logits), to_vector<float>(g.at("expected.logits")), 1e-2) < 1e-4);
  }
  double loss = loss_and_grads(m, idx, tgt);
  REQUIRE(loss == Approx(item(g.at("expected.loss"))).epsilon(1e-5));
  for (auto& [name, p] : m.named_parameters()) {
    INFO(name);
    Tensor grad = p.grad();
    if (name == "wte.weight") grad = narrow(grad, 0, 0, 61);
    Tensor expect = g.at("grad." + name);
    const bool conv1d = name.find("c_attn.weight") != std::string::npos || name.find("c_proj.weight") != std::string::npos ||
                        name.find("c_fc.weight") != std::string::npos;
    if (conv1d) expect = transpose(expect, 0, 1);  // Conv1D [in, out] there, [out, in] here
    // gradients are compared relative to the tensor's largest entry
    auto a = to_vector<float>(grad), b = to_vector<float>(expect);
    double scale = 0, err = 0;
    for (size_t i = 0; i < b.size(); ++i) scale = std::max(scale, std::abs(double(b[i])));
    for (size_t i = 0; i < b.size(); ++i) err = std::max(err, std::abs(double(a[i]) - b[i]));
    REQUIRE(err <= 1e-4 * scale + 1e-7);
  }
  // Three AdamW steps with clipping at 1.0, weight decay on matrices only.
  nn::GPT t(small_config());
  nn::load_hf_state(t, golden_weights(g));
  optim::AdamWConfig oc;
  oc.beta1 = 0.9;
  oc.beta2 = 0.95;
  oc.eps = 1e-8;
  oc.weight_decay = 0.1;
  optim::AdamW opt(t.named_parameters(), oc);
  auto losses = to_vector<float>(g.at("adamw.losses"));
  auto norms = to_vector<float>(g.at("adamw.grad_norms"));
  for (int s = 0; s < 3; ++s) {
    double l = loss_and_grads(t, idx, tgt);
    REQUIRE(l == Approx(losses[size_t(s)]).epsilon(1e-5));
    double n = optim::global_grad_norm(t.parameters());
    REQUIRE(n == Approx(norms[size_t(s)]).epsilon(1e-4));
    opt.step(1e-2, optim::clip_coefficient(n, 1.0));
  }
  // Adam normalises each update (m / sqrt(v)), so an entry whose gradient is near zero moves by
  // up to lr whatever its size: f32-vs-f64 gradient noise there shows up at ~1e-5 of lr-sized
  // steps. Parameters must agree to 1% of one step's learning rate.
  for (auto& [name, p] : nn::hf_state_dict(t)) {
    INFO(name);
    auto a = to_vector<float>(p), b = to_vector<float>(g.at("after_adamw." + name));
    double err = 0;
    for (size_t i = 0; i < a.size(); ++i) err = std::max(err, std::abs(double(a[i]) - b[i]));
    REQUIRE(err < 1e-4);
  }
}

// A module registered under two names (or a weight shared): each tensor once, under its first
// name, as PyTorch's named_parameters(); an optimizer over them steps it once.
TEST_CASE("named_parameters lists a shared tensor once, under its first name", "[models]") {
  struct Twice : nn::Module {
    std::shared_ptr<nn::Linear> l = register_module("a", std::make_shared<nn::Linear>(2, 2, true));
    Twice() { register_module("b", l); }
  };
  Twice m;
  const auto named = m.named_parameters();
  REQUIRE(named.size() == 2);
  CHECK(named[0].first == "a.weight");
  CHECK(named[1].first == "a.bias");
  CHECK(m.parameters().size() == 2);
}

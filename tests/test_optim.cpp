// Optimizers and schedules against values worked out by hand.
#include "tests/catch.h"
#include <cmath>

#include "autograd/ops.h"
#include "optim/loss_scaler.h"
#include "optim/optim.h"
#include "kernels/ops.h"
#include "models/gpt.h"

using namespace sg;

namespace {
Tensor param(const Shape& s, double v) {
  Tensor p = full(s, v, DType::f64);
  p.set_requires_grad(true);
  return p;
}
}  // namespace

TEST_CASE("AdamW: two steps match the hand-worked update, decay only on matrices", "[optim]") {
  Tensor w = param({1, 1}, 1.0), b = param({1}, 1.0);
  optim::AdamWConfig cfg;
  cfg.beta1 = 0.9;
  cfg.beta2 = 0.999;
  cfg.eps = 1e-8;
  cfg.weight_decay = 0.1;
  optim::AdamW opt({{"w", w}, {"b", b}}, cfg);
  for (int s = 0; s < 2; ++s) {
    w.set_grad(full({1, 1}, 0.5, DType::f64));
    b.set_grad(full({1}, 0.5, DType::f64));
    opt.step(0.1);
  }
  // step 1: p = 1*(1-0.01) - (0.1/0.1) * 0.05 / (0.5 + 1e-8) = 0.89
  // step 2: p = 0.89*0.99 - (0.1/0.19) * 0.095 / (0.5 + 1e-8) = 0.7811
  REQUIRE(item(w) == Approx(0.7811).epsilon(1e-7));
  REQUIRE(item(b) == Approx(0.8).epsilon(1e-7));
  REQUIRE(opt.steps() == 2);
  auto st = opt.state();
  REQUIRE(st.size() == 4);
  REQUIRE(st[0].first == "w.exp_avg");
  REQUIRE(item(st[0].second) == Approx(0.095));
}

TEST_CASE("AdamW: a parameter without a gradient is left alone", "[optim]") {
  Tensor w = param({2, 2}, 1.0);
  optim::AdamW opt({{"w", w}}, {});
  opt.step(0.1);
  REQUIRE(to_vector<double>(w) == std::vector<double>{1, 1, 1, 1});
}

TEST_CASE("AdamW: grad_scale scales the gradient before the moments", "[optim]") {
  Tensor a = param({3}, 1.0), b = param({3}, 1.0);
  optim::AdamW oa({{"a", a}}, {}), ob({{"b", b}}, {});
  a.set_grad(full({3}, 0.2, DType::f64));
  b.set_grad(full({3}, 0.4, DType::f64));
  oa.step(0.01);
  ob.step(0.01, 0.5);
  REQUIRE(to_vector<double>(a) == to_vector<double>(b));
}

TEST_CASE("AdamW: f32 and f64 parameters in one optimizer step as they do alone", "[optim]") {
  // One adamw_many call per (device, dtype): mixing dtypes must neither be refused nor mix updates.
  auto make = [](DType dt, uint64_t seed) {
    Tensor p = to(randn({4, 3}, seed, 1), dt);
    p.set_requires_grad(true);
    return p;
  };
  Tensor a = make(DType::f32, 1), b = make(DType::f64, 2), a1 = make(DType::f32, 1), b1 = make(DType::f64, 2);
  optim::AdamWConfig cfg;
  cfg.weight_decay = 0.1;
  optim::AdamW both({{"a", a}, {"b", b}}, cfg), only_a({{"a", a1}}, cfg), only_b({{"b", b1}}, cfg);
  for (int s = 0; s < 3; ++s) {
    for (Tensor* p : {&a, &a1}) p->set_grad(to(randn({4, 3}, 10 + s, 1), DType::bf16));  // cast to f32 for the step
    for (Tensor* p : {&b, &b1}) p->set_grad(to(randn({4, 3}, 20 + s, 1), DType::f64));
    both.step(1e-2);
    only_a.step(1e-2);
    only_b.step(1e-2);
  }
  CHECK(to_vector<float>(a) == to_vector<float>(a1));
  CHECK(to_vector<double>(b) == to_vector<double>(b1));
  CHECK(to_vector<float>(a) != to_vector<float>(make(DType::f32, 1)));
}

// Mixed precision: f32 masters updated from the model's bf16/f16 gradients as they are, the model's
// weights rewritten in the same pass (AdamW::set_copies), against the long way round: the
// gradients widened to f32 first, the weights rounded from the masters after. Bit for bit. Sizes
// past one 8192-element chunk of the CPU kernel, with a tail.
TEST_CASE("AdamW: half gradients read as they are and half copies written in the update equal the long way round",
          "[optim]") {
  for (DType half : {DType::bf16, DType::f16}) {
    INFO(dtype_name(half));
    auto master = [](uint64_t seed, const Shape& s) {
      Tensor p = randn(s, seed, 1);
      p.set_requires_grad(true);
      return p;
    };
    const Shape sw{97, 91}, sb{91};
    Tensor w = master(1, sw), b = master(2, sb), w1 = master(1, sw), b1 = master(2, sb);
    Tensor cw = to(w, half), cb = to(b, half);
    optim::AdamWConfig cfg;
    cfg.weight_decay = 0.1;
    optim::AdamW fused({{"w", w}, {"b", b}}, cfg), plain({{"w", w1}, {"b", b1}}, cfg);
    fused.set_copies({cw, cb});
    for (int s = 0; s < 3; ++s) {
      const Tensor gw = to(randn(sw, 10 + s, 1), half), gb = to(randn(sb, 20 + s, 1), half);
      w.set_grad(gw), b.set_grad(gb);
      w1.set_grad(to(gw, DType::f32)), b1.set_grad(to(gb, DType::f32));
      fused.step(1e-2, 0.25);
      plain.step(1e-2, 0.25);
      REQUIRE(to_vector<float>(w) == to_vector<float>(w1));
      REQUIRE(to_vector<float>(b) == to_vector<float>(b1));
      REQUIRE(to_vector<float>(cw) == to_vector<float>(to(w1, half)));
      REQUIRE(to_vector<float>(cb) == to_vector<float>(to(b1, half)));
    }
    REQUIRE(to_vector<float>(cw) != to_vector<float>(to(master(1, sw), half)));  // the copies did move
  }
}

TEST_CASE("AdamW refuses copies that do not fit and gradients of a type it cannot read", "[optim]") {
  Tensor p = zeros({6}), m = zeros({6}), v = zeros({6});
  p.set_requires_grad(true);
  optim::AdamW opt({{"p", p}}, {});
  REQUIRE_THROWS_WITH(opt.set_copies({zeros({5}, DType::bf16)}), Catch::Contains("parameter 'p' is f32[6] on cpu"));
  REQUIRE_THROWS_WITH(opt.set_copies({zeros({6})}), Catch::Contains("want a bf16/f16 tensor"));
  // At the op table: a half gradient for an f64 parameter, and a copy without a half gradient type.
  std::vector<double> pd(6, 0.0), md(6, 0.0), vd(6, 0.0);
  std::vector<uint16_t> gh(6, 0);
  kernels::AdamWArgs a;
  a.dtype = DType::f64, a.n = 6, a.param = pd.data(), a.grad = gh.data(), a.m = md.data(), a.v = vd.data();
  a.grad_dtype = DType::bf16;
  REQUIRE_THROWS_WITH(SG_KERNEL(Device::cpu(), adamw)(a), Catch::Contains("a bf16 gradient for a f64 parameter"));
  a.grad_dtype.reset();
  a.copy = gh.data();
  REQUIRE_THROWS_WITH(SG_KERNEL(Device::cpu(), adamw)(a), Catch::Contains("names a copy without a half-precision"));
}

TEST_CASE("AdamWBatch refuses a gradient whose element count is not the parameter's", "[optim]") {
  Tensor p = zeros({6}), m = zeros({6}), v = zeros({6});
  optim::AdamWBatch batch({}, 1e-3, 1.0, 1);
  REQUIRE_THROWS_WITH(batch.add(p, zeros({5}), m, v, true), Catch::Contains("element counts differ"));
}

TEST_CASE("SGD with momentum: PyTorch's buffer update", "[optim]") {
  Tensor p = param({1}, 1.0);
  optim::SGD opt({{"p", p}}, {0.9, 0.0});
  p.set_grad(full({1}, 1.0, DType::f64));
  opt.step(0.1);
  REQUIRE(item(p) == Approx(0.9));
  opt.step(0.1);  // buf = 0.9*1 + 1 = 1.9
  REQUIRE(item(p) == Approx(0.71));
}

TEST_CASE("learning-rate schedules: warmup, cosine or linear to min_lr, wsd, constant", "[optim]") {
  optim::LrSchedule s;
  s.kind = "cosine";
  s.lr = 1.0;
  s.min_lr = 0.1;
  s.warmup_steps = 10;
  s.total_steps = 110;
  REQUIRE(s.at(0) == Approx(0.1));
  REQUIRE(s.at(9) == Approx(1.0));
  REQUIRE(s.at(10) == Approx(1.0));
  REQUIRE(s.at(60) == Approx(0.55));
  REQUIRE(s.at(110) == Approx(0.1));
  s.kind = "constant";
  REQUIRE(s.at(100) == Approx(1.0));
  s.kind = "linear";  // a straight line from 1.0 at step 10 to 0.1 at step 110
  REQUIRE(s.at(9) == Approx(1.0));
  REQUIRE(s.at(10) == Approx(1.0));
  REQUIRE(s.at(60) == Approx(0.55));
  REQUIRE(s.at(85) == Approx(0.325));
  REQUIRE(s.at(110) == Approx(0.1));
  s.kind = "wsd";  // stable at 1.0 until the last fifth of the 100 steps after warmup, then linear
  REQUIRE(s.wsd_decay_steps() == 20);
  REQUIRE(s.at(5) == Approx(0.6));
  REQUIRE(s.at(89) == Approx(1.0));
  REQUIRE(s.at(90) == Approx(1.0));
  REQUIRE(s.at(100) == Approx(0.55));
  REQUIRE(s.at(110) == Approx(0.1));
  s.decay_steps = 50;
  REQUIRE(s.at(59) == Approx(1.0));
  REQUIRE(s.at(85) == Approx(0.55));
  s.validate();
  s.decay_steps = 101;
  REQUIRE_THROWS_WITH(s.validate(), Catch::Contains("--decay-steps must be in [0, steps - warmup steps] = [0, 100], got 101"));
  s.decay_steps = 10;
  s.kind = "cosine";
  REQUIRE_THROWS_WITH(s.validate(), Catch::Contains("--decay-steps sets the wsd schedule's decay, not cosine's"));
  s.kind = "step";
  REQUIRE_THROWS_WITH(s.validate(), Catch::Contains("unknown schedule 'step' (expected constant, cosine, linear or wsd)"));
}

TEST_CASE("global-norm clipping: the norm over all grads and torch's coefficient", "[optim]") {
  Tensor a = param({2}, 0.0), b = param({1}, 0.0), c = param({1}, 0.0);
  a.set_grad(from_vector<double>({3, 0}, {2}));
  b.set_grad(from_vector<double>({4}, {1}));
  REQUIRE(optim::global_grad_norm({a, b, c}) == Approx(5.0));
  REQUIRE(optim::clip_coefficient(5.0, 1.0) == Approx(1.0 / (5.0 + 1e-6)));
  REQUIRE(optim::clip_coefficient(0.5, 1.0) == 1.0);
  REQUIRE(optim::clip_coefficient(5.0, 0.0) == 1.0);
}

TEST_CASE("loss scaler: backs off and skips on overflow, grows after clean steps", "[optim]") {
  optim::LossScaler s;
  s.scale = 1024;
  s.growth_interval = 2;
  REQUIRE_FALSE(s.update(true));
  REQUIRE(s.scale == 512);
  REQUIRE(s.skipped_steps == 1);
  REQUIRE(s.update(false));
  REQUIRE(s.update(false));
  REQUIRE(s.scale == 1024);
  s.scale = 1;
  s.update(true);
  REQUIRE(s.scale == 1);  // never below min_scale
}

TEST_CASE("the default peak learning rate follows model size: GPT-3's rates at GPT-2's four sizes", "[optim]") {
  auto lr = [](const char* preset) { return optim::default_peak_lr(nn::gpt_preset(preset).non_embedding_params()); };
  CHECK(nn::gpt_preset("gpt2").non_embedding_params() == 12 * 7'087'872 + 1'536);  // 12 blocks (12C² + 13C) and ln_f
  CHECK(lr("tiny") == 1e-2);
  CHECK(lr("gpt2") == 6e-4);
  CHECK(lr("gpt2-medium") == 3e-4);
  CHECK(lr("gpt2-large") == 2.5e-4);
  CHECK(lr("gpt2-xl") == 2e-4);
  nn::GPTConfig char_model = nn::gpt_preset("tiny");  // nanoGPT's Shakespeare character model: 6 x 384
  char_model.n_layer = 6, char_model.n_embd = 384, char_model.n_head = 6;
  CHECK(optim::default_peak_lr(char_model.non_embedding_params()) == 1e-3);
}

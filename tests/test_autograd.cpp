// The tape: gradients accumulate, several tapes live at once, hooks fire exactly when a leaf's
// gradient is final, and recompute trades activation bytes for a second forward without
// changing a single number.
#include "tests/catch.h"

#include "autograd/ops.h"
#include "autograd/recompute.h"
#include "autograd/tape.h"

using namespace sg;
using autograd::Tape;
using autograd::TapeScope;
using autograd::TensorList;
using Catch::Contains;

namespace {

Tensor leaf(const Shape& s, uint64_t stream) {
  Tensor t = randn(s, 5, stream, 0, 1, DType::f64);
  t.set_requires_grad(true);
  return t;
}

std::vector<double> vec(const Tensor& t) { return to_vector<double>(t); }

void check_close(const std::vector<double>& got, const std::vector<double>& want, double tol = 1e-12) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("element " << i);
    CHECK(got[i] == Approx(want[i]).margin(tol).epsilon(tol));
  }
}

// Elementwise a * s + b (reference arithmetic on plain vectors).
std::vector<double> axpb(const std::vector<double>& a, double s, const std::vector<double>& b) {
  std::vector<double> r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] * s + (b.empty() ? 0.0 : b[i]);
  return r;
}

}  // namespace

TEST_CASE("gradients accumulate (+=) into .grad across two backward calls", "[autograd]") {
  Tensor x = leaf({3, 4}, 1);
  for (int step = 1; step <= 2; ++step) {
    Tape tape;
    Tensor loss;
    {
      TapeScope s(tape);
      loss = sum(square(x));
    }
    tape.backward(loss);
    check_close(vec(x.grad()), axpb(vec(x), 2.0 * step, {}));  // d/dx sum(x^2) = 2x, twice
  }
  CHECK(x.grad().storage()->category() == MemCategory::grad);
}

TEST_CASE("a leaf's .grad is charged to its grad_category: grad, or activation for a pipeline stage's input", "[autograd]") {
  // Twice each: the first delivery keeps the gradient's own bytes (sole owner) or copies them (a
  // gradient another leaf also gets: add's, handed to both its inputs), the second adds into it.
  for (const bool shared : {false, true}) {
    Tensor x = leaf({3, 4}, 1), z = leaf({3, 4}, 2);
    x.impl()->grad_category = MemCategory::activation;
    for (int step = 1; step <= 2; ++step) {
      Tape tape;
      Tensor loss;
      {
        TapeScope s(tape);
        loss = shared ? sum(square(add(x, z))) : sum(square(x));
      }
      tape.backward(loss);
      CHECK(x.grad().storage()->category() == MemCategory::activation);
    }
    check_close(vec(x.grad()), shared ? axpb(vec(add(x, z)), 4.0, {}) : axpb(vec(x), 4.0, {}));
    if (shared) CHECK(z.grad().storage()->category() == MemCategory::grad);
  }
}

TEST_CASE("backward(outputs, grad_outputs) seeds a non-scalar output", "[autograd]") {
  Tensor x = leaf({2, 3}, 2);
  Tensor G = randn({2, 3}, 5, 3, 0, 1, DType::f64);
  Tape tape;
  Tensor y;
  {
    TapeScope s(tape);
    y = mul(x, 3.0);
  }
  REQUIRE_THROWS_WITH(tape.backward(y), Contains("loss must have one element"));
  tape.backward({y}, {G});
  check_close(vec(x.grad()), axpb(vec(G), 3.0, {}));
}

TEST_CASE("Tape::grad returns gradients and leaves every .grad untouched", "[autograd]") {
  Tensor x = leaf({4}, 3), w = leaf({4}, 4);
  w.set_grad(full({4}, 7.0, DType::f64));
  int fired = 0;
  w.add_grad_ready_hook([&](const Tensor&) { ++fired; });
  Tape tape;
  Tensor loss;
  {
    TapeScope s(tape);
    loss = sum(mul(x, w));
  }
  TensorList g = tape.grad({loss}, {ones_like(loss)}, {x, w});
  check_close(vec(g[0]), vec(w));
  check_close(vec(g[1]), vec(x));
  CHECK_FALSE(x.grad().defined());
  CHECK(vec(w.grad()) == std::vector<double>(4, 7.0));
  CHECK(fired == 0);  // no .grad was written, so no gradient became ready
}

TEST_CASE("two tapes live at once record different micro-batches, backward in either order", "[autograd]") {
  Tensor xa = randn({3, 5}, 5, 10, 0, 1, DType::f64), xb = randn({3, 5}, 5, 11, 0, 1, DType::f64);
  auto grad_of = [&](const Tensor& w, const Tensor& x) {  // d/dw sum(tanh(x w)) for w [5, 2]
    Tensor h = tanh(matmul(x, w));
    Tensor dh = sub(ones_like(h), square(h));
    return vec(matmul(transpose(x, 0, 1), dh));
  };
  for (bool a_first : {true, false}) {
    Tensor w = leaf({5, 2}, 12);
    std::vector<std::vector<double>> hook_saw;  // one entry per firing: .grad when the hook ran
    w.add_grad_ready_hook([&](const Tensor& t) { hook_saw.push_back(vec(t.grad())); });
    Tape ta, tb;
    Tensor la, lb;
    {
      TapeScope s(ta);
      la = sum(tanh(matmul(xa, w)));
    }
    {
      TapeScope s(tb);
      lb = sum(tanh(matmul(xb, w)));
    }
    CHECK(ta.size() > 0);
    CHECK(tb.size() == ta.size());
    std::vector<double> ga = grad_of(w, xa), gb = grad_of(w, xb);
    Tape& first = a_first ? ta : tb;
    Tape& second = a_first ? tb : ta;
    first.backward(a_first ? la : lb);
    check_close(vec(w.grad()), a_first ? ga : gb);
    second.backward(a_first ? lb : la);
    check_close(vec(w.grad()), axpb(ga, 1.0, gb));
    REQUIRE(hook_saw.size() == 2);  // once per tape's backward
    check_close(hook_saw[0], a_first ? ga : gb);
  }
}

TEST_CASE("NoGradGuard records nothing", "[autograd]") {
  Tensor x = leaf({3}, 5);
  Tape tape;
  TapeScope s(tape);
  Tensor y;
  {
    autograd::NoGradGuard ng;
    CHECK_FALSE(autograd::grad_enabled());
    y = exp(mul(x, 2.0));
  }
  CHECK(autograd::grad_enabled());
  CHECK(tape.empty());
  CHECK_FALSE(y.requires_grad());
  CHECK(y.grad_fn() == nullptr);
  Tensor z = exp(x);
  CHECK(tape.size() == 1);
  CHECK(z.requires_grad());
}

TEST_CASE("a leaf's grad-ready hook fires once per backward, after its last consumer, with the full gradient",
          "[autograd]") {
  Tensor w = leaf({4}, 6), a = randn({4}, 5, 7, 0, 1, DType::f64);
  Tensor unused = leaf({4}, 8), dead_end = leaf({4}, 9);
  int fired = 0, unused_fired = 0, dead_end_fired = 0;
  std::vector<double> seen;
  w.add_grad_ready_hook([&](const Tensor& t) {
    ++fired;
    seen = vec(t.grad());
  });
  unused.add_grad_ready_hook([&](const Tensor&) { ++unused_fired; });
  dead_end.add_grad_ready_hook([&](const Tensor&) { ++dead_end_fired; });
  // d/dw [sum(w * a) + sum(exp(w)) + sum(w)] = a + exp(w) + 1
  std::vector<double> want(4);
  for (size_t i = 0; i < 4; ++i) want[i] = vec(a)[i] + std::exp(vec(w)[i]) + 1.0;
  for (int step = 1; step <= 2; ++step) {
    Tape tape;
    Tensor loss;
    {
      TapeScope s(tape);
      Tensor side = mul(dead_end, a);  // recorded, but the loss does not depend on it
      (void)side;
      loss = add(add(sum(mul(w, a)), sum(exp(w))), sum(w));
    }
    tape.backward(loss);
    CHECK(fired == step);
    check_close(seen, axpb(want, double(step), {}));  // the accumulated .grad, all three consumers in
  }
  CHECK(unused_fired == 0);
  CHECK(dead_end_fired == 0);
}

TEST_CASE("backward through a consumed tape fails with a clear message", "[autograd]") {
  Tensor x = leaf({2}, 15);
  Tape tape;
  Tensor loss;
  {
    TapeScope s(tape);
    loss = sum(exp(x));
  }
  tape.backward(loss);
  REQUIRE_THROWS_WITH(tape.backward(loss), Contains("second time"));
  CHECK(tape.empty());
}

namespace {

struct Region {
  Tensor W1, b1, W2;
  TensorList params() const { return {W1, b1, W2}; }
  // A transformer-MLP-like block with dropout inside: linear -> gelu -> dropout -> linear.
  TensorList operator()(const TensorList& in) const {
    Tensor h = dropout(gelu(linear(in[0], W1, b1)), 0.25);
    return {linear(h, W2, Tensor()), h};
  }
};

struct RunResult {
  std::vector<double> y, dx, dW1, db1, dW2;
  int64_t live_activation_bytes = 0;  // held between forward and backward
};

RunResult run_region(bool use_recompute) {
  Region r;
  r.W1 = leaf({64, 16}, 20);
  r.b1 = leaf({64}, 21);
  r.W2 = leaf({16, 64}, 22);
  Tensor x = leaf({8, 16}, 23);
  Tensor G = randn({8, 64}, 5, 24, 0, 1, DType::f64);  // weights the second output
  dropout_generator() = DropoutGenerator::seeded(77, 0);
  const Device cpu = Device::cpu();
  RunResult res;
  Tape tape;
  TensorList out;
  Tensor loss;
  const int64_t before = Ledger::global().stats(cpu).cur(MemCategory::activation);
  {
    TapeScope s(tape);
    out = use_recompute ? autograd::recompute(r, {x}, r.params()) : r({x});
    loss = add(sum(out[0]), sum(mul(out[1], G)));
  }
  res.live_activation_bytes = Ledger::global().stats(cpu).cur(MemCategory::activation) - before;
  tape.backward(loss);
  res.y = vec(out[0]);
  res.dx = vec(x.grad());
  res.dW1 = vec(r.W1.grad());
  res.db1 = vec(r.b1.grad());
  res.dW2 = vec(r.W2.grad());
  return res;
}

}  // namespace

TEST_CASE("recompute gives the plain region's outputs and gradients, dropout included, in fewer live bytes",
          "[autograd]") {
  RunResult plain = run_region(false), rec = run_region(true);
  CHECK(rec.y == plain.y);
  check_close(rec.dx, plain.dx);
  check_close(rec.dW1, plain.dW1);
  check_close(rec.db1, plain.db1);
  check_close(rec.dW2, plain.dW2);
  CHECK(rec.live_activation_bytes < plain.live_activation_bytes);
  // plain also keeps gelu's input, x W1^T + b1 (8 x 64 f64), alive for backward
  CHECK(plain.live_activation_bytes - rec.live_activation_bytes >= 8 * 64 * 8);
}

TEST_CASE("recompute records one node and its params' hooks fire once, from the outer backward", "[autograd]") {
  Region r;
  r.W1 = leaf({6, 4}, 30);
  r.b1 = leaf({6}, 31);
  r.W2 = leaf({4, 6}, 32);
  Tensor x = randn({3, 4}, 5, 33, 0, 1, DType::f64);  // an input that needs no gradient
  int fired = 0;
  for (const Tensor& p : r.params()) p.add_grad_ready_hook([&](const Tensor&) { ++fired; });
  Tape tape;
  Tensor loss;
  {
    TapeScope s(tape);
    loss = sum(autograd::recompute(r, {x}, r.params())[0]);
    CHECK(tape.size() == 2);  // recompute + sum
  }
  tape.backward(loss);
  CHECK(fired == 3);
  CHECK(r.W1.grad().defined());
  CHECK(r.W2.grad().defined());
}

TEST_CASE("grad() w.r.t. an intermediate, a tensor listed twice, and one the outputs do not use", "[autograd]") {
  Tensor x = leaf({3}, 40), u = leaf({3}, 41);
  Tape t;
  Tensor h, y;
  {
    TapeScope s(t);
    h = mul(x, 2.0);
    y = sum(mul(h, h));  // dy/dh = 2h, dy/dx = 8x
  }
  const TensorList g = t.grad({y}, {ones({}, DType::f64)}, {h, x, h, u});
  REQUIRE(g[0].defined());
  check_close(vec(g[0]), axpb(vec(h), 2.0, {}));
  check_close(vec(g[1]), axpb(vec(x), 8.0, {}));
  check_close(vec(g[2]), vec(g[0]));
  CHECK_FALSE(g[3].defined());
  CHECK_FALSE(x.grad().defined());
}

TEST_CASE("a gradient waits in a tape still to be walked, and one that reaches a walked or destroyed tape is refused",
          "[autograd]") {
  Tensor x = leaf({3}, 42);
  struct TwoTapes {  // h = 2x and l1 = sum(h) on t1, y = sum(3h) on t2
    Tape t1, t2;
    Tensor h, l1, y;
    explicit TwoTapes(const Tensor& x) {
      {
        TapeScope s(t1);
        h = mul(x, 2.0);
        l1 = sum(h);
      }
      TapeScope s(t2);
      y = sum(mul(h, 3.0));
    }
  };
  {  // the second tape's gradient waits in the first, and arrives when that one is walked
    TwoTapes t(x);
    t.t2.backward(t.y);
    CHECK_FALSE(x.grad().defined());
    t.t1.backward(t.l1);
    check_close(vec(x.grad()), std::vector<double>(3, 8.0));
  }
  x.set_grad(Tensor());
  {  // walked in the other order: the first tape's nodes are gone
    TwoTapes t(x);
    t.t1.backward(t.l1);
    REQUIRE_THROWS_WITH(t.t2.backward(t.y), Contains("made by 'mul_scalar' on a tape that has already been walked backward or destroyed"));
  }
  {  // the tape that recorded h destroyed first
    Tensor h;
    {
      Tape t1;
      TapeScope s(t1);
      h = mul(x, 2.0);
    }
    Tape t2;
    Tensor y;
    {
      TapeScope s(t2);
      y = sum(mul(h, 3.0));
    }
    REQUIRE_THROWS_WITH(t2.backward(y), Contains("walked backward or destroyed"));
  }
}

TEST_CASE("recompute refuses a leaf the region uses but neither takes as an input nor lists in params", "[autograd]") {
  Tensor x = leaf({3, 4}, 50), w = leaf({4, 4}, 51);
  const autograd::RegionFn region = [&](const TensorList& in) { return TensorList{tanh(matmul(in[0], w))}; };
  Tape forgot, listed;
  Tensor a, b;
  {
    TapeScope s(forgot);
    a = sum(autograd::recompute(region, {x}, {})[0]);
  }
  // Before, w's gradient was dropped in silence.
  REQUIRE_THROWS_WITH(forgot.backward(a), Contains("neither an input nor in params") && Contains("pass it in params"));
  {
    TapeScope s(listed);
    b = sum(autograd::recompute(region, {x}, {w})[0]);
  }
  listed.backward(b);
  CHECK(w.grad().defined());
}

// From an audit of the ops against PyTorch's behaviour on empty and pass-through cases.
TEST_CASE("contractions over nothing give zero gradients (K or N = 0), not unwritten memory or a throw", "[autograd]") {
  Tape t;
  Tensor x = leaf({5, 4}, 60), w = zeros({0, 4}, DType::f64), a = leaf({2, 0}, 61), b = leaf({0, 3}, 62);
  Tensor c = leaf({2, 3}, 63), e = leaf({3, 0}, 64);
  w.set_requires_grad(true);
  {
    TapeScope s(t);
    // each a different shape of nothing: linear with no output features, matmul with K = 0, N = 0
    Tensor loss = add(add(sum(linear(x, w, Tensor())), sum(matmul(a, b))), sum(matmul(c, e)));
    t.backward(loss);
  }
  CHECK(vec(x.grad()) == std::vector<double>(20, 0.0));
  CHECK(w.grad().shape() == Shape{0, 4});
  CHECK(a.grad().shape() == Shape{2, 0});
  CHECK(b.grad().shape() == Shape{0, 3});
  CHECK(vec(c.grad()) == std::vector<double>(6, 0.0));
  CHECK(e.grad().shape() == Shape{3, 0});
}

TEST_CASE("a recompute region may return its input as it is: the input keeps its own history", "[autograd]") {
  Tensor x = leaf({2}, 65);
  const autograd::RegionFn region = [](const TensorList& in) { return TensorList{in[0], mul(in[0], 2.0)}; };
  for (int step = 1; step <= 2; ++step) {  // the leaf stays a leaf: the second step records it again
    INFO("step " << step);
    Tape t;
    TapeScope s(t);
    const TensorList o = autograd::recompute(region, {x}, {});
    t.backward(sum(add(o[0], o[1])));
    CHECK(x.is_leaf());
    CHECK(vec(x.grad()) == std::vector<double>(2, 3.0 * step));
  }
}

TEST_CASE("maximum and amax refuse inputs that need a gradient instead of dropping it", "[autograd]") {
  Tensor x = leaf({3}, 66);
  Tape t;
  {
    TapeScope s(t);
    REQUIRE_THROWS_WITH(maximum(x, zeros({3}, DType::f64)), Contains("maximum: has no gradient"));
    REQUIRE_THROWS_WITH(amax(x, 0), Contains("amax: has no gradient") && Contains("detach()"));
    CHECK(to_vector<double>(maximum(autograd::detach(x), zeros({3}, DType::f64))).size() == 3);
  }
  CHECK(to_vector<double>(amax(x, 0)).size() == 1);  // no tape recording: nothing to refuse
}

// The op profiler (kernels/profile.h): every op-table call of the profiling thread, by entry, once
// each; other threads' calls and calls made inside an entry are not counted; the real table is back
// when it ends; the model computes the same bits under it.
#include "tests/catch.h"
#include <chrono>
#include <thread>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "kernels/ops.h"
#include "kernels/profile.h"
#include "models/gpt.h"
#include "tests/support.h"

using namespace sg;

namespace {

// An entry that reaches the table again from inside (as a GPU entry falling back to other kernels
// might): fill does its work through copy_strided.
void fill_through_copy(void* out, DType dtype, int64_t n, double value) {
  SG_CHECK(dtype == DType::f32, "test fill: f32 only");
  const std::vector<float> v(static_cast<size_t>(n), static_cast<float>(value));
  kernels::table(Device::cpu()).copy_strided(out, dtype, v.data(), dtype, kernels::Dims{n}, kernels::Dims{1});
}

}  // namespace

TEST_CASE("the op profiler counts a GPT step's op-table calls by entry without changing its bits", "[profile]") {
  nn::GPTConfig c = nn::gpt_preset("tiny");
  c.n_layer = 2;
  c.dropout = 0;
  nn::GPT model(c, DType::f32, Device::cpu());
  model.init_weights(7);
  for (auto& p : model.parameters()) p.set_requires_grad(true);
  const int64_t B = 2, T = 8;
  std::vector<int64_t> tok(size_t(B * T));
  for (size_t i = 0; i < tok.size(); ++i) tok[i] = int64_t(i * 5 % 13);
  Tensor idx = from_vector(tok, {B, T}), tgt = from_vector(tok, {B, T});

  const kernels::OpTable* real = &kernels::table(Device::cpu());
  const double plain = testing::loss_and_grads(model, idx, tgt);
  const std::vector<float> plain_grad = to_vector<float>(model.parameters()[0].grad());
  std::map<std::string, kernels::OpTime> ops;
  double wall_ms = 0, profiled = 0;
  {
    kernels::OpProfiler profiler(Device::cpu());
    CHECK(&kernels::table(Device::cpu()) != real);
    const auto t0 = std::chrono::steady_clock::now();
    profiled = testing::loss_and_grads(model, idx, tgt);
    wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    ops = profiler.take();
    CHECK(profiler.take().empty());  // take() starts afresh
  }
  CHECK(&kernels::table(Device::cpu()) == real);
  CHECK(profiled == plain);
  CHECK(to_vector<float>(model.parameters()[0].grad()) == plain_grad);

  // Per block 4 linears (c_attn, attention's c_proj, c_fc, the MLP's c_proj) and the tied head:
  // one GEMM each forward, two each backward.
  const int64_t linears = 4 * c.n_layer + 1;
  REQUIRE(ops.count("gemm"));
  CHECK(ops["gemm"].calls == 3 * linears);
  CHECK(ops["attention"].calls == c.n_layer);
  CHECK(ops["attention_backward"].calls == c.n_layer);
  CHECK(ops["embedding"].calls == 1);
  // Model FLOPs: 2 M N K per GEMM, with M = B T rows through 12 C^2 weights a block and the
  // [C, Vp] head; causal attention 2 B T^2 C a layer forward, 2.5 times that backward.
  const double C = double(c.n_embd), Vp = double(c.vocab_rows()), BT = double(B * T);
  CHECK(ops["gemm"].flops == 3 * 2 * BT * (double(c.n_layer) * 12 * C * C + C * Vp));
  CHECK(ops["attention"].flops == double(c.n_layer) * 2 * double(B) * double(T * T) * C);
  CHECK(ops["attention_backward"].flops == 2.5 * ops["attention"].flops);
  CHECK(ops["layernorm"].flops == 0);
  CHECK(ops.count("adamw_many") == 0);  // no optimizer step here
  double host = 0;
  for (const auto& [name, o] : ops) {
    CHECK(o.calls > 0);
    CHECK(o.host_ms >= 0);
    CHECK(o.device_ms == 0);  // the CPU has no device time
    host += o.host_ms;
  }
  CHECK(ops["gemm"].host_ms > 0);
  CHECK(host <= wall_ms);
}

TEST_CASE("the op profiler times its own thread's outermost calls only, one profiler at a time", "[profile]") {
  testing::ScopedCpuTable nesting([](kernels::OpTable& t) { t.fill = fill_through_copy; });
  {
    kernels::OpProfiler profiler(Device::cpu());
    CHECK_THROWS_WITH(kernels::OpProfiler(Device::cpu()), Catch::Contains("another profiler is active"));
    Tensor mine = zeros({5}), theirs = zeros({5});
    profiler.take();  // zeros() filled them through the table
    kernels::table(Device::cpu()).fill(mine.data_ptr(), DType::f32, 5, 2.5);
    std::thread other([&] { kernels::table(Device::cpu()).fill(theirs.data_ptr(), DType::f32, 5, 1.0); });
    other.join();
    const auto ops = profiler.take();
    REQUIRE(ops.size() == 1);  // fill once; its inner copy_strided and the other thread's fill not at all
    CHECK(ops.at("fill").calls == 1);
    CHECK(to_vector<float>(mine) == std::vector<float>(5, 2.5f));
    CHECK(to_vector<float>(theirs) == std::vector<float>(5, 1.0f));  // it ran, through the wrapped table
  }
  CHECK(&kernels::table(Device::cpu()) == &nesting.t);  // the table it found is put back
}

// The op correctness suite: one harness runs every op on every device we have. Each case gives
// the op, its inputs (small irregular shapes) and a plain reference loop in double. The harness
// checks the forward in f64 and f32 (and bf16/f16 where the case says so: the dtype is kept and
// the values match within the half precision) and the backward against f64 finite differences.
// Behaviour that is not a pure function of the inputs (dropout statistics, errors, padded
// vocabularies, casts) has its own tests after the harness.
#include "tests/catch.h"
#include <climits>
#include <cmath>
#include <functional>
#include <limits>

#include "autograd/gradcheck.h"
#include "autograd/ops.h"
#include "autograd/tape.h"
#include "core/ledger.h"
#include "core/philox.h"
#include "kernels/cpu/cpu.h"
#include "kernels/ops.h"
#include "tests/support.h"

using namespace sg;
using autograd::TensorList;
using testing::ScopedCpuTable;
using Catch::Contains;

namespace {

// ---- reference arrays: a shape and row-major values in double ----

struct Ref {
  Shape shape;
  std::vector<double> v;
};

int64_t count(const Shape& s) {
  int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

std::vector<int64_t> unravel(int64_t flat, const Shape& s) {
  std::vector<int64_t> idx(s.size());
  for (size_t d = s.size(); d-- > 0;) {
    idx[d] = flat % s[d];
    flat /= s[d];
  }
  return idx;
}

int64_t ravel(const std::vector<int64_t>& idx, const Shape& s) {
  int64_t flat = 0;
  for (size_t d = 0; d < s.size(); ++d) flat = flat * s[d] + idx[d];
  return flat;
}

// Flat index in s of the element that broadcasting reads for the (right-aligned) index idx.
int64_t broadcast_index(const std::vector<int64_t>& idx, const Shape& s) {
  int64_t flat = 0;
  const size_t off = idx.size() - s.size();
  for (size_t d = 0; d < s.size(); ++d) flat = flat * s[d] + (s[d] == 1 ? 0 : idx[off + d]);
  return flat;
}

Shape broadcast(const Shape& a, const Shape& b) {
  Shape out(std::max(a.size(), b.size()), 1);
  for (size_t i = 0; i < out.size(); ++i) {
    int64_t da = i < a.size() ? a[a.size() - 1 - i] : 1, db = i < b.size() ? b[b.size() - 1 - i] : 1;
    out[out.size() - 1 - i] = da == 1 ? db : da;
  }
  return out;
}

Ref each(const Ref& a, const std::function<double(double)>& f) {
  Ref r{a.shape, a.v};
  for (auto& x : r.v) x = f(x);
  return r;
}

Ref zip(const Ref& a, const Ref& b, const std::function<double(double, double)>& f) {
  Ref r{broadcast(a.shape, b.shape), {}};
  r.v.resize(size_t(count(r.shape)));
  for (int64_t i = 0; i < count(r.shape); ++i) {
    auto idx = unravel(i, r.shape);
    r.v[size_t(i)] = f(a.v[size_t(broadcast_index(idx, a.shape))], b.v[size_t(broadcast_index(idx, b.shape))]);
  }
  return r;
}

// Reduces dims (negative allowed) with f, starting from init.
Ref reduce(const Ref& a, std::vector<int64_t> dims, bool keepdim, double init,
           const std::function<double(double, double)>& f) {
  const int64_t n = int64_t(a.shape.size());
  std::vector<bool> red(size_t(n), false);
  for (auto d : dims) red[size_t(d < 0 ? d + n : d)] = true;
  Shape kept = a.shape;
  for (int64_t d = 0; d < n; ++d)
    if (red[size_t(d)]) kept[size_t(d)] = 1;
  Ref r{kept, std::vector<double>(size_t(count(kept)), init)};
  for (int64_t i = 0; i < count(a.shape); ++i) {
    auto idx = unravel(i, a.shape);
    for (int64_t d = 0; d < n; ++d)
      if (red[size_t(d)]) idx[size_t(d)] = 0;
    double& o = r.v[size_t(ravel(idx, kept))];
    o = f(o, a.v[size_t(i)]);
  }
  if (!keepdim) {
    r.shape.clear();
    for (int64_t d = 0; d < n; ++d)
      if (!red[size_t(d)]) r.shape.push_back(a.shape[size_t(d)]);
  }
  return r;
}
double plus(double a, double b) { return a + b; }

// out index i reads input index p^-1: out[i0, i1, ...] = a[... at position dims[k] = ik ...]
Ref permute_ref(const Ref& a, const std::vector<int64_t>& dims) {
  Shape s(dims.size());
  for (size_t k = 0; k < dims.size(); ++k) s[k] = a.shape[size_t(dims[k])];
  Ref r{s, std::vector<double>(a.v.size())};
  for (int64_t i = 0; i < count(s); ++i) {
    auto o = unravel(i, s);
    std::vector<int64_t> in(dims.size());
    for (size_t k = 0; k < dims.size(); ++k) in[size_t(dims[k])] = o[k];
    r.v[size_t(i)] = a.v[size_t(ravel(in, a.shape))];
  }
  return r;
}

Ref narrow_ref(const Ref& a, int64_t dim, int64_t start, int64_t len) {
  Shape s = a.shape;
  s[size_t(dim)] = len;
  Ref r{s, std::vector<double>(size_t(count(s)))};
  for (int64_t i = 0; i < count(s); ++i) {
    auto idx = unravel(i, s);
    idx[size_t(dim)] += start;
    r.v[size_t(i)] = a.v[size_t(ravel(idx, a.shape))];
  }
  return r;
}

Ref expand_ref(const Ref& a, const Shape& s) {
  Ref r{s, std::vector<double>(size_t(count(s)))};
  for (int64_t i = 0; i < count(s); ++i) r.v[size_t(i)] = a.v[size_t(broadcast_index(unravel(i, s), a.shape))];
  return r;
}

Ref cat_ref(const std::vector<Ref>& xs, int64_t dim) {
  Shape s = xs[0].shape;
  s[size_t(dim)] = 0;
  for (const auto& x : xs) s[size_t(dim)] += x.shape[size_t(dim)];
  Ref r{s, std::vector<double>(size_t(count(s)))};
  for (int64_t i = 0; i < count(s); ++i) {
    auto idx = unravel(i, s);
    size_t k = 0;
    while (idx[size_t(dim)] >= xs[k].shape[size_t(dim)]) idx[size_t(dim)] -= xs[k++].shape[size_t(dim)];
    r.v[size_t(i)] = xs[k].v[size_t(ravel(idx, xs[k].shape))];
  }
  return r;
}

// a [..., M, K] (or [K]) times b [..., K, N] with broadcast batch dims.
Ref matmul_ref(const Ref& a, const Ref& b) {
  const bool vec = a.shape.size() == 1;
  const int64_t K = a.shape.back(), N = b.shape.back(), M = vec ? 1 : a.shape[a.shape.size() - 2];
  Shape ba = vec ? Shape{} : Shape(a.shape.begin(), a.shape.end() - 2);
  Shape bb(b.shape.begin(), b.shape.end() - 2);
  Shape batch = broadcast(ba, bb);
  Shape s = batch;
  if (!vec) s.push_back(M);
  s.push_back(N);
  Ref r{s, std::vector<double>(size_t(count(s)))};
  for (int64_t bi = 0; bi < count(batch); ++bi) {
    auto idx = unravel(bi, batch);
    const int64_t ia = broadcast_index(idx, ba), ib = broadcast_index(idx, bb);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0;
        for (int64_t k = 0; k < K; ++k) acc += a.v[size_t((ia * M + m) * K + k)] * b.v[size_t((ib * K + k) * N + n)];
        r.v[size_t((bi * M + m) * N + n)] = acc;
      }
  }
  return r;
}

// y[r, o] = sum_i x[r, i] w[o, i] + b[o]
Ref linear_ref(const Ref& x, const Ref& w, const Ref* b) {
  const int64_t in = w.shape[1], out = w.shape[0], rows = count(x.shape) / in;
  Shape s = x.shape;
  s.back() = out;
  Ref r{s, std::vector<double>(size_t(rows * out))};
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t o = 0; o < out; ++o) {
      double acc = b ? b->v[size_t(o)] : 0.0;
      for (int64_t k = 0; k < in; ++k) acc += x.v[size_t(i * in + k)] * w.v[size_t(o * in + k)];
      r.v[size_t(i * out + o)] = acc;
    }
  return r;
}

// Applies f to each row of the last dim: f(in_row, out_row).
Ref rows_ref(const Ref& x, const std::function<void(const double*, double*, int64_t)>& f) {
  const int64_t C = x.shape.back(), rows = count(x.shape) / C;
  Ref r{x.shape, std::vector<double>(x.v.size())};
  for (int64_t i = 0; i < rows; ++i) f(x.v.data() + i * C, r.v.data() + i * C, C);
  return r;
}

Ref softmax_ref(const Ref& x, bool log) {
  return rows_ref(x, [log](const double* in, double* out, int64_t C) {
    double s = 0;
    for (int64_t j = 0; j < C; ++j) s += std::exp(in[j]);
    for (int64_t j = 0; j < C; ++j) out[j] = log ? in[j] - std::log(s) : std::exp(in[j]) / s;
  });
}

Ref layernorm_ref(const Ref& x, const Ref& w, const Ref* b, double eps) {
  return rows_ref(x, [&](const double* in, double* out, int64_t C) {
    double m = 0, v = 0;
    for (int64_t j = 0; j < C; ++j) m += in[j] / double(C);
    for (int64_t j = 0; j < C; ++j) v += (in[j] - m) * (in[j] - m) / double(C);
    for (int64_t j = 0; j < C; ++j) out[j] = (in[j] - m) / std::sqrt(v + eps) * w.v[size_t(j)] + (b ? b->v[size_t(j)] : 0);
  });
}

Ref rmsnorm_ref(const Ref& x, const Ref& w, double eps) {
  return rows_ref(x, [&](const double* in, double* out, int64_t C) {
    double ms = 0;
    for (int64_t j = 0; j < C; ++j) ms += in[j] * in[j] / double(C);
    for (int64_t j = 0; j < C; ++j) out[j] = in[j] / std::sqrt(ms + eps) * w.v[size_t(j)];
  });
}

Ref embedding_ref(const Ref& w, const Ref& idx) {
  const int64_t C = w.shape[1];
  Shape s = idx.shape;
  s.push_back(C);
  Ref r{s, {}};
  for (double i : idx.v)
    for (int64_t c = 0; c < C; ++c) r.v.push_back(w.v[size_t(int64_t(i) * C + c)]);
  return r;
}

// mean (over counted targets) or sum of logsumexp(x[:V]) - x[t], times scale.
Ref cross_entropy_ref(const Ref& x, const Ref& t, const CrossEntropyOptions& o) {
  const int64_t Vp = x.shape.back(), V = o.vocab < 0 ? Vp : o.vocab, rows = count(x.shape) / Vp;
  double total = 0;
  int64_t counted = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tgt = int64_t(t.v[size_t(r)]);
    if (tgt == o.ignore_index) continue;
    const double* row = x.v.data() + r * Vp;
    double s = 0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(row[j]);
    total += std::log(s) - row[tgt];
    ++counted;
  }
  return Ref{{}, {(o.sum ? total : total / double(counted)) * o.scale}};
}

// softmax(q k^T * scale + mask) v per (batch, head), the mask hiding keys after the query when causal.
Ref attention_ref(const Ref& q, const Ref& k, const Ref& v, bool causal, double scale) {
  const int64_t B = q.shape[0], H = q.shape[1], T = q.shape[2], D = q.shape[3];
  if (scale == 0) scale = 1.0 / std::sqrt(double(D));
  Ref r{q.shape, std::vector<double>(q.v.size())};
  for (int64_t bh = 0; bh < B * H; ++bh) {
    auto Q = [&](int64_t t, int64_t d) { return q.v[size_t((bh * T + t) * D + d)]; };
    auto Kk = [&](int64_t t, int64_t d) { return k.v[size_t((bh * T + t) * D + d)]; };
    auto Vv = [&](int64_t t, int64_t d) { return v.v[size_t((bh * T + t) * D + d)]; };
    for (int64_t i = 0; i < T; ++i) {
      std::vector<double> p(static_cast<size_t>(T));
      double norm = 0;
      for (int64_t j = 0; j < T; ++j) {
        double s = 0;
        for (int64_t d = 0; d < D; ++d) s += Q(i, d) * Kk(j, d);
        p[size_t(j)] = (causal && j > i) ? 0.0 : std::exp(s * scale);
        norm += p[size_t(j)];
      }
      for (int64_t d = 0; d < D; ++d) {
        double acc = 0;
        for (int64_t j = 0; j < T; ++j) acc += p[size_t(j)] / norm * Vv(j, d);
        r.v[size_t((bh * T + i) * D + d)] = acc;
      }
    }
  }
  return r;
}

// Rounds to a float format with `bits` significant bits (bf16: 8, f16: 11), ties to even.
double round_significand(double x, int bits) {
  if (x == 0 || !std::isfinite(x)) return x;
  int e;
  double m = std::frexp(x, &e);  // x = m 2^e, 0.5 <= |m| < 1
  return std::ldexp(std::nearbyint(std::ldexp(m, bits)), e - bits);
}

double gelu_ref(double x) { return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x))); }

// ---- the harness ----

struct In {
  Shape shape;
  enum Kind { normal, positive, index } kind = normal;
  std::vector<int64_t> ints = {};  // index inputs: their values
  DType int_dtype = DType::i64;
};
In N(Shape s) { return {std::move(s)}; }
In P(Shape s) { return {std::move(s), In::positive}; }
In I(Shape s, std::vector<int64_t> v, DType dt = DType::i64) { return {std::move(s), In::index, std::move(v), dt}; }

using OpFn = std::function<Tensor(const TensorList&)>;
using RefFn = std::function<Ref(const std::vector<Ref>&)>;

struct OpCase {
  std::string name;
  std::vector<In> ins;
  OpFn fn;
  RefFn ref;
  double tol = 1e-5;   // f32 forward: |got - ref| <= tol * (1 + |ref|)
  bool half = false;   // also run in bf16 and f16
  bool grad = true;    // differentiable: gradcheck in f64
  double gc_eps = 1e-6, gc_atol = 1e-5, gc_rtol = 1e-4;
};

// A case from a fn and a ref, with builder-style options.
struct CaseList {
  std::vector<OpCase> cases;
  OpCase& add(std::string name, std::vector<In> ins, OpFn fn, RefFn ref) {
    cases.push_back(OpCase{std::move(name), std::move(ins), std::move(fn), std::move(ref)});
    return cases.back();
  }
};

std::vector<OpCase> all_op_cases() {
  CaseList L;
  using V = const TensorList&;
  using R = const std::vector<Ref>&;
  const Shape S = {3, 5, 7};

  // Elementwise binary ops: same shape, both sides broadcast, a 0-d scalar, a [1] tensor.
  struct Bin {
    const char* name;
    Tensor (*op)(const Tensor&, const Tensor&);
    double (*f)(double, double);
  };
  const Bin bins[] = {{"add", add, [](double a, double b) { return a + b; }},
                      {"sub", sub, [](double a, double b) { return a - b; }},
                      {"mul", mul, [](double a, double b) { return a * b; }},
                      {"div", div, [](double a, double b) { return a / b; }}};
  const std::pair<Shape, Shape> layouts[] = {{S, S}, {{3, 1, 7}, {5, 1}}, {S, {}}, {{1}, S}};
  for (const Bin& b : bins)
    for (const auto& [sa, sb] : layouts) {
      auto op = b.op;
      auto f = b.f;
      bool is_div = std::string(b.name) == "div";
      L.add(std::string(b.name) + " " + shape_str(sa) + " " + shape_str(sb), {N(sa), is_div ? P(sb) : N(sb)},
            [op](V x) { return op(x[0], x[1]); }, [f](R r) { return zip(r[0], r[1], f); })
          .half = std::string(b.name) == "add";
    }
  L.add("maximum [3,1,7] [5,1]", {N({3, 1, 7}), N({5, 1})}, [](V x) { return maximum(x[0], x[1]); },
        [](R r) { return zip(r[0], r[1], [](double a, double b) { return std::max(a, b); }); })
      .grad = false;
  L.add("add on a transposed and a narrowed view", {N({7, 5}), N({5, 9})},
        [](V x) { return add(transpose(x[0], 0, 1), narrow(x[1], 1, 2, 7)); },
        [](R r) { return zip(permute_ref(r[0], {1, 0}), narrow_ref(r[1], 1, 2, 7), plus); });

  // Scalar and unary ops.
  L.add("add scalar", {N(S)}, [](V x) { return add(x[0], 1.5); }, [](R r) { return each(r[0], [](double v) { return v + 1.5; }); });
  L.add("mul scalar", {N(S)}, [](V x) { return mul(x[0], -0.7); }, [](R r) { return each(r[0], [](double v) { return v * -0.7; }); });
  L.add("neg", {N(S)}, [](V x) { return neg(x[0]); }, [](R r) { return each(r[0], [](double v) { return -v; }); });
  L.add("exp", {N(S)}, [](V x) { return exp(x[0]); }, [](R r) { return each(r[0], [](double v) { return std::exp(v); }); });
  L.add("log", {P(S)}, [](V x) { return log(x[0]); }, [](R r) { return each(r[0], [](double v) { return std::log(v); }); });
  L.add("sqrt", {P(S)}, [](V x) { return sqrt(x[0]); }, [](R r) { return each(r[0], [](double v) { return std::sqrt(v); }); });
  L.add("tanh", {N(S)}, [](V x) { return tanh(x[0]); }, [](R r) { return each(r[0], [](double v) { return std::tanh(v); }); });
  L.add("square", {N(S)}, [](V x) { return square(x[0]); }, [](R r) { return each(r[0], [](double v) { return v * v; }); });
  L.add("pow 2.5", {P(S)}, [](V x) { return pow(x[0], 2.5); }, [](R r) { return each(r[0], [](double v) { return std::pow(v, 2.5); }); });
  L.add("pow 3 of signed values", {N(S)}, [](V x) { return pow(x[0], 3.0); }, [](R r) { return each(r[0], [](double v) { return v * v * v; }); });
  L.add("relu", {N(S)}, [](V x) { return relu(x[0]); }, [](R r) { return each(r[0], [](double v) { return v > 0 ? v : 0.0; }); });
  L.add("gelu (tanh form)", {N(S)}, [](V x) { return gelu(x[0]); }, [](R r) { return each(r[0], gelu_ref); }).half = true;
  L.add("silu", {N(S)}, [](V x) { return silu(x[0]); }, [](R r) { return each(r[0], [](double v) { return v / (1 + std::exp(-v)); }); });
  L.add("exp of a permuted view", {N(S)}, [](V x) { return exp(permute(x[0], {2, 0, 1})); },
        [](R r) { return each(permute_ref(r[0], {2, 0, 1}), [](double v) { return std::exp(v); }); });

  // Reductions.
  L.add("sum of all", {N(S)}, [](V x) { return sum(x[0]); }, [](R r) { return reduce(r[0], {0, 1, 2}, false, 0, plus); });
  L.add("sum over dims {0,2}", {N(S)}, [](V x) { return sum(x[0], {0, 2}); }, [](R r) { return reduce(r[0], {0, 2}, false, 0, plus); });
  L.add("sum over dims {2,0} keepdim", {N(S)}, [](V x) { return sum(x[0], {2, 0}, true); },
        [](R r) { return reduce(r[0], {0, 2}, true, 0, plus); });
  L.add("sum over dim -2 keepdim", {N(S)}, [](V x) { return sum(x[0], {-2}, true); }, [](R r) { return reduce(r[0], {1}, true, 0, plus); });
  L.add("sum over dims {0,1} of a 4-d tensor", {N({2, 3, 1, 4})}, [](V x) { return sum(x[0], {1, 0}); },
        [](R r) { return reduce(r[0], {0, 1}, false, 0, plus); });
  L.add("sum over dims {0,2} of a transposed view", {N(S)}, [](V x) { return sum(transpose(x[0], 0, 1), {0, 2}); },
        [](R r) { return reduce(permute_ref(r[0], {1, 0, 2}), {0, 2}, false, 0, plus); });
  L.add("sum over dim 0 of [3,300] (wide rows)", {N({3, 300})}, [](V x) { return sum(x[0], {0}); },
        [](R r) { return reduce(r[0], {0}, false, 0, plus); });
  L.add("amax over dim 1 of [2,3,150]", {N({2, 3, 150})}, [](V x) { return amax(x[0], 1); },
        [](R r) {
          return reduce(r[0], {1}, false, -std::numeric_limits<double>::infinity(), [](double a, double b) { return std::max(a, b); });
        })
      .grad = false;
  L.add("sum of 300k elements (blocked full reduction)", {N({300001})}, [](V x) { return sum(x[0]); },
        [](R r) { return reduce(r[0], {0}, false, 0, plus); })
      .grad = false;
  L.add("sum over no dims is a copy", {N(S)}, [](V x) { return sum(x[0], {}, true); }, [](R r) { return r[0]; });
  L.add("mean of all", {N(S)}, [](V x) { return mean(x[0]); },
        [](R r) { return each(reduce(r[0], {0, 1, 2}, false, 0, plus), [](double v) { return v / 105; }); });
  L.add("mean over dims {0,2}", {N(S)}, [](V x) { return mean(x[0], {0, 2}); },
        [](R r) { return each(reduce(r[0], {0, 2}, false, 0, plus), [](double v) { return v / 21; }); });
  auto maxf = [](double a, double b) { return std::max(a, b); };
  const double lowest = -std::numeric_limits<double>::infinity();
  L.add("amax over dim 1", {N(S)}, [](V x) { return amax(x[0], 1); }, [=](R r) { return reduce(r[0], {1}, false, lowest, maxf); })
      .grad = false;
  L.add("amax over dim -1 keepdim", {N(S)}, [](V x) { return amax(x[0], -1, true); },
        [=](R r) { return reduce(r[0], {2}, true, lowest, maxf); })
      .grad = false;
  L.add("sum_to [5,1]", {N(S)}, [](V x) { return sum_to(x[0], {5, 1}); },
        [](R r) { return Ref{{5, 1}, reduce(r[0], {0, 2}, false, 0, plus).v}; });
  L.add("sum_to [1,7]", {N(S)}, [](V x) { return sum_to(x[0], {1, 7}); },
        [](R r) { return Ref{{1, 7}, reduce(r[0], {0, 1}, false, 0, plus).v}; });

  // Views.
  L.add("reshape [15,7]", {N(S)}, [](V x) { return reshape(x[0], {15, -1}); }, [](R r) { return Ref{{15, 7}, r[0].v}; });
  L.add("reshape of a transposed view (copies)", {N(S)}, [](V x) { return reshape(transpose(x[0], 1, 2), {21, 5}); },
        [](R r) { return Ref{{21, 5}, permute_ref(r[0], {0, 2, 1}).v}; });
  L.add("view splitting a dim", {N(S)}, [](V x) { return view(x[0], {3, 5, 7, 1}); }, [](R r) { return Ref{{3, 5, 7, 1}, r[0].v}; });
  L.add("transpose", {N(S)}, [](V x) { return transpose(x[0], 0, 2); }, [](R r) { return permute_ref(r[0], {2, 1, 0}); });
  L.add("permute", {N(S)}, [](V x) { return permute(x[0], {1, 2, 0}); }, [](R r) { return permute_ref(r[0], {1, 2, 0}); });
  L.add("narrow", {N(S)}, [](V x) { return narrow(x[0], 1, 1, 3); }, [](R r) { return narrow_ref(r[0], 1, 1, 3); });
  L.add("narrow over the whole dim (gradient handed on)", {N(S)}, [](V x) { return mul(narrow(x[0], 1, 0, 5), x[0]); },
        [](R r) { return zip(narrow_ref(r[0], 1, 0, 5), r[0], [](double a, double b) { return a * b; }); });
  L.add("expand", {N({5, 1})}, [](V x) { return expand(x[0], {3, 5, 7}); }, [](R r) { return expand_ref(r[0], {3, 5, 7}); });
  L.add("unsqueeze and squeeze", {N(S)}, [](V x) { return squeeze(unsqueeze(transpose(x[0], 0, 1), 2), 2); },
        [](R r) { return permute_ref(r[0], {1, 0, 2}); });
  L.add("contiguous of a transposed view", {N(S)}, [](V x) { return contiguous(transpose(x[0], 1, 2)); },
        [](R r) { return permute_ref(r[0], {0, 2, 1}); });
  L.add("flatten", {N(S)}, [](V x) { return flatten(x[0]); }, [](R r) { return Ref{{105}, r[0].v}; });
  L.add("cat along dim 1", {N({3, 2, 7}), N(S), N({3, 1, 7})}, [](V x) { return cat({x[0], x[1], x[2]}, 1); },
        [](R r) { return cat_ref({r[0], r[1], r[2]}, 1); });
  L.add("cat along dim -1 of views", {N({3, 5}), N({5, 3})}, [](V x) { return cat({x[0], transpose(x[1], 0, 1)}, -1); },
        [](R r) { return cat_ref({r[0], permute_ref(r[1], {1, 0})}, 1); });
  L.add("chunk: every part used, along the last dim", {N({3, 5, 9})},
        [](V x) {
          auto c = chunk(x[0], 3, -1);
          return add(mul(c[0], c[1]), mul(c[2], 2.0));
        },
        [](R r) {
          Ref a = narrow_ref(r[0], 2, 0, 3), b = narrow_ref(r[0], 2, 3, 3), c = narrow_ref(r[0], 2, 6, 3);
          return zip(zip(a, b, [](double u, double v) { return u * v; }), c, [](double u, double v) { return u + 2 * v; });
        });
  L.add("chunk: the middle of three slices", {N({3, 6, 7})}, [](V x) { return chunk(x[0], 3, 1)[1]; },
        [](R r) { return narrow_ref(r[0], 1, 2, 2); });
  L.add("clone of a permuted view", {N(S)}, [](V x) { return clone(permute(x[0], {2, 1, 0})); },
        [](R r) { return permute_ref(r[0], {2, 1, 0}); });
  L.add("to f32 and back", {N(S)}, [](V x) { return to(to(x[0], DType::f32), x[0].dtype()); },
        [](R r) { return each(r[0], [](double v) { return double(float(v)); }); });
  L.cases.back().gc_eps = 1e-3;  // finite differences of a function rounded to f32
  L.cases.back().gc_rtol = 1e-3;

  // Linear algebra.
  L.add("matmul 2-d", {N({3, 5}), N({5, 4})}, [](V x) { return matmul(x[0], x[1]); }, [](R r) { return matmul_ref(r[0], r[1]); })
      .half = true;
  L.add("matmul batched", {N({2, 3, 5}), N({2, 5, 4})}, [](V x) { return matmul(x[0], x[1]); },
        [](R r) { return matmul_ref(r[0], r[1]); })
      .half = true;
  L.add("matmul broadcast batch [2,1,3,5] @ [3,5,4]", {N({2, 1, 3, 5}), N({3, 5, 4})}, [](V x) { return matmul(x[0], x[1]); },
        [](R r) { return matmul_ref(r[0], r[1]); });
  L.add("matmul broadcast batch [3,1,3,5] @ [1,2,5,4]", {N({3, 1, 3, 5}), N({1, 2, 5, 4})},
        [](V x) { return matmul(x[0], x[1]); }, [](R r) { return matmul_ref(r[0], r[1]); });
  L.add("matmul 3-d @ 2-d", {N({2, 3, 5}), N({5, 4})}, [](V x) { return matmul(x[0], x[1]); },
        [](R r) { return matmul_ref(r[0], r[1]); });
  L.add("matmul 2-d @ 3-d", {N({3, 5}), N({2, 5, 4})}, [](V x) { return matmul(x[0], x[1]); },
        [](R r) { return matmul_ref(r[0], r[1]); });
  L.add("matmul 1-d @ 2-d", {N({5}), N({5, 4})}, [](V x) { return matmul(x[0], x[1]); }, [](R r) { return matmul_ref(r[0], r[1]); });
  L.add("matmul with a transposed b", {N({2, 3, 5}), N({2, 4, 5})}, [](V x) { return matmul(x[0], transpose(x[1], 1, 2)); },
        [](R r) { return matmul_ref(r[0], permute_ref(r[1], {0, 2, 1})); });
  L.add("matmul of a transposed a", {N({5, 3}), N({5, 4})}, [](V x) { return matmul(transpose(x[0], 0, 1), x[1]); },
        [](R r) { return matmul_ref(permute_ref(r[0], {1, 0}), r[1]); });
  L.add("linear with a transposed weight", {N({3, 5}), N({5, 4}), N({4})},
        [](V x) { return linear(x[0], transpose(x[1], 0, 1), x[2]); },
        [](R r) { return linear_ref(r[0], permute_ref(r[1], {1, 0}), &r[2]); });
  L.add("linear with bias", {N({2, 3, 5}), N({4, 5}), N({4})}, [](V x) { return linear(x[0], x[1], x[2]); },
        [](R r) { return linear_ref(r[0], r[1], &r[2]); });
  L.add("linear without bias", {N({3, 5}), N({4, 5})}, [](V x) { return linear(x[0], x[1], Tensor()); },
        [](R r) { return linear_ref(r[0], r[1], nullptr); });
  L.add("linear with a residual", {N({2, 3, 5}), N({4, 5}), N({4}), N({2, 3, 4})},
        [](V x) { return linear(x[0], x[1], x[2], x[3]); },
        [](R r) { return zip(linear_ref(r[0], r[1], &r[2]), r[3], [](double u, double v) { return u + v; }); })
      .half = true;
  L.add("linear_gelu with bias", {N({2, 3, 5}), N({4, 5}), N({4})}, [](V x) { return linear_gelu(x[0], x[1], x[2]); },
        [](R r) { return each(linear_ref(r[0], r[1], &r[2]), gelu_ref); })
      .half = true;
  L.add("linear_gelu without bias, of a transposed input", {N({5, 3}), N({4, 5})},
        [](V x) { return linear_gelu(transpose(x[0], 0, 1), x[1], Tensor()); },
        [](R r) { return each(linear_ref(permute_ref(r[0], {1, 0}), r[1], nullptr), gelu_ref); });
  L.add("mlp with both biases", {N({2, 3, 5}), N({8, 5}), N({8}), N({4, 8}), N({4})},
        [](V x) { return mlp(x[0], x[1], x[2], x[3], x[4]); },
        [](R r) { return linear_ref(each(linear_ref(r[0], r[1], &r[2]), gelu_ref), r[3], &r[4]); })
      .half = true;
  L.add("mlp without biases, of a transposed input", {N({5, 3}), N({6, 5}), N({4, 6})},
        [](V x) { return mlp(transpose(x[0], 0, 1), x[1], Tensor(), x[2], Tensor()); },
        [](R r) { return linear_ref(each(linear_ref(permute_ref(r[0], {1, 0}), r[1], nullptr), gelu_ref), r[2], nullptr); });
  L.add("mlp with a residual", {N({2, 3, 5}), N({8, 5}), N({8}), N({4, 8}), N({4}), N({2, 3, 4})},
        [](V x) { return mlp(x[0], x[1], x[2], x[3], x[4], x[5]); },
        [](R r) {
          return zip(linear_ref(each(linear_ref(r[0], r[1], &r[2]), gelu_ref), r[3], &r[4]), r[5],
                     [](double u, double v) { return u + v; });
        })
      .half = true;

  // Neural-network ops.
  L.add("softmax", {N(S)}, [](V x) { return softmax(x[0]); }, [](R r) { return softmax_ref(r[0], false); });
  L.add("log_softmax", {N(S)}, [](V x) { return log_softmax(x[0]); }, [](R r) { return softmax_ref(r[0], true); });
  L.add("softmax of large logits", {N({3, 7})}, [](V x) { return softmax(mul(x[0], 30.0)); },
        [](R r) { return softmax_ref(each(r[0], [](double v) { return 30 * v; }), false); });
  L.add("layernorm with bias", {N(S), N({7}), N({7})}, [](V x) { return layernorm(x[0], x[1], x[2]); },
        [](R r) { return layernorm_ref(r[0], r[1], &r[2], 1e-5); })
      .half = true;
  L.add("layernorm without bias", {N(S), N({7})}, [](V x) { return layernorm(x[0], x[1], Tensor(), 1e-3); },
        [](R r) { return layernorm_ref(r[0], r[1], nullptr, 1e-3); });
  // No gain (PyTorch's elementwise_affine=False): the reference's gain is ones, the bias's shape.
  L.add("layernorm without weight", {N(S), N({7})}, [](V x) { return layernorm(x[0], Tensor(), x[1]); },
        [](R r) { return layernorm_ref(r[0], each(r[1], [](double) { return 1.0; }), &r[1], 1e-5); })
      .half = true;
  L.add("add_layernorm without weight or bias", {N(S), N(S)},
        [](V x) { return add_layernorm(x[0], x[1], Tensor(), Tensor()).second; },
        [](R r) {
          const Ref sum = zip(r[0], r[1], [](double u, double v) { return u + v; });
          return layernorm_ref(sum, Ref{{7}, std::vector<double>(7, 1.0)}, nullptr, 1e-5);
        });
  auto plus_ref = [](const Ref& a, const Ref& b) { return zip(a, b, [](double u, double v) { return u + v; }); };
  L.add("add_layernorm: the normalised sum", {N(S), N(S), N({7}), N({7})},
        [](V x) { return add_layernorm(x[0], x[1], x[2], x[3]).second; },
        [=](R r) { return layernorm_ref(plus_ref(r[0], r[1]), r[2], &r[3], 1e-5); })
      .half = true;
  // both outputs used: the sum's own gradient (dr) joins the LayerNorm's in the fused backward
  L.add("add_layernorm: the sum and its norm", {N(S), N({3, 5, 7}), N({7})},
        [](V x) {
          auto [r, y] = add_layernorm(x[0], x[1], x[2], Tensor(), 1e-3);
          return add(mul(r, 0.5), y);
        },
        [=](R r) {
          Ref sum = plus_ref(r[0], r[1]);
          return plus_ref(each(sum, [](double v) { return 0.5 * v; }), layernorm_ref(sum, r[2], nullptr, 1e-3));
        });
  L.add("layernorm of a narrowed view", {N({3, 9}), N({7}), N({7})}, [](V x) { return layernorm(narrow(x[0], 1, 1, 7), x[1], x[2]); },
        [](R r) { return layernorm_ref(narrow_ref(r[0], 1, 1, 7), r[1], &r[2], 1e-5); });
  L.add("rmsnorm", {N(S), N({7})}, [](V x) { return rmsnorm(x[0], x[1]); }, [](R r) { return rmsnorm_ref(r[0], r[1], 1e-6); });
  L.add("embedding with repeated indices (scatter-add backward)", {N({7, 5}), I({2, 4}, {1, 4, 1, 6, 0, 1, 4, 3})},
        [](V x) { return embedding(x[0], x[1]); }, [](R r) { return embedding_ref(r[0], r[1]); });
  L.add("embedding with i32 indices", {N({6, 3}), I({5}, {5, 5, 0, 2, 5}, DType::i32)},
        [](V x) { return embedding(x[0], x[1]); }, [](R r) { return embedding_ref(r[0], r[1]); });
  auto ce = [&](std::string name, Shape logits, std::vector<int64_t> targets, CrossEntropyOptions o) {
    Shape ts(logits.begin(), logits.end() - 1);
    L.add("cross_entropy " + name, {N(logits), I(ts, std::move(targets))},
          [o](V x) { return cross_entropy(x[0], x[1], o); }, [o](R r) { return cross_entropy_ref(r[0], r[1], o); });
  };
  ce("mean", {2, 3, 7}, {0, 6, 3, 3, 1, 5}, {});
  ce("sum", {2, 3, 7}, {0, 6, 3, 3, 1, 5}, {-1, -1, true, 1.0});
  ce("mean with ignore_index", {2, 3, 7}, {2, -100, 6, 0, -100, 4}, {-1, -100, false, 1.0});
  ce("sum with ignore_index and scale", {6, 7}, {2, -100, 6, 0, -100, 4}, {-1, -100, true, 0.25});
  ce("over a padded vocabulary (V=5 of 7 columns)", {2, 3, 7}, {4, 0, 3, 1, -1, 2}, {5, -1, false, 1.0});
  for (bool causal : {true, false})
    L.add(std::string("attention ") + (causal ? "causal" : "non-causal"), {N({2, 2, 5, 3}), N({2, 2, 5, 3}), N({2, 2, 5, 3})},
          [causal](V x) { return attention(x[0], x[1], x[2], causal); },
          [causal](R r) { return attention_ref(r[0], r[1], r[2], causal, 0); });
  L.add("attention causal over 37 positions (more than one block of query rows)",
        {N({1, 1, 37, 2}), N({1, 1, 37, 2}), N({1, 1, 37, 2})}, [](V x) { return attention(x[0], x[1], x[2], true); },
        [](R r) { return attention_ref(r[0], r[1], r[2], true, 0); });
  L.add("attention_qkv: packed [B, T, 3C] in, [B, T, C] out, 2 heads", {N({2, 5, 18})},
        [](V x) { return attention_qkv(x[0], 2); },
        [](R r) {
          auto heads = [&](int64_t part) {
            return permute_ref(Ref{{2, 5, 2, 3}, narrow_ref(r[0], 2, part * 6, 6).v}, {0, 2, 1, 3});
          };
          Ref y = attention_ref(heads(0), heads(1), heads(2), true, 0);
          return Ref{{2, 5, 6}, permute_ref(y, {0, 2, 1, 3}).v};
        })
      .half = true;
  L.add("attention with an explicit scale", {N({1, 3, 4, 2}), N({1, 3, 4, 2}), N({1, 3, 4, 2})},
        [](V x) { return attention(x[0], x[1], x[2], true, 0.8); }, [](R r) { return attention_ref(r[0], r[1], r[2], true, 0.8); });
  L.add("dropout p=0 is the identity", {N(S)}, [](V x) { return dropout(x[0], 0.0); }, [](R r) { return r[0]; });
  L.add("dropout p=0.3 with a fixed (seed, stream)", {N(S)},
        [](V x) {
          dropout_generator() = DropoutGenerator::seeded(42, 3);  // every call draws the same mask
          return dropout(x[0], 0.3);
        },
        [](R r) {
          Ref out = r[0];
          for (size_t i = 0; i < out.v.size(); ++i) out.v[i] = Philox::uniform(42, 3, i) >= 0.3f ? out.v[i] / 0.7 : 0.0;
          return out;
        });
  return L.cases;
}

// Inputs for one case in f64: normals, positives in [0.5, 2), or the given indices.
TensorList make_inputs(const OpCase& c, uint64_t seed) {
  TensorList xs;
  uint64_t stream = 0;
  for (const In& in : c.ins) {
    if (in.kind == In::index) {
      Tensor t = from_vector(in.ints, in.shape);
      xs.push_back(in.int_dtype == DType::i64 ? t : to(t, in.int_dtype));
    } else if (in.kind == In::positive) {
      xs.push_back(rand(in.shape, seed, stream++, 0.5, 2.0, DType::f64));
    } else {
      xs.push_back(randn(in.shape, seed, stream++, 0, 1, DType::f64));
    }
  }
  return xs;
}

TensorList cast_floats(const TensorList& xs, DType dt, Device dev) {
  TensorList out;
  for (const Tensor& x : xs) out.push_back(to(is_floating(x.dtype()) ? to(x, dt) : x, dev));
  return out;
}

// The first element where got and want differ by more than tol * (1 + |want|), or "".
std::string mismatch(const Tensor& got, const Ref& want, double tol) {
  if (got.shape() != want.shape) return "shape " + shape_str(got.shape()) + " but the reference has " + shape_str(want.shape);
  auto g = to_vector<double>(got);
  for (size_t i = 0; i < g.size(); ++i) {
    double err = std::abs(g[i] - want.v[i]);
    if (!(err <= tol * (1 + std::abs(want.v[i]))))
      return str("element ", i, ": got ", g[i], ", reference ", want.v[i], " (error ", err, ")");
  }
  return "";
}

std::vector<Ref> as_refs(const TensorList& xs) {
  std::vector<Ref> r;
  for (const Tensor& x : xs) r.push_back(Ref{x.shape(), to_vector<double>(x)});
  return r;
}

// Runs one case on one device: forward in each dtype against the reference on the same
// (rounded) input values, then gradcheck in f64.
void run_case(const OpCase& c, Device dev) {
  const TensorList x64 = make_inputs(c, 2024);
  struct Run {
    DType dtype;
    double tol;
  };
  std::vector<Run> runs = {{DType::f64, 1e-10}, {DType::f32, c.tol}};
  if (c.half) runs.insert(runs.end(), {{DType::bf16, 8e-3}, {DType::f16, 1e-3}});
  for (const Run& run : runs) {
    INFO("forward in " << dtype_name(run.dtype) << " on " << dev.str());
    TensorList xs = cast_floats(x64, run.dtype, dev);
    Tensor y;
    {
      autograd::NoGradGuard ng;
      y = c.fn(xs);
    }
    CHECK(y.dtype() == run.dtype);
    CHECK(y.device() == dev);
    CHECK(mismatch(to(y, Device::cpu()), c.ref(as_refs(xs)), run.tol) == "");
  }
  if (c.grad) {
    INFO("gradcheck in f64");
    auto r = autograd::gradcheck(c.fn, cast_floats(x64, DType::f64, dev), c.gc_eps, c.gc_atol, c.gc_rtol);
    INFO(r.message);
    CHECK(r.ok);
  }
}

// The CPU only: these cases need f64 (gradcheck) and run in every CI. The CUDA table is held to the
// CPU's entry by entry in f32/bf16/f16 by tests/gpu/kernels.cpp, and the model's ops on cuda:0
// by tests/gpu/train.cpp (ctest -L gpu).
std::vector<Device> test_devices() { return {Device::cpu()}; }

}  // namespace

TEST_CASE("every op: forward matches a double reference loop, backward matches f64 finite differences", "[ops]") {
  const auto cases = all_op_cases();
  for (Device dev : test_devices())
    for (const OpCase& c : cases) {
      DYNAMIC_SECTION(c.name << " on " << dev.str()) { run_case(c, dev); }
    }
}

// ---- what a single forward/backward pair does not show ----

TEST_CASE("cross_entropy over a padded vocabulary equals the unpadded loss, padded columns get zero gradient", "[ops]") {
  const int64_t V = 5, Vp = 8;
  Tensor logits = randn({4, V}, 9, 1, 0, 1, DType::f64);
  Tensor junk = randn({4, Vp - V}, 9, 2, 0, 50, DType::f64);  // anything: padding never counts
  Tensor targets = from_vector<int64_t>({4, 0, 2, 4}, {4});
  auto loss_and_grad = [&](const Tensor& x, int64_t vocab) {
    Tensor leaf = clone(x);
    leaf.set_requires_grad(true);
    autograd::Tape tape;
    Tensor loss;
    {
      autograd::TapeScope s(tape);
      loss = cross_entropy(leaf, targets, {vocab, -1, false, 1.0});
    }
    tape.backward(loss);
    return std::make_pair(item(loss), leaf.grad());
  };
  auto [l0, g0] = loss_and_grad(logits, -1);
  auto [l1, g1] = loss_and_grad(cat({logits, junk}, 1), V);
  CHECK(l1 == Approx(l0).epsilon(1e-14));
  auto a = to_vector<double>(g0), b = to_vector<double>(g1);
  for (int64_t r = 0; r < 4; ++r) {
    for (int64_t j = 0; j < V; ++j) CHECK(b[size_t(r * Vp + j)] == Approx(a[size_t(r * V + j)]).margin(1e-15));
    for (int64_t j = V; j < Vp; ++j) CHECK(b[size_t(r * Vp + j)] == 0.0);
  }
}

TEST_CASE("cross_entropy writes the logits' gradient over them when nothing else holds them", "[ops]") {
  // The head's case: logits = x w^T handed straight to the loss. When the caller still holds the
  // logits they must come back untouched and the gradient goes to a new buffer; when it does not,
  // the backward needs no logits-sized buffer. The gradients are the same bits either way.
  const int64_t R = 64, C = 8, V = 1000;
  const Device cpu = Device::cpu();
  std::vector<int64_t> t(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) t[size_t(r)] = (r * 389 + 7) % V;
  Tensor targets = from_vector(t, {R});
  struct Run {
    Tensor dx, dw;
    int64_t backward_extra = 0;  // bytes the backward allocated beyond what was live before it
    bool held_unchanged = true;
  };
  auto run = [&](bool hold) {
    Tensor x = randn({R, C}, 5, 1), w = randn({V, C}, 5, 2);
    x.set_requires_grad(true);
    w.set_requires_grad(true);
    autograd::Tape tape;
    Tensor loss, held, before;
    {
      autograd::TapeScope s(tape);
      Tensor logits = matmul(x, transpose(w, 0, 1));
      if (hold) held = logits, before = clone(logits);
      loss = cross_entropy(logits, targets);
    }
    Run r;
    const int64_t live = Ledger::global().stats(cpu).total_current;
    Ledger::global().reset_peaks(cpu);
    tape.backward(loss);
    r.backward_extra = Ledger::global().stats(cpu).total_peak - live;
    if (hold) r.held_unchanged = to_vector<float>(held) == to_vector<float>(before);
    r.dx = x.grad(), r.dw = w.grad();
    return r;
  };
  const int64_t logits_bytes = R * V * 4;
  Run held = run(true), dropped = run(false);
  CHECK(held.held_unchanged);
  CHECK(held.backward_extra >= logits_bytes);
  CHECK(dropped.backward_extra < logits_bytes);
  CHECK(to_vector<float>(held.dx) == to_vector<float>(dropped.dx));
  CHECK(to_vector<float>(held.dw) == to_vector<float>(dropped.dw));
}

TEST_CASE("cross_entropy over handed-over logits writes their gradient in the forward's pass", "[ops]") {
  // The fused classifier: logits passed with std::move (or a temporary) are read once, by one
  // call that writes the loss and the gradient for an upstream 1. The gradients are the bits of
  // the two-pass path; an upstream other than backward's own 1 scales them.
  const int64_t R = 48, C = 8, V = 300, Vp = 304;
  std::vector<int64_t> t(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) t[size_t(r)] = r % 7 == 3 ? -1 : (r * 389 + 7) % V;
  Tensor targets = from_vector(t, {R});
  const CrossEntropyOptions o{V, -1, false, 1.0};
  enum class Mode { held, moved, temporary };
  struct Run {
    double loss = 0;
    Tensor dx, dw;
    int64_t backward_extra = 0;  // bytes the backward allocated beyond what was live before it
  };
  auto run = [&](Mode mode, double upstream) {
    Tensor x = randn({R, C}, 5, 1), w = randn({Vp, C}, 5, 2);
    x.set_requires_grad(true);
    w.set_requires_grad(true);
    autograd::Tape tape;
    Tensor loss;
    {
      autograd::TapeScope s(tape);
      if (mode == Mode::temporary) {
        loss = cross_entropy(matmul(x, transpose(w, 0, 1)), targets, o);
      } else {
        Tensor logits = matmul(x, transpose(w, 0, 1));
        loss = mode == Mode::moved ? cross_entropy(std::move(logits), targets, o) : cross_entropy(logits, targets, o);
      }
    }
    Run r;
    r.loss = item(loss);
    const Device cpu = Device::cpu();
    const int64_t live = Ledger::global().stats(cpu).total_current;
    Ledger::global().reset_peaks(cpu);
    if (upstream == 1.0)
      tape.backward(loss);
    else
      tape.backward({loss}, {full({}, upstream)});
    r.backward_extra = Ledger::global().stats(cpu).total_peak - live;
    r.dx = x.grad(), r.dw = w.grad();
    return r;
  };
  const int64_t logits_bytes = R * Vp * 4;
  const Run two_pass = run(Mode::held, 1.0);
  Run moved, temporary;
  {
    // without the two-pass entries: a loss that still took that path fails with "op
    // 'cross_entropy' is not implemented"
    ScopedCpuTable only([](kernels::OpTable& t) {
      t.cross_entropy = nullptr;
      t.cross_entropy_backward = nullptr;
    });
    moved = run(Mode::moved, 1.0);
    temporary = run(Mode::temporary, 1.0);
  }
  for (const Run* f : {&moved, &temporary}) {
    CHECK(f->backward_extra < logits_bytes);  // backward's own 1: the gradient is handed on as it is
    CHECK(f->loss == two_pass.loss);
    CHECK(to_vector<float>(f->dx) == to_vector<float>(two_pass.dx));
    CHECK(to_vector<float>(f->dw) == to_vector<float>(two_pass.dw));
  }
  // A caller's grad_output (not backward's seed): the gradient for 1, scaled.
  const Run scaled_two_pass = run(Mode::held, -2.5), scaled = run(Mode::moved, -2.5);
  const auto dw1 = to_vector<float>(two_pass.dw), dws = to_vector<float>(scaled.dw),
             dws_two_pass = to_vector<float>(scaled_two_pass.dw);
  REQUIRE(dws.size() == dw1.size());
  for (size_t i = 0; i < dw1.size(); ++i) {
    CHECK(dws[i] == Approx(-2.5 * dw1[i]).epsilon(1e-5).margin(1e-9));
    CHECK(dws[i] == Approx(dws_two_pass[i]).epsilon(1e-5).margin(1e-9));
  }
}

TEST_CASE("cross_entropy names an out-of-range target, including one in the padding", "[ops]") {
  Tensor logits = zeros({3, 7});
  REQUIRE_THROWS_WITH(cross_entropy(logits, from_vector<int64_t>({1, 7, 2}, {3})), Contains("target 7 out of range [0, 7)"));
  REQUIRE_THROWS_WITH(cross_entropy(logits, from_vector<int64_t>({1, 5, 2}, {3}), {5}), Contains("target 5 out of range [0, 5)"));
  CrossEntropyOptions ignore_pad;
  ignore_pad.ignore_index = -100;
  REQUIRE_THROWS_WITH(cross_entropy(logits, from_vector<int64_t>({-1, 0, 2}, {3}), ignore_pad),
                      Contains("target -1 out of range [0, 7)"));
  REQUIRE_THROWS_WITH(cross_entropy(logits, from_vector<int64_t>({0, 1}, {2})), Contains("targets [2] has 2"));
  // The right count in another shape (a transposed [B, T]) is refused; flat rows are taken.
  const Tensor logits3 = zeros({2, 3, 7});
  REQUIRE_THROWS_WITH(cross_entropy(logits3, zeros({3, 2}, DType::i64)),
                      Contains("targets [3,2] are neither the logits' leading dims [2,3] nor flat [6]"));
  CHECK(item(cross_entropy(logits3, zeros({6}, DType::i64))) == Approx(std::log(7.0)));
  CHECK(item(cross_entropy(logits3, zeros({2, 3}, DType::i64))) == Approx(std::log(7.0)));
  CHECK(item(cross_entropy(logits, from_vector<int64_t>({-1, -1, -1}, {3}))) == 0.0);  // nothing counted
}

namespace {
int64_t g_table_elems = 0, g_table_fills = 0, g_table_adds = 0;  // for the embedding test below
}  // namespace

TEST_CASE("embedding's backward adds into the gradient its weight gathered elsewhere: no table-sized zeros or add",
          "[ops]") {
  // A tied head (GPT-2's wte as embedding and output projection): the head's weight gradient
  // reaches w first, and the embedding scatter-adds its rows over it. A second backward adds to
  // the gradient left by the first (micro-batches); a .grad held elsewhere is added to in place,
  // as before. Values against two untied copies whose gradients are added (f64).
  const int64_t V = 50, C = 8, n = 24;
  std::vector<int64_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ids[size_t(i)] = (i * 7) % 11 + (i % 3 == 0 ? 30 : 0);  // repeats
  Tensor idx = from_vector(ids, {2, n / 2});
  Tensor w0 = randn({V, C}, 41, 1, 0, 1, DType::f64), r = randn({2, n / 2, V}, 41, 2, 0, 1, DType::f64);
  auto step = [&](const Tensor& emb_w, const Tensor& head_w) {
    autograd::Tape tape;
    Tensor loss;
    {
      autograd::TapeScope s(tape);
      loss = sum(mul(linear(embedding(emb_w, idx), head_w, Tensor()), r));
    }
    tape.backward(loss);
  };
  // the reference: untied copies, their gradients added
  Tensor a = clone(w0), b = clone(w0);
  a.set_requires_grad(true), b.set_requires_grad(true);
  step(a, b);
  const auto one = to_vector<double>(add(a.grad(), b.grad()));

  Tensor w = clone(w0);
  w.set_requires_grad(true);
  g_table_elems = V * C, g_table_fills = 0, g_table_adds = 0;
  {
    ScopedCpuTable counted([](kernels::OpTable& t) {
      t.fill = [](void* dst, DType dt, int64_t count, double v) {
        g_table_fills += count == g_table_elems;
        kernels::cpu::fill(dst, dt, count, v);
      };
      t.binary = [](kernels::Binary op, DType dt, void* out, const void* x, const kernels::Dims& xs, const void* y,
                    const kernels::Dims& ys, const kernels::Dims& shape) {
        int64_t count = 1;
        for (int64_t d : shape) count *= d;
        g_table_adds += op == kernels::Binary::add && count == g_table_elems;
        kernels::cpu::binary(op, dt, out, x, xs, y, ys, shape);
      };
    });
    step(w, w);
  }
  CHECK(g_table_fills == 0);
  CHECK(g_table_adds == 0);
  const auto tied = to_vector<double>(w.grad());
  REQUIRE(tied.size() == one.size());
  for (size_t i = 0; i < one.size(); ++i) CHECK(tied[i] == Approx(one[i]).epsilon(1e-12).margin(1e-12));
  // a second backward adds to the first's gradient
  step(w, w);
  auto twice = to_vector<double>(w.grad());
  for (size_t i = 0; i < one.size(); ++i) CHECK(twice[i] == Approx(2 * one[i]).epsilon(1e-12).margin(1e-12));
  // a gradient someone else holds is not taken over: it is added to in place, and both see it
  Tensor held = w.grad();
  step(w, w);
  CHECK(held.data_ptr() == w.grad().data_ptr());
  auto thrice = to_vector<double>(held);
  for (size_t i = 0; i < one.size(); ++i) CHECK(thrice[i] == Approx(3 * one[i]).epsilon(1e-12).margin(1e-12));
}

TEST_CASE("embedding names an out-of-range index", "[ops]") {
  Tensor w = zeros({4, 3});
  REQUIRE_THROWS_WITH(embedding(w, from_vector<int64_t>({0, 4}, {2})), Contains("index 4 out of range for a table of 4 rows"));
  REQUIRE_THROWS_WITH(embedding(w, from_vector<int32_t>({-1, 0}, {2})), Contains("index -1 out of range"));
  // The table's backward checks every index before it adds into any row.
  std::vector<float> dw(8, 1.0f), d(4, 0.5f);
  const std::vector<int64_t> ix = {1, 4};
  REQUIRE_THROWS_WITH(kernels::table(Device::cpu()).embedding_backward(DType::f32, DType::i64, dw.data(), d.data(),
                                                                       ix.data(), 2, 2, 4),
                      Contains("embedding_backward: index 4 out of range for a table of 4 rows"));
  CHECK(dw == std::vector<float>(8, 1.0f));
}

TEST_CASE("dropout: drops a fraction p, scales survivors by 1/(1-p), backward reuses the mask", "[ops]") {
  const double p = 0.3;
  Tensor x = add(rand({100000}, 4, 1, 0, 1), 1.0);  // in [1, 2): never zero
  x.set_requires_grad(true);
  dropout_generator() = DropoutGenerator::seeded(123, 0);
  autograd::Tape tape;
  Tensor y;
  {
    autograd::TapeScope s(tape);
    y = dropout(x, p);
  }
  CHECK(dropout_generator().next_stream == 1);  // each call takes a fresh stream
  auto xv = to_vector<float>(x), yv = to_vector<float>(y);
  size_t dropped = 0;
  for (size_t i = 0; i < xv.size(); ++i) {
    if (yv[i] == 0) ++dropped;
    else if (std::abs(yv[i] - xv[i] / 0.7f) > 1e-6f) FAIL("survivor " << i << " is " << yv[i] << ", not x/(1-p)");
  }
  CHECK(std::abs(double(dropped) / double(xv.size()) - p) < 0.01);
  tape.backward({y}, {ones_like(y)});
  auto gv = to_vector<float>(x.grad());
  for (size_t i = 0; i < xv.size(); ++i)
    if ((gv[i] == 0) != (yv[i] == 0) || (gv[i] != 0 && std::abs(gv[i] - 1 / 0.7f) > 1e-6f))
      FAIL("gradient " << i << " = " << gv[i] << " does not follow the forward mask");

  autograd::NoGradGuard ng;
  dropout_generator() = DropoutGenerator::seeded(123, 0);
  CHECK(to_vector<float>(dropout(x, p)) == yv);  // same (seed, stream): same mask
  CHECK(to_vector<float>(dropout(x, p)) != yv);  // next stream: another mask
  CHECK(dropout(x, 0.0).impl() == x.impl());
  REQUIRE_THROWS_WITH(dropout(x, 1.0), Contains("dropout: probability 1 is outside [0, 1)"));
}

TEST_CASE("site dropout: a slice of the batch draws the slice of the whole batch's mask, whoever computes it", "[ops]") {
  const double p = 0.3;
  Tensor x = add(rand({8, 12, 5}, 9, 1, 0, 1), 1.0);  // [rows, T, C], never zero
  DropoutGenerator& gen = dropout_generator();
  gen = DropoutGenerator::seeded(321);
  gen.place = DropoutPlace{7, 0, 0};
  const auto whole = to_vector<float>(dropout(x, p, 3));
  CHECK(gen.next_stream == 0);  // site dropout takes no stream from the counter
  {
    // the backward draws the forward's mask, wherever the place has moved since
    Tensor xg = autograd::detach(x);
    xg.set_requires_grad(true);
    autograd::Tape tape;
    Tensor y;
    {
      autograd::TapeScope s(tape);
      y = dropout(xg, p, 3);
    }
    gen.place = DropoutPlace{9, 2, 1};
    tape.backward({y}, {ones_like(y)});
    const auto g = to_vector<float>(xg.grad()), xv = to_vector<float>(x);
    for (size_t i = 0; i < g.size(); ++i) REQUIRE(g[i] == Approx(whole[i] / xv[i]));  // 0 or 1/(1-p)
    gen.place = DropoutPlace{7, 0, 0};
  }
  // rows 4..7, positions 6..11 (a dp rank's rows, a sequence-parallel rank's positions)
  gen.place = DropoutPlace{7, 4, 6};
  const auto part = to_vector<float>(dropout(contiguous(narrow(narrow(x, 0, 4, 4), 1, 6, 6)), p, 3));
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t t = 0; t < 6; ++t)
      for (int64_t c = 0; c < 5; ++c)
        REQUIRE(part[size_t((r * 6 + t) * 5 + c)] == whole[size_t(((4 + r) * 12 + 6 + t) * 5 + c)]);
  // another step or site: another mask
  gen.place = DropoutPlace{8, 0, 0};
  CHECK(to_vector<float>(dropout(x, p, 3)) != whole);
  gen.place = DropoutPlace{7, 0, 0};
  CHECK(to_vector<float>(dropout(x, p, 4)) != whole);
  CHECK(to_vector<float>(dropout(x, p, 3)) == whole);
  {
    DropoutOff eval;  // evaluation: the identity, for both kinds
    CHECK(dropout(x, p, 3).impl() == x.impl());
    CHECK(dropout(x, p).impl() == x.impl());
  }
  CHECK(to_vector<float>(dropout(x, p, 3)) == whole);
  REQUIRE_THROWS_WITH(dropout(reshape(contiguous(narrow(x, 2, 0, 1)), {8, 12}), p, 3), Contains("expected an activation [rows, T, C]"));
  gen.place = DropoutPlace{7, (int64_t(1) << 24) - 4, 0};
  REQUIRE_THROWS_WITH(dropout(x, p, 3), Contains("outside [0, 2^24)"));
  gen = {};
}

TEST_CASE("to(dtype) round trips keep values representable in the target and cast gradients back", "[ops]") {
  Tensor x = randn({3, 5, 7}, 8, 1, 0, 1, DType::f64);
  auto xv = to_vector<double>(x);
  struct Target {
    DType dt;
    int bits;
  };
  for (Target t : {Target{DType::bf16, 8}, Target{DType::f16, 11}, Target{DType::f32, 24}}) {
    INFO(dtype_name(t.dt));
    Tensor h = to(x, t.dt);
    CHECK(h.dtype() == t.dt);
    auto back = to_vector<double>(to(h, DType::f64));
    for (size_t i = 0; i < xv.size(); ++i) CHECK(back[i] == round_significand(xv[i], t.bits));
    CHECK(to_vector<double>(to(to(h, DType::f64), t.dt)) == back);  // exact from then on
  }
  Tensor ints = from_vector<int64_t>({-3, 0, 7}, {3});
  CHECK(to_vector<int64_t>(to(to(ints, DType::f32), DType::i32)) == std::vector<int64_t>{-3, 0, 7});

  Tensor leaf = clone(x);
  leaf.set_requires_grad(true);
  Tensor G = randn({3, 5, 7}, 8, 2, 0, 1, DType::f64);
  autograd::Tape tape;
  Tensor y;
  {
    autograd::TapeScope s(tape);
    y = to(to(leaf, DType::bf16), DType::f64);
  }
  tape.backward({y}, {G});
  auto g = to_vector<double>(leaf.grad()), gv = to_vector<double>(G);
  for (size_t i = 0; i < g.size(); ++i) CHECK(g[i] == round_significand(gv[i], 8));  // the gradient passes as bf16
}

TEST_CASE("add_layernorm is add then layernorm, bit for bit, forward and backward, on the CPU", "[ops]") {
  for (DType dt : {DType::f32, DType::f64}) {
    INFO(dtype_name(dt));
    auto run = [&](bool fused) {
      Tensor x = randn({4, 3, 10}, 7, 1, 0, 1, dt), a = randn({4, 3, 10}, 7, 2, 0, 1, dt);
      Tensor w = randn({10}, 7, 3, 1, 0.2, dt), b = randn({10}, 7, 4, 0, 0.2, dt);
      for (Tensor* t : {&x, &a, &w, &b}) t->set_requires_grad(true);
      autograd::Tape tape;
      Tensor loss;
      {
        autograd::TapeScope s(tape);
        Tensor h, y;
        if (fused) {
          std::tie(h, y) = add_layernorm(x, a, w, b);
        } else {
          h = add(x, a);
          y = layernorm(h, w, b);
        }
        // the block's shape: the sum goes on (times a weight) beside the normalised branch
        loss = sum(mul(add(h, mul(y, y)), randn({4, 3, 10}, 7, 5, 0, 1, dt)));
      }
      tape.backward(loss);
      return std::vector<Tensor>{loss, x.grad(), a.grad(), w.grad(), b.grad()};
    };
    const auto fused = run(true), plain = run(false);
    for (size_t i = 0; i < fused.size(); ++i) {
      INFO("result " << i);
      CHECK(to_vector<double>(to(fused[i], DType::f64)) == to_vector<double>(to(plain[i], DType::f64)));
    }
  }
  Tensor x = zeros({2, 4}), w = ones({4});
  REQUIRE_THROWS_WITH(add_layernorm(x, zeros({2, 5}), w, Tensor()), Contains("add_layernorm: residual"));
  REQUIRE_THROWS_WITH(add_layernorm(x, x, ones({3}), Tensor()), Contains("add_layernorm: weight [3]"));
}

namespace {
// residual_layernorm_backward of the CPU table, counted.
int g_residual_ln_backward_calls = 0;
void counted_residual_ln_backward(DType dt, void* dx, void* dw, void* db, const void* dr, const void* dy,
                                  const void* r, const void* w, const void* mean, const void* rstd, int64_t rows,
                                  int64_t C) {
  ++g_residual_ln_backward_calls;
  kernels::cpu::residual_layernorm_backward(dt, dx, dw, db, dr, dy, r, w, mean, rstd, rows, C);
}
}  // namespace

TEST_CASE("layernorm's backward adds the gradient its input gathered elsewhere, bit for bit, in its own kernel",
          "[ops]") {
  // x feeds layernorm and another op (a transformer's residual stream feeds ln_1 and the residual
  // add). When the other op is recorded after layernorm, its gradient reaches x first and the
  // tape hands it to layernorm's backward, which adds it in residual_layernorm_backward's pass.
  // x.grad must be what the two gradients added apart give.
  for (bool other_first : {false, true}) {
    INFO("other consumer recorded " << (other_first ? "before" : "after") << " layernorm");
    Tensor x = randn({6, 16}, 8, 1), w = randn({16}, 8, 2, 1, 0.2), b = randn({16}, 8, 3, 0, 0.2);
    Tensor c = randn({6, 16}, 8, 4), k = randn({6, 16}, 8, 5);
    x.set_requires_grad(true);
    auto ln_part = [&](const Tensor& xx) { return sum(mul(layernorm(xx, w, b), c)); };
    auto other_part = [&](const Tensor& xx) { return sum(mul(exp(xx), k)); };  // one use of xx
    autograd::Tape tape;
    Tensor loss;
    g_residual_ln_backward_calls = 0;
    ScopedCpuTable count([](kernels::OpTable& t) { t.residual_layernorm_backward = &counted_residual_ln_backward; });
    {
      autograd::TapeScope s(tape);
      Tensor h = mul(x, 1.5);  // a non-leaf, as the residual stream is
      Tensor o = other_first ? other_part(h) : Tensor();
      Tensor l = ln_part(h);
      if (!other_first) o = other_part(h);
      loss = add(l, o);
    }
    tape.backward(loss);
    CHECK(g_residual_ln_backward_calls == (other_first ? 0 : 1));
    // The reference: each part's gradient at h alone, added, then through h = 1.5 x.
    auto grad_at_h = [&](auto part) {
      Tensor h = autograd::detach(mul(x, 1.5));
      h.set_requires_grad(true);
      autograd::Tape t;
      Tensor out;
      {
        autograd::TapeScope s(t);
        out = part(h);
      }
      return t.grad({out}, {ones({})}, {h})[0];
    };
    Tensor g_ln = grad_at_h(ln_part), g_other = grad_at_h(other_part);
    Tensor want = mul(other_first ? add(g_ln, g_other) : add(g_other, g_ln), 1.5);
    CHECK(to_vector<float>(x.grad()) == to_vector<float>(want));
  }
}

TEST_CASE("attention_qkv on the packed projection is attention on the split heads, bit for bit, on the CPU", "[ops]") {
  for (DType dt : {DType::f32, DType::f64}) {
    INFO(dtype_name(dt));
    const int64_t B = 2, T = 37, H = 3, D = 5, C = H * D;
    auto run = [&](bool packed) {
      Tensor qkv = randn({B, T, 3 * C}, 11, 1, 0, 1, dt);
      qkv.set_requires_grad(true);
      autograd::Tape tape;
      Tensor loss;
      {
        autograd::TapeScope s(tape);
        Tensor y;
        if (packed) {
          y = attention_qkv(qkv, H);
        } else {
          auto parts = chunk(qkv, 3, 2);
          auto heads = [&](const Tensor& p) { return permute(reshape(p, {B, T, H, D}), {0, 2, 1, 3}); };
          y = reshape(permute(attention(heads(parts[0]), heads(parts[1]), heads(parts[2])), {0, 2, 1, 3}), {B, T, C});
        }
        loss = sum(mul(y, randn({B, T, C}, 11, 2, 0, 1, dt)));
      }
      tape.backward(loss);
      return std::vector<Tensor>{loss, qkv.grad()};
    };
    const auto packed = run(true), split = run(false);
    for (size_t i = 0; i < packed.size(); ++i) {
      INFO("result " << i);
      CHECK(to_vector<double>(to(packed[i], DType::f64)) == to_vector<double>(to(split[i], DType::f64)));
    }
  }
  REQUIRE_THROWS_WITH(attention_qkv(zeros({2, 4, 10}), 3), Contains("attention_qkv: qkv must be [B, T, 3C]"));
}

TEST_CASE("linear_gelu is linear then gelu, bit for bit, forward and backward, on the CPU", "[ops]") {
  for (DType dt : {DType::f32, DType::f64}) {
    INFO(dtype_name(dt));
    auto run = [&](bool fused) {
      Tensor x = randn({6, 40}, 9, 1, 0, 1, dt), w = randn({24, 40}, 9, 2, 0, 0.3, dt), b = randn({24}, 9, 3, 0, 1, dt);
      for (Tensor* t : {&x, &w, &b}) t->set_requires_grad(true);
      autograd::Tape tape;
      Tensor loss;
      {
        autograd::TapeScope s(tape);
        Tensor y = fused ? linear_gelu(x, w, b) : gelu(linear(x, w, b));
        loss = sum(mul(y, randn({6, 24}, 9, 4, 0, 1, dt)));
      }
      tape.backward(loss);
      return std::vector<Tensor>{loss, x.grad(), w.grad(), b.grad()};
    };
    const auto fused = run(true), plain = run(false);
    for (size_t i = 0; i < fused.size(); ++i) {
      INFO("result " << i);
      CHECK(to_vector<double>(to(fused[i], DType::f64)) == to_vector<double>(to(plain[i], DType::f64)));
    }
  }
  REQUIRE_THROWS_WITH(linear_gelu(zeros({2, 3}), zeros({4, 5}), Tensor()), Contains("linear_gelu: input [2,3]"));
}

TEST_CASE("linear with a residual is add(residual, linear), bit for bit, forward and backward, on the CPU", "[ops]") {
  // A GPT block's x + c_proj(attn(ln_1(x))): the residual also feeds the linear's input through
  // another op, so its gradient gathers from both; with and without the bias.
  for (DType dt : {DType::f32, DType::f64})
    for (bool bias : {true, false}) {
      INFO(dtype_name(dt) << " bias " << bias);
      auto run = [&](bool fused) {
        Tensor x = randn({2, 3, 16}, 29, 1, 0, 1, dt), w = randn({16, 16}, 29, 2, 0, 0.3, dt),
               b = bias ? randn({16}, 29, 3, 0, 1, dt) : Tensor(), p = randn({16, 16}, 29, 4, 0, 0.3, dt);
        for (Tensor* t : {&x, &w, &b, &p})
          if (t->defined()) t->set_requires_grad(true);
        autograd::Tape tape;
        Tensor loss;
        {
          autograd::TapeScope s(tape);
          Tensor in = gelu(linear(x, p, Tensor()));
          Tensor y = fused ? linear(in, w, b, x) : add(x, linear(in, w, b));
          loss = sum(mul(y, randn({2, 3, 16}, 29, 5, 0, 1, dt)));
        }
        tape.backward(loss);
        std::vector<Tensor> r{loss, x.grad(), w.grad(), p.grad()};
        if (bias) r.push_back(b.grad());
        return r;
      };
      const auto fused = run(true), plain = run(false);
      for (size_t i = 0; i < fused.size(); ++i) {
        INFO("result " << i);
        REQUIRE(fused[i].defined());
        CHECK(to_vector<double>(to(fused[i], DType::f64)) == to_vector<double>(to(plain[i], DType::f64)));
      }
    }
  REQUIRE_THROWS_WITH(linear(zeros({2, 5}), zeros({4, 5}), Tensor(), zeros({2, 4}, DType::f64)),
                      Contains("linear: residual f64[2,4] on cpu is not the output's [2,4] in f32 on cpu"));
}

TEST_CASE("mlp is linear_gelu then linear, bit for bit, forward and backward, on the CPU", "[ops]") {
  // c_proj with and without its bias (tensor parallelism adds it after the group's sum), a frozen
  // c_fc weight whose bias still trains (the bias gradient then comes from the dgelu GEMM alone)
  // with an input that needs no gradient, and a residual added in c_proj's GEMM (a GPT block's
  // h + mlp(ln_2(h)): the residual is also the input's source, so its gradient adds to x's).
  for (DType dt : {DType::f32, DType::f64})
    for (int variant = 0; variant < 4; ++variant) {
      INFO(dtype_name(dt) << " variant " << variant);
      auto run = [&](bool fused) {
        Tensor x = randn({2, 5, 24}, 19, 1, 0, 1, dt), w1 = randn({40, 24}, 19, 2, 0, 0.3, dt),
               b1 = randn({40}, 19, 3, 0, 1, dt), w2 = randn({16, 40}, 19, 4, 0, 0.3, dt),
               b2 = variant == 1 ? Tensor() : randn({16}, 19, 5, 0, 1, dt),
               r0 = variant == 3 ? randn({2, 5, 16}, 19, 7, 0, 1, dt) : Tensor(),
               p = variant == 3 ? randn({16, 24}, 19, 8, 0, 0.3, dt) : Tensor();
        for (Tensor* t : {&x, &w1, &b1, &w2, &b2, &r0, &p})
          if (t->defined()) t->set_requires_grad(true);
        if (variant == 2) x.set_requires_grad(false), w1.set_requires_grad(false);
        autograd::Tape tape;
        Tensor loss;
        {
          autograd::TapeScope s(tape);
          Tensor y;
          if (variant == 3) {
            Tensor res = add(r0, linear(x, p, Tensor()));  // a residual with a history, fed by x too
            y = fused ? mlp(x, w1, b1, w2, b2, res) : add(res, linear(linear_gelu(x, w1, b1), w2, b2));
          } else {
            y = fused ? mlp(x, w1, b1, w2, b2) : linear(linear_gelu(x, w1, b1), w2, b2);
          }
          loss = sum(mul(y, randn({2, 5, 16}, 19, 6, 0, 1, dt)));
        }
        tape.backward(loss);
        std::vector<Tensor> r{loss};
        for (Tensor* t : {&x, &w1, &b1, &w2, &b2, &r0, &p})
          if (t->defined() && t->requires_grad()) r.push_back(t->grad());
        return r;
      };
      const auto fused = run(true), plain = run(false);
      REQUIRE(fused.size() == plain.size());
      for (size_t i = 0; i < fused.size(); ++i) {
        INFO("result " << i);
        REQUIRE(fused[i].defined());
        CHECK(to_vector<double>(to(fused[i], DType::f64)) == to_vector<double>(to(plain[i], DType::f64)));
      }
    }
  REQUIRE_THROWS_WITH(mlp(zeros({2, 5}), zeros({8, 5}), Tensor(), zeros({4, 6}), Tensor()),
                      Contains("mlp: c_proj weight [4,6] does not take c_fc's 8 outputs"));
  REQUIRE_THROWS_WITH(mlp(zeros({2, 5}), zeros({8, 5}), Tensor(), zeros({4, 8}), zeros({3})),
                      Contains("mlp: c_proj bias"));
  REQUIRE_THROWS_WITH(mlp(zeros({2, 6}), zeros({8, 5}), Tensor(), zeros({4, 8}), Tensor()),
                      Contains("mlp (c_fc): input [2,6]"));
  REQUIRE_THROWS_WITH(mlp(zeros({2, 5}), zeros({8, 5}), Tensor(), zeros({4, 8}), Tensor(), zeros({2, 5})),
                      Contains("mlp: residual f32[2,5] on cpu is not the output's [2,4]"));
}

TEST_CASE("linear's bias gradient, from its weight-gradient GEMM, is the row sum of dy bit for bit", "[ops]") {
  for (DType dt : {DType::f32, DType::f64}) {
    INFO(dtype_name(dt));
    Tensor x = randn({3, 7, 12}, 23, 1, 0, 1, dt), w = randn({9, 12}, 23, 2, 0, 0.3, dt), b = zeros({9}, dt);
    Tensor dy = randn({3, 7, 9}, 23, 3, 0, 1, dt);
    for (Tensor* t : {&x, &w, &b}) t->set_requires_grad(true);
    autograd::Tape tape;
    Tensor loss;
    {
      autograd::TapeScope s(tape);
      loss = sum(mul(linear(x, w, b), dy));
    }
    tape.backward(loss);
    CHECK(to_vector<double>(b.grad()) == to_vector<double>(sum(reshape(dy, {21, 9}), {0})));
  }
}

// The backward epilogues against the separate ops, on the CPU table: C = (A B) * gelu'(pre) with its
// column sums, and the row sums of op(A), transposed and not.
TEST_CASE("the CPU gemm's backward epilogues are the separate ops' values", "[ops]") {
  const int64_t M = 7, N = 10, K = 5;
  const auto vec = [](const Tensor& t) { return to_vector<double>(t); };
  for (DType dt : {DType::f32, DType::f64}) {
    INFO(dtype_name(dt));
    Tensor a = randn({M, K}, 29, 1, 0, 1, dt), at = contiguous(transpose(a, 0, 1)), b = randn({K, N}, 29, 2, 0, 1, dt);
    Tensor pre = randn({M, N}, 29, 3, 0, 1.5, dt), c = empty({M, N}, dt), bg = empty({N}, dt), rs = empty({M}, dt);
    kernels::GemmArgs g;
    g.dtype = dt;
    g.M = M, g.N = N, g.K = K, g.A = a.data_ptr(), g.lda = K, g.B = b.data_ptr(), g.ldb = N, g.C = c.data_ptr();
    g.ldc = N;
    g.dgelu_pre = pre.data_ptr();
    g.bias_grad = bg.data_ptr();
    SG_KERNEL(Device::cpu(), gemm)(g);
    Tensor want = empty({M, N}, dt), ab = matmul(a, b);
    SG_KERNEL(Device::cpu(), unary_backward)(kernels::Unary::gelu, dt, want.data_ptr(), ab.data_ptr(),
                                             pre.data_ptr(), M * N);
    CHECK(vec(c) == vec(want));
    CHECK(vec(bg) == vec(sum(want, {0})));
    // the derivative itself, not only the plumbing: GELU-tanh's, at one element, in double
    const double p = vec(pre)[3], k = 0.7978845608028654, t = std::tanh(k * (p + 0.044715 * p * p * p));
    const double dgelu = 0.5 * (1 + t) + 0.5 * p * (1 - t * t) * k * (1 + 3 * 0.044715 * p * p);
    CHECK(vec(c)[3] == Approx(vec(ab)[3] * dgelu).epsilon(1e-5));

    kernels::GemmArgs r;
    r.dtype = dt;
    r.M = M, r.N = N, r.K = K, r.B = b.data_ptr(), r.ldb = N, r.C = c.data_ptr(), r.ldc = N;
    r.row_sums_a = rs.data_ptr();
    r.A = a.data_ptr(), r.lda = K;
    SG_KERNEL(Device::cpu(), gemm)(r);
    CHECK(vec(rs) == vec(sum(a, {1})));
    CHECK(vec(c) == vec(ab));
    r.trans_a = true, r.A = at.data_ptr(), r.lda = M;
    SG_KERNEL(Device::cpu(), gemm)(r);
    CHECK(vec(rs) == vec(sum(at, {0})));
    CHECK(vec(c) == vec(ab));
  }
}

TEST_CASE("the CPU gemm refuses an epilogue it cannot apply, naming it", "[ops]") {
  std::vector<float> a(6, 1.0f), b(6, 1.0f), c(4, 0.0f), bias(2, 1.0f);
  kernels::GemmArgs g;
  g.dtype = DType::f32;
  g.M = 2, g.N = 2, g.K = 3, g.A = a.data(), g.lda = 3, g.B = b.data(), g.ldb = 2, g.C = c.data(), g.ldc = 2;
  g.bias = bias.data();
  g.gelu = true;
  g.beta = 1.0;
  REQUIRE_THROWS_WITH(SG_KERNEL(Device::cpu(), gemm)(g), Contains("gemm (cpu): the GELU epilogue needs beta = 0"));
  g.beta = 0.0;
  g.ldc = 3;
  REQUIRE_THROWS_WITH(SG_KERNEL(Device::cpu(), gemm)(g), Contains("needs one contiguous C"));
  g.ldc = 2;
  std::vector<float> resid(4, 2.0f);
  g.residual = resid.data();
  REQUIRE_THROWS_WITH(SG_KERNEL(Device::cpu(), gemm)(g), Contains("gemm (cpu): the residual epilogue needs beta = 0, no "
                                                                    "GELU and a residual that is not C (beta 0, gelu 1"));
  g.gelu = false;
  g.residual = c.data();
  REQUIRE_THROWS_WITH(SG_KERNEL(Device::cpu(), gemm)(g), Contains("(beta 0, gelu 0, residual is C)"));
  g.residual = resid.data();  // product 3, bias 1, residual 2
  SG_KERNEL(Device::cpu(), gemm)(g);
  CHECK(c == std::vector<float>(4, 6.0f));
  g.residual = nullptr, g.gelu = true;
  SG_KERNEL(Device::cpu(), gemm)(g);
  CHECK(c[0] == Approx(0.5 * 4 * (1 + std::tanh(0.7978845608028654 * (4 + 0.044715 * 64)))));
  // the backward epilogues: not with a forward one, not accumulating, A contiguous for row sums
  std::vector<float> pre(4, 0.5f), sums(2, 0.0f);
  g.dgelu_pre = pre.data();
  REQUIRE_THROWS_WITH(SG_KERNEL(Device::cpu(), gemm)(g), Contains("a forward epilogue (bias, gelu, residual) and a backward one"));
  g.bias = nullptr, g.gelu = false;
  g.bias_grad = sums.data();
  g.beta = 1.0;
  REQUIRE_THROWS_WITH(SG_KERNEL(Device::cpu(), gemm)(g), Contains("the dgelu and bias_grad epilogues need beta = 0"));
  g.beta = 0.0, g.dgelu_pre = nullptr, g.bias_grad = nullptr;
  g.row_sums_a = sums.data();
  g.lda = 4;
  REQUIRE_THROWS_WITH(SG_KERNEL(Device::cpu(), gemm)(g), Contains("row_sums_a needs one contiguous A (batch 1, lda 4, K 3)"));
}

TEST_CASE("bf16 and f16 tensors keep their dtype through a small model on the CPU", "[ops]") {
  for (DType dt : {DType::bf16, DType::f16}) {
    INFO(dtype_name(dt));
    Tensor x = randn({4, 6}, 3, 1, 0, 1, dt), w = randn({5, 6}, 3, 2, 0, 0.5, dt), b = randn({5}, 3, 3, 0, 1, dt);
    Tensor lw = ones({5}, dt), lb = zeros({5}, dt);
    w.set_requires_grad(true);
    autograd::Tape tape;
    Tensor loss;
    {
      autograd::TapeScope s(tape);
      loss = sum(gelu(layernorm(linear(x, w, b), lw, lb)));
    }
    CHECK(loss.dtype() == dt);
    tape.backward(loss);
    CHECK(w.grad().dtype() == dt);
    // the same model in f32 on the same (rounded) values
    Tensor w32 = to(w, DType::f32);
    w32.set_requires_grad(true);
    autograd::Tape t32;
    Tensor l32;
    {
      autograd::TapeScope s(t32);
      l32 = sum(gelu(layernorm(linear(to(x, DType::f32), w32, to(b, DType::f32)), to(lw, DType::f32), to(lb, DType::f32))));
    }
    t32.backward(l32);
    const double tol = dt == DType::bf16 ? 3e-2 : 4e-3;
    CHECK(item(loss) == Approx(item(l32)).margin(tol * 4).epsilon(tol));
    auto g = to_vector<float>(w.grad()), g32 = to_vector<float>(w32.grad());
    for (size_t i = 0; i < g.size(); ++i) CHECK(g[i] == Approx(g32[i]).margin(tol * 4).epsilon(tol));
  }
}

TEST_CASE("in-place updates and sum_squares: never recorded, exact on every layout", "[ops]") {
  Tensor t = from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  t.set_requires_grad(true);
  autograd::Tape tape;
  autograd::TapeScope scope(tape);
  // While the tape records, a tensor that requires grad is not written in place: the tape would not see it.
  REQUIRE_THROWS_WITH(add_(t, ones({2, 3})), Contains("add_: in place on f32[2,3] on cpu, which requires grad"));
  REQUIRE_THROWS_WITH(mul_(t, 2.0), Contains("mul_: in place"));
  REQUIRE_THROWS_WITH(fill_(t, 2.0), Contains("fill_: in place"));
  REQUIRE_THROWS_WITH(copy_(t, ones({2, 3})), Contains("copy_: in place"));
  CHECK(to_vector<float>(t) == std::vector<float>{1, 2, 3, 4, 5, 6});
  autograd::NoGradGuard no_grad;  // as an optimizer writes
  add_(t, from_vector<float>({1, 1, 1, 2, 2, 2}, {2, 3}), -0.5);
  CHECK(to_vector<float>(t) == std::vector<float>{0.5f, 1.5f, 2.5f, 3, 4, 5});
  mul_(t, 2.0);
  CHECK(to_vector<float>(t) == std::vector<float>{1, 3, 5, 6, 8, 10});
  CHECK(tape.empty());
  CHECK(t.is_leaf());
  REQUIRE_THROWS_WITH(fill_(transpose(t, 0, 1), 1.0), Contains("fill_: tensor must be contiguous"));
  REQUIRE_THROWS_WITH(add_(t, zeros({3, 2})), Contains("add_: shapes [2,3] and [3,2] differ"));
  // alpha 1 runs in place; a strided addend, and one that is t's own bytes seen another way, too
  add_(t, transpose(from_vector<float>({1, 2, 3, 4, 5, 6}, {3, 2}), 0, 1));
  CHECK(to_vector<float>(t) == std::vector<float>{2, 6, 10, 8, 12, 16});
  add_(t, expand(narrow(t, 0, 0, 1), {2, 3}));  // row 0 added to both rows: the old row 0 to row 1 too
  CHECK(to_vector<float>(t) == std::vector<float>{4, 12, 20, 10, 18, 26});
  zero_(t);
  CHECK(to_vector<float>(t) == std::vector<float>(6, 0.0f));

  Tensor x = randn({7, 9}, 6, 1);
  double want = 0;
  for (float v : to_vector<float>(x)) want += double(v) * double(v);
  CHECK(sum_squares(x) == Approx(want).epsilon(1e-12));
  CHECK(sum_squares(transpose(x, 0, 1)) == Approx(want).epsilon(1e-12));
  Tensor h = to(x, DType::bf16);
  double want_h = 0;
  for (float v : to_vector<float>(h)) want_h += double(v) * double(v);
  CHECK(sum_squares(h) == Approx(want_h).epsilon(1e-12));
  CHECK(count_targets(from_vector<int32_t>({3, -100, 0, -100}, {2, 2}), -100) == 2);
}

TEST_CASE("sum_squares over many tensors: the per-tensor sums added in order, weighted, undefined ones zero",
          "[ops]") {
  // One tensor above the CPU's blocked threshold (2 * 65536), a strided view, a bf16 one, an empty one.
  const std::vector<Tensor> xs = {randn({300, 500}, 1, 1), transpose(randn({7, 9}, 2, 1), 0, 1),
                                  to(randn({33}, 3, 1), DType::bf16), zeros({0}), Tensor(), randn({5}, 4, 1)};
  const std::vector<double> w = {1, 0.5, 1, 1, 1, 0};
  double want = 0, want_w = 0;
  for (size_t i = 0; i < xs.size(); ++i)
    if (xs[i].defined()) {
      want += sum_squares(xs[i]);
      want_w += w[i] * sum_squares(xs[i]);
    }
  CHECK(sum_squares(xs) == want);  // the same bits, not merely close
  CHECK(sum_squares(xs, w) == want_w);
  CHECK(want_w != want);
  CHECK(sum_squares(std::vector<Tensor>{}) == 0.0);
  REQUIRE_THROWS_WITH(sum_squares(xs, {1.0}), Contains("sum_squares: 1 weights for 6 tensors"));
}

TEST_CASE("ops that may hand back their input never turn a leaf into a recorded output", "[ops]") {
  autograd::Tape tape;
  autograd::TapeScope scope(tape);
  using Op = std::function<Tensor(const Tensor&)>;
  const std::vector<std::pair<const char*, Op>> ops = {
      {"sum over no dims", [](const Tensor& x) { return sum(x, {}, true); }},
      {"sum over no dims, keepdim=false", [](const Tensor& x) { return sum(x, {}); }},
      {"mean over no dims", [](const Tensor& x) { return mean(x, {}); }},
      {"sum_to the same shape", [](const Tensor& x) { return sum_to(x, {3, 4}); }},
      {"contiguous", [](const Tensor& x) { return contiguous(x); }},
      {"to the same dtype", [](const Tensor& x) { return to(x, DType::f64); }},
      {"dropout p=0", [](const Tensor& x) { return dropout(x, 0.0); }},
      {"reshape to the same shape", [](const Tensor& x) { return reshape(x, {3, 4}); }}};
  for (const auto& [name, op] : ops) {
    INFO(name);
    Tensor x = randn({3, 4}, 6, 2, 0, 1, DType::f64);
    x.set_requires_grad(true);
    Tensor y = op(x);
    CHECK(x.is_leaf());
    CHECK(to_vector<double>(y) == to_vector<double>(x));
  }
}

TEST_CASE("edge cases as PyTorch has them: 0-d dims, repeated dims, empty K, overlapping copies, NaN in max", "[ops]") {
  const Tensor s = from_vector<float>({3.f}, {});
  // A 0-d tensor's dim 0 (or -1) is itself for reductions, transpose and squeeze; other ops refuse it.
  CHECK(to_vector<float>(sum(s, {0})) == std::vector<float>{3.f});
  CHECK(sum(s, {-1}).dim() == 0);
  CHECK(to_vector<float>(mean(s, {0})) == std::vector<float>{3.f});
  CHECK(to_vector<float>(amax(s, 0)) == std::vector<float>{3.f});
  CHECK(transpose(s, 0, -1).dim() == 0);
  CHECK(squeeze(s, 0).dim() == 0);
  REQUIRE_THROWS_WITH(sum(s, {1}), Contains("sum: dimension 1 out of range for a 1-d tensor"));
  REQUIRE_THROWS_WITH(narrow(s, 0, 0, 1), Contains("narrow: a 0-d tensor has no dimension 0"));
  REQUIRE_THROWS_WITH(cat({s, s}, 0), Contains("cat: a 0-d tensor has no dimension 0"));
  REQUIRE_THROWS_WITH(chunk(s, 1, 0), Contains("chunk: a 0-d tensor has no dimension 0"));
  // A dim named twice is refused (mean divided by its size twice).
  const Tensor x = from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  REQUIRE_THROWS_WITH(mean(x, {0, 0}), Contains("mean: a dim appears more than once"));
  REQUIRE_THROWS_WITH(sum(x, {1, -1}), Contains("sum: a dim appears more than once"));
  CHECK(to_vector<float>(mean(x, {0})) == std::vector<float>{2.5f, 3.5f, 4.5f});
  // An f16 mean is scaled before it is rounded to f16: 70000 ones average to 1, not inf.
  CHECK(to_vector<float>(mean(full({70000}, 1.0, DType::f16))) == std::vector<float>{1.f});
  CHECK(to_vector<float>(mean(full({2, 70000}, 1.0, DType::f16), {1})) == std::vector<float>{1.f, 1.f});
  // amax over an empty dim has no maximum.
  REQUIRE_THROWS_WITH(amax(zeros({2, 0}), 1), Contains("amax: dim 1 of [2,0] is empty"));
  // K = 0: the product of nothing is zeros, in both matmul paths.
  CHECK(to_vector<float>(matmul(zeros({3, 0}), zeros({0, 4}))) == std::vector<float>(12, 0.f));
  CHECK(to_vector<float>(matmul(zeros({2, 3, 0}), zeros({2, 0, 4}))) == std::vector<float>(24, 0.f));
  // copy_ from a view of the destination's own bytes reads them all before it writes.
  Tensor m = contiguous(reshape(from_vector<float>({0, 1, 2, 3}, {4}), {2, 2}));
  copy_(m, transpose(m, 0, 1));
  CHECK(to_vector<float>(m) == std::vector<float>{0, 2, 1, 3});
  Tensor r = from_vector<float>({0, 1, 2, 3, 4, 5}, {6});
  copy_(narrow(r, 0, 0, 5), narrow(r, 0, 1, 5));
  CHECK(to_vector<float>(r) == std::vector<float>{1, 2, 3, 4, 5, 5});
  // max keeps a NaN from either side, and a row's NaN wherever it is.
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const auto mx = to_vector<float>(maximum(from_vector<float>({1, nan, 3}, {3}), from_vector<float>({2, 0, nan}, {3})));
  CHECK(mx[0] == 2.f);
  CHECK(std::isnan(mx[1]));
  CHECK(std::isnan(mx[2]));
  const auto rows = to_vector<float>(amax(from_vector<float>({1, nan, 3, -inf, 5, 2}, {3, 2}), 1));
  CHECK(std::isnan(rows[0]));
  CHECK(rows[1] == 3.f);
  CHECK(rows[2] == 5.f);
  const auto cols = to_vector<float>(amax(from_vector<float>({1, nan, 3, -inf, 5, 2}, {3, 2}), 0));
  CHECK(cols[0] == 5.f);
  CHECK(std::isnan(cols[1]));
  // pow(x, 0) is a constant: its gradient is 0, also at x = 0.
  Tensor z = zeros({2});
  z.set_requires_grad(true);
  autograd::Tape tape;
  {
    autograd::TapeScope scope(tape);
    tape.backward(sum(pow(z, 0.0)));
  }
  CHECK(to_vector<float>(z.grad()) == std::vector<float>{0.f, 0.f});
  // Integers convert as integers: 2^24 + 1 (which a float cannot hold) exactly, 2^40 + 5 to i32 wrapping to 5.
  const Tensor big = from_vector<int64_t>({(int64_t(1) << 24) + 1, (int64_t(1) << 40) + 5, -3, int64_t(1) << 31}, {2, 2});
  CHECK(to_vector<int32_t>(to(big, DType::i32)) == std::vector<int32_t>{(1 << 24) + 1, 5, -3, INT32_MIN});
  CHECK(to_vector<int32_t>(to(transpose(big, 0, 1), DType::i32)) == std::vector<int32_t>{(1 << 24) + 1, -3, 5, INT32_MIN});
  CHECK(to_vector<int64_t>(to(to(big, DType::i32), DType::i64)) ==
        std::vector<int64_t>{(1 << 24) + 1, 5, -3, int64_t(INT32_MIN)});
  // A norm's weight and bias, and linear's bias, must be in the input's dtype.
  const Tensor in = ones({2, 4});
  REQUIRE_THROWS_WITH(layernorm(in, ones({4}, DType::f64), ones({4})), Contains("layernorm: weight"));
  REQUIRE_THROWS_WITH(layernorm(in, ones({4}), ones({4}, DType::f64)), Contains("must have the input's dtype"));
  REQUIRE_THROWS_WITH(rmsnorm(in, ones({4}, DType::bf16)), Contains("rmsnorm: weight"));
  REQUIRE_THROWS_WITH(linear(in, ones({5, 4}), ones({5}, DType::f64)), Contains("linear: bias dtype f64 but weight dtype f32"));
}

// From an audit of the ops against PyTorch's behaviour.
TEST_CASE("relu keeps NaN, expand takes -1 for a dim as it is, site dropout of nothing, logits without classes",
          "[ops]") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const auto r = to_vector<float>(relu(from_vector<float>({nan, -1.0f, 2.0f}, {3})));
  CHECK(std::isnan(r[0]));  // a NaN activation must stay visible to --on-nonfinite
  CHECK(r[1] == 0.0f);
  CHECK(r[2] == 2.0f);
  const Tensor v = from_vector<float>({1, 2, 3}, {3, 1});
  CHECK(expand(v, {2, -1, 4}).shape() == Shape{2, 3, 4});
  REQUIRE_THROWS_WITH(expand(v, {-2, 3, 1}), Contains("expand: cannot expand [3,1] to [-2,3,1] (a new dim of size -2)"));
  REQUIRE_THROWS_WITH(expand(v, {-1, 3, 1}), Contains("a new dim of size -1"));
  DropoutGenerator& gen = dropout_generator();
  gen = DropoutGenerator::seeded(5);
  gen.place = DropoutPlace{1, 0, 0};
  CHECK(dropout(zeros({2, 0, 4}), 0.5, 3).shape() == Shape{2, 0, 4});
  gen = DropoutGenerator{};
  const Tensor t = from_vector<int64_t>({0}, {1});
  REQUIRE_THROWS_WITH(cross_entropy(zeros({}), t), Contains("cross_entropy: logits [] have no class dim"));
  REQUIRE_THROWS_WITH(cross_entropy(zeros({1, 0}), t), Contains("cross_entropy: logits [1,0] have no class dim"));
}

#include "kernels/profile.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/error.h"
#include "kernels/ops.h"
#ifdef SG_WITH_CUDA
#include "kernels/cuda/runtime.h"
#endif

namespace sg::kernels {

// Every function entry of OpTable. The assertion below fails when an entry is added to OpTable
// and not here (all its members are pointers: device_name and the entries).
#define SG_OP_TABLE_ENTRIES(X)                                                                                  \
  X(copy_strided) X(scatter_strided) X(fill) X(binary) X(unary) X(unary_backward) X(reduce) X(gemm) X(softmax) \
  X(softmax_backward) X(layernorm) X(layernorm_backward) X(residual_layernorm) X(residual_layernorm_backward)  \
  X(rmsnorm) X(rmsnorm_backward) X(embedding) X(embedding_backward) X(cross_entropy) X(cross_entropy_backward) \
  X(cross_entropy_fused) X(dropout) X(attention) X(attention_backward) X(random) X(adamw) X(adamw_many)         \
  X(sum_squares_many) X(copy_to_host) X(copy_from_host)

#define SG_ONE(e) +1
static_assert(sizeof(OpTable) == (1 SG_OP_TABLE_ENTRIES(SG_ONE)) * sizeof(void*),
              "an OpTable entry is missing from SG_OP_TABLE_ENTRIES (kernels/profile.cpp)");
#undef SG_ONE

struct OpProfiler::Impl {
  struct Call {
    const char* entry;
    double host_ms, flops;
    int mark_before, mark_after;  // -1 on the CPU
  };
  Device device;
  std::thread::id owner = std::this_thread::get_id();
  const OpTable* real = nullptr;
  std::vector<Call> calls;
#ifdef SG_WITH_CUDA
  std::unique_ptr<cuda::StreamMarks> marks;
#endif
  int mark() {
#ifdef SG_WITH_CUDA
    if (marks) return marks->mark();
#endif
    return -1;
  }
};

namespace {

std::atomic<OpProfiler::Impl*> g_active{nullptr};
// The table the wrapped entries forward to. Set before the wrapped table is installed and never
// cleared, so a thread that fetched the wrapped table just before it was taken down still lands.
std::atomic<const OpTable*> g_real{nullptr};
thread_local int t_depth = 0;  // entries of the owner thread under way (nested calls count once)

class Timed {
 public:
  Timed(const char* entry, double flops) {
    OpProfiler::Impl* p = g_active.load();
    if (!p || p->owner != std::this_thread::get_id()) return;
    if (t_depth > 0) {
      ++t_depth;
      nested_ = true;
      return;
    }
    before_ = p->mark();  // first: if it throws, no destructor runs to undo what follows
    ++t_depth;
    p_ = p;
    entry_ = entry;
    flops_ = flops;
    t0_ = std::chrono::steady_clock::now();
  }
  ~Timed() {
    if (nested_) --t_depth;
    if (!p_) return;
    const double host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_).count();
    --t_depth;
    int after = -1;
    try {
      after = p_->mark();
    } catch (...) {  // a failed mark drops this call's device time rather than throw from a destructor
      after = -1;
    }
    p_->calls.push_back({entry_, host_ms, flops_, before_, after});
  }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  OpProfiler::Impl* p_ = nullptr;
  bool nested_ = false;
  const char* entry_ = nullptr;
  double flops_ = 0;
  int before_ = -1;
  std::chrono::steady_clock::time_point t0_;
};

template <auto Entry, class Fn>
struct Wrapped;
template <auto Entry, class R, class... A>
struct Wrapped<Entry, R (*)(A...)> {
  static inline const char* name = nullptr;
  static inline double (*flops)(A...) = nullptr;  // the entries that count model FLOPs
  static R call(A... a) {
    Timed timed(name, flops ? flops(a...) : 0.0);
    return (g_real.load()->*Entry)(a...);
  }
};

template <auto Entry>
using WrappedEntry = Wrapped<Entry, std::remove_reference_t<decltype(std::declval<OpTable&>().*Entry)>>;

double attention_flops(const AttentionArgs& a) {
  return 4.0 * double(a.B) * double(a.H) * double(a.T) * double(a.T) * double(a.D) * (a.causal ? 0.5 : 1.0);
}

template <auto Entry>
void wrap(OpTable& t, const char* name) {
  if (!(t.*Entry)) return;  // the device lacks it: calls still fail naming the op
  WrappedEntry<Entry>::name = name;
  t.*Entry = &WrappedEntry<Entry>::call;
}

// One wrapped table per device type, kept for the process (see g_real).
OpTable& wrapped_table(DeviceType t) {
  static OpTable tables[kNumDeviceTypes];
  return tables[int(t)];
}

}  // namespace

OpProfiler::OpProfiler(Device d) : impl_(std::make_unique<Impl>()) {
  impl_->device = d;
  impl_->real = &table(d);  // registers the CUDA table on first use
#ifdef SG_WITH_CUDA
  if (d.is_cuda()) impl_->marks = std::make_unique<cuda::StreamMarks>(d);
#endif
  Impl* none = nullptr;
  SG_CHECK(g_active.compare_exchange_strong(none, impl_.get()), "OpProfiler: another profiler is active");
  g_real = impl_->real;
  OpTable& t = wrapped_table(d.type);
  t = *impl_->real;
#define SG_WRAP(e) wrap<&OpTable::e>(t, #e);
  SG_OP_TABLE_ENTRIES(SG_WRAP)
#undef SG_WRAP
  WrappedEntry<&OpTable::gemm>::flops = [](const GemmArgs& g) {
    return 2.0 * double(g.M) * double(g.N) * double(g.K) * double(g.batch);
  };
  WrappedEntry<&OpTable::attention>::flops = attention_flops;
  WrappedEntry<&OpTable::attention_backward>::flops = [](const AttentionArgs& a) { return 2.5 * attention_flops(a); };
  register_table(d.type, &t);
}

OpProfiler::~OpProfiler() {
  register_table(impl_->device.type, impl_->real);
  g_active = nullptr;
}

std::map<std::string, OpTime> OpProfiler::take() {
  std::map<std::string, OpTime> out;
  for (const Impl::Call& c : impl_->calls) {
    OpTime& o = out[c.entry];
    ++o.calls;
    o.host_ms += c.host_ms;
    o.flops += c.flops;
#ifdef SG_WITH_CUDA
    if (impl_->marks && c.mark_before >= 0 && c.mark_after >= 0)
      o.device_ms += impl_->marks->elapsed_ms(c.mark_before, c.mark_after);  // the first waits for the rest
#endif
  }
  impl_->calls.clear();
#ifdef SG_WITH_CUDA
  if (impl_->marks) impl_->marks->reset();
#endif
  return out;
}

}  // namespace sg::kernels

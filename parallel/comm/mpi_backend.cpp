#include "parallel/comm/mpi_backend.h"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstring>
#include <vector>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "core/error.h"

namespace sg::comm {

// ---- process-wide state: thread level, the 2-byte float types and their reductions, live groups ----

namespace {
struct MpiState {
  std::mutex mu;
  bool ready = false;          // init() has run since the last finalize()
  bool initialised_by_us = false;
  int provided = MPI_THREAD_SINGLE;
  MPI_Datatype bf16 = MPI_DATATYPE_NULL, f16 = MPI_DATATYPE_NULL;
  MPI_Op half_sum = MPI_OP_NULL, half_max = MPI_OP_NULL;
  std::vector<MpiProcessGroup*> groups;  // creation order, so every rank frees them in one order
};
MpiState& state() {
  static MpiState s;
  return s;
}

// Widen each pair to f32, reduce, round back (the datatype says which 2-byte format it is).
template <bool Max>
void reduce_half(void* in, void* inout, int* len, MPI_Datatype* dt) {
  bool bf = *dt == state().bf16;
  auto a = static_cast<const uint16_t*>(in);
  auto b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    float x = bf ? bf16_to_f32(a[i]) : f16_to_f32(a[i]);
    float y = bf ? bf16_to_f32(b[i]) : f16_to_f32(b[i]);
    float r = Max ? std::max(x, y) : x + y;
    b[i] = bf ? f32_to_bf16(r) : f32_to_f16(r);
  }
}

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::bf16: return state().bf16;
    case DType::f16: return state().f16;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(ReduceOp op, DType t) {
  if (op == ReduceOp::max) return is_half(t) ? state().half_max : MPI_MAX;
  return is_half(t) ? state().half_sum : MPI_SUM;  // avg = sum, then divide
}

// avg: dst = src divided by the group size, in f32 for the 2-byte formats (dst may be src).
void divide(void* dst, const void* src, int64_t n, DType t, int by) {
  switch (t) {
    case DType::f32:
      for (int64_t i = 0; i < n; ++i) static_cast<float*>(dst)[i] = static_cast<const float*>(src)[i] / float(by);
      break;
    case DType::f64:
      for (int64_t i = 0; i < n; ++i) static_cast<double*>(dst)[i] = static_cast<const double*>(src)[i] / double(by);
      break;
    case DType::bf16:
      for (int64_t i = 0; i < n; ++i)
        static_cast<uint16_t*>(dst)[i] = f32_to_bf16(bf16_to_f32(static_cast<const uint16_t*>(src)[i]) / float(by));
      break;
    case DType::f16:
      for (int64_t i = 0; i < n; ++i)
        static_cast<uint16_t*>(dst)[i] = f32_to_f16(f16_to_f32(static_cast<const uint16_t*>(src)[i]) / float(by));
      break;
    default: throw Error(str("avg: not defined for ", dtype_name(t)));
  }
}
void divide(void* p, int64_t n, DType t, int by) { divide(p, p, n, t, by); }

// f16 tops out at 65504: the sum of an average can overflow where the average (and each rank's
// part) does not, which a loss-scaled gradient is near by design. Its parts are divided before the
// sum, as PyTorch's DDP divides its buckets before the all-reduce. Each partial sum is still
// rounded to f16, so an average within rounding of 65504 can still overflow when N is not a power
// of two (65504/3 rounds up, and three of it round to inf), and parts below f16's subnormals
// (~6e-8 · N) flush to zero: the loss scaler backs off from the first and keeps gradients far
// above the second. (bf16 has f32's range: it sums, then divides once.)
bool divides_first(ReduceOp op, DType t) { return op == ReduceOp::avg && t == DType::f16; }
bool divides_after(ReduceOp op, DType t) { return op == ReduceOp::avg && t != DType::f16; }
// n elements of src divided by `by` into a fresh host buffer (ledger: comm_buffer).
Tensor divided_copy(const void* src, int64_t n, DType t, int by) {
  Tensor parts;
  {
    MemScope scope(MemCategory::comm_buffer);
    parts = Tensor::empty({n}, t);
  }
  divide(parts.data_ptr(), src, n, t, by);
  return parts;
}

int mpi_count(const char* op, int64_t n) {
  SG_CHECK(n <= INT_MAX, op, ": ", n, " elements exceed MPI's int count; split the tensor");
  return int(n);
}
}  // namespace

int init(int* argc, char*** argv) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.ready) return s.provided;
  int initialised = 0, finalized = 0;
  MPI_Initialized(&initialised);
  MPI_Finalized(&finalized);
  SG_CHECK(!finalized, "comm::init: MPI has already been finalized");
  if (initialised) {
    MPI_Query_thread(&s.provided);
  } else {
    MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &s.provided);
    s.initialised_by_us = true;
  }
  MPI_Type_contiguous(1, MPI_UINT16_T, &s.bf16);
  MPI_Type_commit(&s.bf16);
  MPI_Type_contiguous(1, MPI_UINT16_T, &s.f16);
  MPI_Type_commit(&s.f16);
  MPI_Op_create(&reduce_half<false>, 1, &s.half_sum);
  MPI_Op_create(&reduce_half<true>, 1, &s.half_max);
  s.ready = true;
  return s.provided;
}

namespace {
void reap_orphans(bool wait);
}  // namespace

void finalize() {
  auto& s = state();
  std::vector<MpiProcessGroup*> groups;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.ready) return;
    groups = s.groups;
  }
  int fin = 0;
  MPI_Finalized(&fin);
  if (!fin) reap_orphans(true);  // dropped sends and receives finish before their communicators go
  for (auto* g : groups) g->shutdown();
  std::lock_guard<std::mutex> lock(s.mu);
  s.ready = false;
  MPI_Finalized(&fin);
  if (fin) return;  // whoever initialised MPI has finalized it already
  MPI_Type_free(&s.bf16);
  MPI_Type_free(&s.f16);
  MPI_Op_free(&s.half_sum);
  MPI_Op_free(&s.half_max);
  if (s.initialised_by_us) MPI_Finalize();
}

bool threaded() { return state().provided == MPI_THREAD_MULTIPLE; }

// ---- host staging and point-to-point Work ----

namespace {
// A pointer MPI can use: the tensor's own bytes on the CPU, else a host copy charged to
// comm_buffer (CUDA tensors; copy_ does the device transfer) in page-locked memory, so the
// transfers run at full bus bandwidth (the cached pinned allocator makes it cheap to take).
class HostView {
 public:
  HostView(const Tensor& t, bool copy_in) : dev_(t) {
    if (t.device().is_cpu()) {
      host_ = t;
      return;
    }
    MemScope scope(MemCategory::comm_buffer);
    host_ = Tensor::empty_pinned(t.shape(), t.dtype());
    if (copy_in) copy_(host_, t);
  }
  void* ptr() const { return host_.data_ptr(); }
  void copy_out() const {
    if (!dev_.device().is_cpu()) copy_(dev_, host_);
  }

 private:
  Tensor dev_, host_;
};

std::string mpi_error(int rc) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  return std::string(msg, size_t(len));
}

// Sends and receives whose Work was dropped before they completed (PyTorch's isend without a
// wait): MPI still owns their buffers, which are kept alive here. Each new send, recv or barrier
// polls them (a finished receive is copied out then) and finalize waits for the rest. Waiting in the
// Work's destructor deadlocked two ranks that each dropped a large send before posting the
// receive its peer's send needed.
struct Orphan {
  MPI_Request req;
  HostView buf;
  bool receives;
};
std::mutex g_orphans_mu;
std::vector<Orphan> g_orphans;

void adopt(MPI_Request req, HostView buf, bool receives) {
  std::lock_guard<std::mutex> lock(g_orphans_mu);
  g_orphans.push_back(Orphan{req, std::move(buf), receives});
}

// Completes the orphans that have finished (all of them when wait): a receive into a device
// tensor is copied there now. Their errors have no one to go to (the caller dropped the Work):
// they are printed, never thrown into the unrelated call that reaps them.
void reap_orphans(bool wait) {
  std::vector<Orphan> done;
  {
    std::lock_guard<std::mutex> lock(g_orphans_mu);
    for (auto it = g_orphans.begin(); it != g_orphans.end();) {
      int flag = 0;
      const int rc = wait ? MPI_Wait(&it->req, MPI_STATUS_IGNORE) : MPI_Test(&it->req, &flag, MPI_STATUS_IGNORE);
      if (wait || flag || rc != MPI_SUCCESS) {
        if (rc != MPI_SUCCESS)
          std::fprintf(stderr, "shardgrad: a dropped %s failed: %s\n", it->receives ? "recv" : "send",
                       mpi_error(rc).c_str());
        else if (it->receives)
          done.push_back(std::move(*it));
        it = g_orphans.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (Orphan& o : done) {
    try {
      autograd::NoGradGuard ng;
      o.buf.copy_out();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "shardgrad: a dropped recv could not be copied to its tensor: %s\n", e.what());
    }
  }
}

// A posted MPI_Isend/MPI_Irecv. Dropped unfinished, it becomes an orphan (above).
class RequestWork : public Work {
 public:
  RequestWork(std::string what, std::string at, MPI_Request req, HostView buf, bool receives)
      : what_(std::move(what)), at_(std::move(at)), req_(req), buf_(std::move(buf)), receives_(receives) {}
  ~RequestWork() override {
    int fin = 0;
    MPI_Finalized(&fin);
    if (!done_ && !fin) adopt(req_, std::move(buf_), receives_);
  }
  void wait() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_) complete(MPI_Wait(&req_, MPI_STATUS_IGNORE));
    if (!err_.empty()) throw Error(err_);
  }
  bool test() override {
    std::lock_guard<std::mutex> lock(mu_);
    int flag = 0;
    if (!done_) {
      int rc = MPI_Test(&req_, &flag, MPI_STATUS_IGNORE);
      if (flag || rc != MPI_SUCCESS) complete(rc);
    }
    return done_;
  }

 private:
  void complete(int rc) {
    done_ = true;
    if (rc != MPI_SUCCESS) err_ = str(what_, ": MPI error: ", mpi_error(rc), at_);
    else if (receives_) buf_.copy_out();
  }
  std::mutex mu_;
  std::string what_, at_;
  MPI_Request req_;
  HostView buf_;
  bool receives_;
  bool done_ = false;
  std::string err_;
};
}  // namespace

// ---- the group ----

namespace {
int comm_rank(MPI_Comm c) {
  SG_CHECK(state().ready, "MpiProcessGroup: call sg::comm::init() first");
  int r = 0;
  MPI_Comm_rank(c, &r);
  return r;
}
int comm_size(MPI_Comm c) {
  int n = 0;
  MPI_Comm_size(c, &n);
  return n;
}
}  // namespace

std::shared_ptr<MpiProcessGroup> MpiProcessGroup::world() {
  SG_CHECK(state().ready, "MpiProcessGroup::world: call sg::comm::init() first");
  MPI_Comm c;
  MPI_Comm_dup(MPI_COMM_WORLD, &c);
  return std::make_shared<MpiProcessGroup>(c);
}

MpiProcessGroup::MpiProcessGroup(MPI_Comm comm) : ProcessGroup(comm_rank(comm), comm_size(comm)), comm_(comm) {
  auto& s = state();
  // Errors come back as codes, so they surface as exceptions from wait() naming the op and rank.
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  if (threaded()) queue_ = std::make_unique<WorkQueue>();
  std::lock_guard<std::mutex> lock(s.mu);
  s.groups.push_back(this);
}

MpiProcessGroup::~MpiProcessGroup() {
  shutdown();
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.groups.erase(std::remove(s.groups.begin(), s.groups.end(), this), s.groups.end());
}

void MpiProcessGroup::shutdown() {
  if (queue_) queue_->stop();
  queue_.reset();
  int fin = 0;
  MPI_Finalized(&fin);
  if (comm_ != MPI_COMM_NULL && !fin) MPI_Comm_free(&comm_);
  comm_ = MPI_COMM_NULL;
}

std::shared_ptr<Work> MpiProcessGroup::enqueue(const char* op, std::function<void()> body) {
  SG_CHECK(comm_ != MPI_COMM_NULL, op, ": ", closed_reason(), at());
  return queue_ ? queue_->push(std::move(body), issuing_blocking()) : WorkQueue::run_inline(body);
}

// Turns an MPI error code into an Error naming the op and this rank.
#define SG_MPI_CHECK(op, call)                                                                     \
  do {                                                                                       \
    int rc_ = (call);                                                                        \
    SG_CHECK(rc_ == MPI_SUCCESS, op, ": MPI error: ", mpi_error(rc_), at());                 \
  } while (0)

std::shared_ptr<Work> MpiProcessGroup::do_all_reduce(const Tensor& t, ReduceOp op) {
  int n = mpi_count("all_reduce", t.numel());
  return enqueue("all_reduce", [=, this] {
    HostView buf(t, true);
    if (divides_first(op, t.dtype())) divide(buf.ptr(), n, t.dtype(), size());
    SG_MPI_CHECK("all_reduce", MPI_Allreduce(MPI_IN_PLACE, buf.ptr(), n, mpi_type(t.dtype()), mpi_op(op, t.dtype()), comm_));
    if (divides_after(op, t.dtype())) divide(buf.ptr(), n, t.dtype(), size());
    buf.copy_out();
  });
}

std::shared_ptr<Work> MpiProcessGroup::do_reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) {
  int n = mpi_count("reduce_scatter", out.numel());
  return enqueue("reduce_scatter", [=, this] {
    HostView src(in, true), dst(out, false);
    const void* send = src.ptr();
    Tensor parts;  // the input divided first (f16), leaving the caller's as it was
    if (divides_first(op, in.dtype())) {
      parts = divided_copy(src.ptr(), in.numel(), in.dtype(), size());
      send = parts.data_ptr();
    }
    SG_MPI_CHECK("reduce_scatter", MPI_Reduce_scatter_block(send, dst.ptr(), n, mpi_type(in.dtype()),
                                                      mpi_op(op, in.dtype()), comm_));
    if (divides_after(op, out.dtype())) divide(dst.ptr(), n, out.dtype(), size());
    dst.copy_out();
  });
}

std::shared_ptr<Work> MpiProcessGroup::do_all_gather(const Tensor& out, const Tensor& in) {
  int n = mpi_count("all_gather", in.numel());
  // ProcessGroup::all_gather allows an overlap only when the input is exactly this rank's chunk.
  bool in_place = in.storage() == out.storage() &&
                  in.data_ptr() == static_cast<char*>(out.data_ptr()) + size_t(rank()) * in.nbytes();
  return enqueue("all_gather", [=, this] {
    MPI_Datatype type = mpi_type(in.dtype());
    HostView dst(out, in_place);  // in place: this rank's chunk already sits in the output
    if (in_place) {
      SG_MPI_CHECK("all_gather", MPI_Allgather(MPI_IN_PLACE, 0, type, dst.ptr(), n, type, comm_));
    } else {
      HostView src(in, true);
      SG_MPI_CHECK("all_gather", MPI_Allgather(src.ptr(), n, type, dst.ptr(), n, type, comm_));
    }
    dst.copy_out();
  });
}

std::shared_ptr<Work> MpiProcessGroup::do_broadcast(const Tensor& t, int root) {
  int n = mpi_count("broadcast", t.numel());
  return enqueue("broadcast", [=, this] {
    HostView buf(t, rank() == root);
    SG_MPI_CHECK("broadcast", MPI_Bcast(buf.ptr(), n, mpi_type(t.dtype()), root, comm_));
    buf.copy_out();
  });
}

std::shared_ptr<Work> MpiProcessGroup::do_reduce(const Tensor& t, int root, ReduceOp op) {
  int n = mpi_count("reduce", t.numel());
  return enqueue("reduce", [=, this] {
    HostView buf(t, true);
    bool is_root = rank() == root;
    void* send = buf.ptr();
    Tensor parts;  // f16: this rank's part divided first; a non-root's tensor is left as it was
    if (divides_first(op, t.dtype())) {
      parts = divided_copy(buf.ptr(), n, t.dtype(), size());
      if (is_root) std::memcpy(buf.ptr(), parts.data_ptr(), size_t(parts.nbytes()));
      send = parts.data_ptr();
    }
    SG_MPI_CHECK("reduce", MPI_Reduce(is_root ? MPI_IN_PLACE : send, is_root ? buf.ptr() : nullptr, n,
                                mpi_type(t.dtype()), mpi_op(op, t.dtype()), root, comm_));
    if (!is_root) return;
    if (divides_after(op, t.dtype())) divide(buf.ptr(), n, t.dtype(), size());
    buf.copy_out();
  });
}

std::shared_ptr<Work> MpiProcessGroup::do_barrier() {
  reap_orphans(false);
  return enqueue("barrier", [this] { SG_MPI_CHECK("barrier", MPI_Barrier(comm_)); });
}

std::string MpiProcessGroup::closed_reason() const {
  return comm_ == MPI_COMM_NULL ? "the process group was shut down (comm::finalize)" : "";
}

int MpiProcessGroup::backend_max_tag() const {
  static const int ub = [] {
    int* v = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &v, &flag);  // a predefined attribute of the world
    return flag && v ? *v : 32767;                               // the standard's least upper bound
  }();
  return ub;
}

std::shared_ptr<Work> MpiProcessGroup::do_send(const Tensor& t, int dst, int tag) {
  reap_orphans(false);  // (a closed group was refused before: ProcessGroup::count)
  HostView buf(t, true);
  MPI_Request req;
  SG_MPI_CHECK("send", MPI_Isend(buf.ptr(), mpi_count("send", t.numel()), mpi_type(t.dtype()), dst, tag, comm_, &req));
  return std::make_shared<RequestWork>(str("send to ", dst, ", tag ", tag), at(), req, std::move(buf), false);
}

std::shared_ptr<Work> MpiProcessGroup::do_recv(const Tensor& t, int src, int tag) {
  reap_orphans(false);
  HostView buf(t, false);
  MPI_Request req;
  SG_MPI_CHECK("recv", MPI_Irecv(buf.ptr(), mpi_count("recv", t.numel()), mpi_type(t.dtype()), src, tag, comm_, &req));
  return std::make_shared<RequestWork>(str("recv from ", src, ", tag ", tag), at(), req, std::move(buf), true);
}

std::shared_ptr<ProcessGroup> MpiProcessGroup::do_split(int color, int key) {
  MPI_Comm sub = MPI_COMM_NULL;
  // On the queue, like any collective over this communicator, so it stays in issue order.
  enqueue("split", [&, this] { SG_MPI_CHECK("split", MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub)); })
      ->wait();
  if (sub == MPI_COMM_NULL) return nullptr;
  return std::make_shared<MpiProcessGroup>(sub);
}

}  // namespace sg::comm

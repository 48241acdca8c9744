// The op table's GEMM through cuBLASLt, on the compute stream of the device that holds C.
//
// cuBLASLt is column-major; the op table is row-major. A row-major [r, c] matrix with leading
// dimension ld is the column-major [c, r] matrix with the same ld, i.e. its transpose, so
//   C = op(A) op(B)   (row-major)   <=>   C^T = op(B)^T op(A)^T   (column-major)
// and the call is made with the operands swapped: first B (m = N), then A (n = M), k = K, each
// keeping its own transpose flag. Batches use strided batch offsets. Compute is f32 for every
// dtype (bf16/f16 inputs accumulate in f32); f32 inputs may use TF32 tensor cores when allowed.
#include <cublasLt.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/storage.h"
#include "kernels/cuda/gemm_choices.h"
#include "kernels/cuda/runtime.h"

#define SG_CUBLAS_CHECK(call)                                                                           \
  do {                                                                                                  \
    cublasStatus_t sg_st_ = (call);                                                                     \
    if (sg_st_ != CUBLAS_STATUS_SUCCESS)                                                                \
      throw ::sg::Error(::sg::str(#call, " failed: ", cublasLtGetStatusName(sg_st_), " (",              \
                                  cublasLtGetStatusString(sg_st_), ", ", __FILE__, ":", __LINE__, ")")); \
  } while (0)

namespace sg::cuda {

namespace {

std::atomic<bool> g_allow_tf32{false};
// SG_GEMM_TUNE=1 (or set_gemm_tuning): time the heuristic's candidates on each shape's first call.
std::atomic<bool> g_tune_gemms{[] {
  const char* e = std::getenv("SG_GEMM_TUNE");
  return e && *e && std::string(e) != "0";
}()};

// 32 MiB: what cuBLASLt's Hopper kernels ask for at most (NVIDIA's recommendation for sm_90).
constexpr size_t kWorkspaceBytes = size_t(32) << 20;

cublasLtHandle_t handle_for(Device d) {
  return once_per_device<cublasLtHandle_t>(d, [] {
    cublasLtHandle_t h;
    SG_CUBLAS_CHECK(cublasLtCreate(&h));
    return h;
  });
}

cudaDataType_t cuda_type(DType t, const char* op) {
  switch (t) {
    case DType::f32: return CUDA_R_32F;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f16: return CUDA_R_16F;
    default: kernels::unsupported(op, t, "cuda (cuBLASLt)");
  }
}

// Owners of the cuBLASLt descriptors of one call (destroyed on every path, throws included).
struct Desc {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Desc() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// Column-major layout of a stored matrix: rows x cols, leading dimension ld, batch at stride.
void make_layout(cublasLtMatrixLayout_t* l, cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld, int64_t batch,
                 int64_t stride) {
  SG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(l, t, uint64_t(rows), uint64_t(cols), ld));
  if (batch > 1) {
    const int32_t count = int32_t(batch);
    SG_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    SG_CUBLAS_CHECK(
        cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  }
}

// The largest power of two, at most 256, that divides every non-null address: what the chosen
// algorithm may assume (a view at an odd offset must not get a kernel that needs 16-byte loads).
uint32_t min_alignment(std::initializer_list<const void*> ptrs) {
  uintptr_t bits = 256;
  for (const void* p : ptrs)
    if (p) bits |= reinterpret_cast<uintptr_t>(p);
  return uint32_t(bits & (~bits + 1));  // the lowest set bit
}

// Everything the heuristic's answer depends on (GemmShape: types, shapes, leading dimensions,
// batching, epilogue and the alignment of the operands and of the bias and aux pointers, whose
// values the heuristic reads to decide the alignment it may assume), the device, and whether
// tuning chose it.
struct AlgoKey {
  int device;
  GemmShape shape;
  bool tuned;
  auto operator<=>(const AlgoKey&) const = default;
};
// The heuristic's choice and the workspace it asked for (at most kWorkspaceBytes).
struct Algo {
  cublasLtMatmulAlgo_t algo;
  size_t workspace;
};

// Whether an algorithm may write D elsewhere than C (a residual GEMM reads C and writes D).
bool out_of_place(const cublasLtMatmulAlgo_t& algo) {
  int32_t yes = 0;
  size_t written = 0;
  return cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_OUT_OF_PLACE_RESULT_SUPPORT, &yes, sizeof(yes),
                                           &written) == CUBLAS_STATUS_SUCCESS &&
         yes != 0;
}

// cublasLtMatmulAlgoGetHeuristic costs tens of microseconds of host time; a training step repeats
// the same few dozen GEMM shapes hundreds of times, so each shape asks once per process.
// An empty answer (no algorithm for this epilogue) is remembered too.
std::mutex g_algos_mu;
std::map<AlgoKey, std::optional<Algo>> g_algos;

template <class Find>
std::optional<Algo> cached_algo(const AlgoKey& key, Find find) {
  {
    std::lock_guard<std::mutex> lock(g_algos_mu);
    auto it = g_algos.find(key);
    if (it != g_algos.end()) return it->second;
  }
  const std::optional<Algo> algo = find();  // outside the lock: it may throw
  std::lock_guard<std::mutex> lock(g_algos_mu);
  return g_algos.emplace(key, algo).first->second;
}

// SG_GEMM_TUNE_FILE (or set_gemm_tuning_file): the tuned choices of earlier processes, read at
// the first GEMM that looks for one, checked against this cuBLASLt and card, and written again
// whole after each choice tuning adds (merged with what other processes wrote there meanwhile).
struct TuneFile {
  std::mutex mu;
  std::string path = [] {
    const char* e = std::getenv("SG_GEMM_TUNE_FILE");
    return std::string(e ? e : "");
  }();
  bool loaded = false;
  GemmChoices choices;
  int64_t used = 0;  // GEMM shapes whose algorithm came from the file
};
TuneFile& tune_file() {
  static TuneFile f;
  return f;
}

// What the file records the choices against: this cuBLASLt, and device d's name and sm.
std::pair<std::string, std::string> validators(Device d) {
  cudaDeviceProp p{};
  SG_CUDA_CHECK(cudaGetDeviceProperties(&p, d.index));
  return {std::to_string(cublasLtGetVersion()), str(p.name, " sm_", p.major * 10 + p.minor)};
}

// Loads the file on first use (under f.mu); throws when it belongs to another library or card.
void load_locked(TuneFile& f, Device d) {
  const auto [lib, card] = validators(d);
  if (!f.loaded) f.choices = read_gemm_choices(f.path), f.loaded = true;
  check_gemm_choices(f.choices, f.path, lib, card);
}

std::optional<GemmChoice> saved_choice(Device d, const GemmShape& s) {
  TuneFile& f = tune_file();
  std::lock_guard<std::mutex> lock(f.mu);
  if (f.path.empty()) return std::nullopt;
  load_locked(f, d);
  auto it = f.choices.choices.find(s);
  if (it == f.choices.choices.end()) return std::nullopt;
  return it->second;
}

void save_choice(Device d, const GemmShape& s, const GemmChoice& c) {
  TuneFile& f = tune_file();
  std::lock_guard<std::mutex> lock(f.mu);
  if (f.path.empty()) return;
  load_locked(f, d);
  const auto [lib, card] = validators(d);
  GemmChoices merged = read_gemm_choices(f.path);  // another rank may have added its own since
  check_gemm_choices(merged, f.path, lib, card);
  merged.cublaslt = lib, merged.device = card;
  for (const auto& [shape, choice] : f.choices.choices) merged.choices.emplace(shape, choice);
  merged.choices[s] = c;
  write_gemm_choices(f.path, merged);
  f.choices = std::move(merged);
}

// GemmArgs' epilogue in cuBLASLt's terms. The bias (and a bias gradient of C) is one value per
// column of row-major C, i.e. per row of the column-major result, which is what cuBLASLt's bias
// vector is; the pre-activation (aux) is column-major with leading dimension m = N, i.e.
// row-major [M, N]. row_sums_a is BGRADB: our A is cuBLASLt's second operand ("B"), and its sum
// over k has one value per column of the column-major result, i.e. per row of ours.
cublasLtEpilogue_t epilogue_of(const kernels::GemmArgs& g) {
  if (g.row_sums_a) return CUBLASLT_EPILOGUE_BGRADB;
  if (g.dgelu_pre) return g.bias_grad ? CUBLASLT_EPILOGUE_DGELU_BGRAD : CUBLASLT_EPILOGUE_DGELU;
  if (g.gelu) {
    if (g.bias) return g.pre_gelu ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_BIAS;
    return g.pre_gelu ? CUBLASLT_EPILOGUE_GELU_AUX : CUBLASLT_EPILOGUE_GELU;
  }
  return g.bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
}

// The one path every GEMM takes. Row-major semantics as in kernels::GemmArgs. Returns false,
// having launched nothing, when cuBLASLt's heuristic offers no algorithm for a GEMM with an
// epilogue (the caller runs the epilogue as separate kernels); throws when it offers none for a
// plain one.
bool matmul(const kernels::GemmArgs& g, const char* op, cudaStream_t stream) {
  SG_CHECK(g.M >= 0 && g.N >= 0 && g.K >= 0 && g.batch >= 1, op, ": bad sizes M=", g.M, " N=", g.N, " K=", g.K,
           " batch=", g.batch);
  if (g.M == 0 || g.N == 0) return !g.bias_grad && !g.row_sums_a;  // those still owe their zeros
  const cudaDataType_t t = cuda_type(g.dtype, op);
  const Device d = device_of(g.C, op);
  const cublasLtEpilogue_t epilogue = epilogue_of(g);
  if (g.K == 0) {  // C = beta C: cuBLASLt refuses k = 0
    if (epilogue != CUBLASLT_EPILOGUE_DEFAULT || g.residual) return false;
    SG_CHECK(g.beta == 0.0, op, ": K = 0 with beta != 0 is not supported on cuda");
    const size_t es = dtype_size(g.dtype);  // each matrix's M rows of N, not the gaps between them
    for (int64_t i = 0; i < g.batch; ++i)
      SG_CUDA_CHECK(cudaMemset2DAsync(static_cast<char*>(g.C) + size_t(i * g.stride_c) * es, size_t(g.ldc) * es, 0,
                                      size_t(g.N) * es, size_t(g.M), stream));
    return true;
  }
  const cublasComputeType_t compute =
      g.dtype == DType::f32 && allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  Desc desc;
  SG_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc.op, compute, CUDA_R_32F));
  // Column-major: first operand is B (m = N), second is A (n = M).
  const cublasOperation_t tb = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, ta = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  SG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, &tb, sizeof(tb)));
  SG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, &ta, sizeof(ta)));
  // The bias pointer is the bias read (forward) or the bias gradient written (backward).
  const void* vector = g.row_sums_a ? g.row_sums_a : g.bias_grad ? g.bias_grad : g.bias;
  const void* aux = g.dgelu_pre ? g.dgelu_pre : g.pre_gelu;
  if (epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
    SG_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    if (vector)
      SG_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &vector, sizeof(vector)));
    if (aux) {
      const int64_t ld = g.N;
      SG_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
      SG_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld)));
    }
  }
  // Stored shapes (column-major): row-major B [K, N] is [N, K]; transposed, row-major [N, K] is [K, N].
  make_layout(&desc.a, t, g.trans_b ? g.K : g.N, g.trans_b ? g.N : g.K, g.ldb, g.batch, g.stride_b);
  make_layout(&desc.b, t, g.trans_a ? g.M : g.K, g.trans_a ? g.K : g.M, g.lda, g.batch, g.stride_a);
  make_layout(&desc.c, t, g.N, g.M, g.ldc, g.batch, g.stride_c);

  cublasLtHandle_t h = handle_for(d);
  // The residual epilogue is cuBLASLt's own D = alpha A B + beta C (+ bias): the residual is the
  // source C with beta 1 and the output is D, in the same layout.
  const void* source = g.residual ? g.residual : g.C;
  const float alpha = float(g.alpha), beta = g.residual ? 1.0f : float(g.beta);
  // Each operand's own alignment: one badly aligned operand must not exclude the algorithms that
  // need more of the others. (The bias and aux pointers are at least 16-byte aligned: epilogue_fits;
  // an algorithm chosen for a 256-byte aligned bias may not take a 16-byte aligned one.)
  const uint32_t align_a = min_alignment({g.B}), align_b = min_alignment({g.A}), align_c = min_alignment({source}),
                 align_d = min_alignment({g.C}), align_vector = min_alignment({vector}), align_aux = min_alignment({aux});
  const bool residual = g.residual != nullptr;
  const bool tune = g_tune_gemms.load();
  GemmShape shape;
  shape.dtype = g.dtype, shape.compute = int32_t(compute), shape.epilogue = int32_t(epilogue);
  shape.trans_a = g.trans_a, shape.trans_b = g.trans_b, shape.residual = residual;
  shape.M = g.M, shape.N = g.N, shape.K = g.K, shape.lda = g.lda, shape.ldb = g.ldb, shape.ldc = g.ldc;
  shape.batch = g.batch, shape.stride_a = g.stride_a, shape.stride_b = g.stride_b, shape.stride_c = g.stride_c;
  shape.align_a = align_a, shape.align_b = align_b, shape.align_c = align_c, shape.align_d = align_d;
  shape.align_vector = align_vector, shape.align_aux = align_aux;
  const std::optional<Algo> algo = cached_algo(AlgoKey{d.index, shape, tune}, [&]() -> std::optional<Algo> {
    // A choice from SG_GEMM_TUNE_FILE, if cuBLASLt still takes it for this GEMM.
    if (const std::optional<GemmChoice> saved = saved_choice(d, shape)) {
      Algo a{};
      static_assert(sizeof(a.algo.data) == sizeof(saved->algo));
      std::memcpy(a.algo.data, saved->algo.data(), sizeof(a.algo.data));
      cublasLtMatmulHeuristicResult_t r{};
      if (cublasLtMatmulAlgoCheck(h, desc.op, desc.a, desc.b, desc.c, desc.c, &a.algo, &r) == CUBLAS_STATUS_SUCCESS &&
          r.state == CUBLAS_STATUS_SUCCESS && r.workspaceSize <= kWorkspaceBytes && (!residual || out_of_place(a.algo))) {
        std::lock_guard<std::mutex> lock(tune_file().mu);
        ++tune_file().used;
        return Algo{a.algo, r.workspaceSize};
      }
      std::fprintf(stderr, "shardgrad: SG_GEMM_TUNE_FILE %s: cuBLASLt refuses the saved algorithm of GEMM %s; %s\n",
                   gemm_tuning_file().c_str(), describe(shape).c_str(), tune ? "tuning it again" : "taking the heuristic's");
    }
    SG_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&desc.pref));
    const uint64_t ws = kWorkspaceBytes;
    SG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(desc.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                         sizeof(ws)));
    const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a}, {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c}, {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d}};
    for (const auto& [attr, bytes] : aligns)
      SG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(desc.pref, attr, &bytes, sizeof(bytes)));
    // The best few: a residual GEMM takes the best that writes out of place; tuning times them all.
    constexpr int kAsk = 8;
    cublasLtMatmulHeuristicResult_t results[kAsk] = {};
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(h, desc.op, desc.a, desc.b, desc.c, desc.c, desc.pref,
                                                             tune ? kAsk : residual ? 4 : 1, results, &found);
    std::vector<const cublasLtMatmulHeuristicResult_t*> usable;
    for (int i = 0; st == CUBLAS_STATUS_SUCCESS && i < found; ++i)
      if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= kWorkspaceBytes &&
          (!residual || out_of_place(results[i].algo)))
        usable.push_back(&results[i]);
    const cublasLtMatmulHeuristicResult_t* best = usable.empty() ? nullptr : usable[0];
    float fastest = 0;  // the chosen candidate's median ms, when tuning timed several
    if (tune && usable.size() > 1) {
      // Each candidate run 1 + 3 times on this call's operands, the median kept. A call that reads
      // its output (beta != 0, a residual) runs on a copy, so the real call below sees the real C.
      // The bias-gradient and pre-activation outputs are written again by the real call.
      const size_t es = dtype_size(g.dtype);
      const size_t extent = size_t((g.batch - 1) * g.stride_c + (g.M - 1) * g.ldc + g.N) * es;
      std::optional<Storage> copy;
      void* out = g.C;
      const void* in = source;
      if (beta != 0.0f) {
        copy.emplace(extent, d, MemCategory::workspace);
        SG_CUDA_CHECK(cudaMemcpyAsync(copy->data(), source, extent, cudaMemcpyDeviceToDevice, stream));
        out = copy->data(), in = copy->data();
      }
      size_t most = 0;
      for (const auto* r : usable) most = std::max(most, r->workspaceSize);
      std::optional<Storage> ws;
      if (most) ws.emplace(most, d, MemCategory::workspace);
      struct Events {  // destroyed on every path, a failed launch included
        cudaEvent_t e[4] = {};
        ~Events() {
          for (cudaEvent_t x : e)
            if (x) (void)cudaEventDestroy(x);
        }
      } events;
      cudaEvent_t* ev = events.e;
      for (int i = 0; i < 4; ++i) SG_CUDA_CHECK(cudaEventCreate(&ev[i]));
      for (const auto* r : usable) {
        float ms[3];
        for (int rep = 0; rep < 4; ++rep) {
          if (rep) SG_CUDA_CHECK(cudaEventRecord(ev[rep - 1], stream));
          SG_CUBLAS_CHECK(cublasLtMatmul(h, desc.op, &alpha, g.B, desc.a, g.A, desc.b, &beta, in, desc.c, out, desc.c,
                                         &r->algo, ws ? ws->data() : nullptr, r->workspaceSize, stream));
        }
        SG_CUDA_CHECK(cudaEventRecord(ev[3], stream));
        SG_CUDA_CHECK(cudaEventSynchronize(ev[3]));
        for (int rep = 0; rep < 3; ++rep) SG_CUDA_CHECK(cudaEventElapsedTime(&ms[rep], ev[rep], ev[rep + 1]));
        std::sort(ms, ms + 3);
        if (r == usable[0] || ms[1] < fastest) fastest = ms[1], best = r;
      }
    }
    if (tune && best) {  // into SG_GEMM_TUNE_FILE, if set: the only candidate too (time 0: not timed)
      GemmChoice c;
      std::memcpy(c.algo.data(), best->algo.data, sizeof(c.algo));
      c.workspace = best->workspaceSize, c.ms = usable.size() > 1 ? fastest : 0;
      save_choice(d, shape, c);
    }
    // No algorithm, or a refusal of this shape/epilogue combination: the caller runs the epilogue
    // (residual included) apart, after a bare GEMM.
    const bool refused = st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE || !best;
    if ((epilogue != CUBLASLT_EPILOGUE_DEFAULT || residual) && refused) return std::nullopt;
    SG_CUBLAS_CHECK(st);
    SG_CHECK(best, op, " (cuBLASLt): no algorithm for ", dtype_name(g.dtype), " M=", g.M, " N=", g.N, " K=", g.K,
             " batch=", g.batch, " lda=", g.lda, " ldb=", g.ldb, " ldc=", g.ldc, " alignment A/B/C/D ", align_b, "/",
             align_a, "/", align_c, "/", align_d, " bytes");
    return Algo{best->algo, std::min(best->workspaceSize, kWorkspaceBytes)};
  });
  if (!algo) return false;
  // Only what the chosen algorithm asked for (often nothing): the ledger's workspace is what runs.
  std::optional<Storage> workspace;
  if (algo->workspace) workspace.emplace(algo->workspace, d, MemCategory::workspace);
  SG_CUBLAS_CHECK(cublasLtMatmul(h, desc.op, &alpha, g.B, desc.a, g.A, desc.b, &beta, source, desc.c, g.C, desc.c,
                                 &algo->algo, workspace ? workspace->data() : nullptr, algo->workspace, stream));
  return true;
}

}  // namespace

void set_allow_tf32(bool allow) { g_allow_tf32 = allow; }
void set_gemm_tuning(bool tune) { g_tune_gemms = tune; }
bool gemm_tuning() { return g_tune_gemms; }

void set_gemm_tuning_file(const std::string& path) {
  TuneFile& f = tune_file();
  std::lock_guard<std::mutex> lock(f.mu);
  f.path = path, f.loaded = false, f.choices = {};
}
std::string gemm_tuning_file() {
  std::lock_guard<std::mutex> lock(tune_file().mu);
  return tune_file().path;
}
int64_t gemm_choices_from_file() {
  std::lock_guard<std::mutex> lock(tune_file().mu);
  return tune_file().used;
}
void forget_gemm_choices() {
  std::lock_guard<std::mutex> lock(g_algos_mu);
  g_algos.clear();
}
bool allow_tf32() { return g_allow_tf32; }

bool gemm_fused(const kernels::GemmArgs& a, cudaStream_t stream) {
  kernels::check_gemm_epilogue(a, "cuda");
  return epilogue_fits(a) && matmul(a, "gemm", stream);
}

void gemm(const kernels::GemmArgs& a, cudaStream_t stream) {
  kernels::check_gemm_epilogue(a, "cuda");
  SG_CHECK(epilogue_fits(a), "gemm (cuda): cuBLASLt's epilogue needs a 16-byte aligned bias, bias gradient and ",
           "pre-activation, N (", a.N, ") a multiple of 8 with a pre-activation, bias_grad only with dgelu_pre, and ",
           "row_sums_a alone (alpha 1)");
  SG_CHECK(matmul(a, "gemm", stream), "gemm (cuda): cuBLASLt has no algorithm for this epilogue (M=", a.M, " N=", a.N,
           " K=", a.K, ")");
}

bool epilogue_fits(const kernels::GemmArgs& a) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool aux = a.pre_gelu || a.dgelu_pre;
  return aligned(a.bias) && aligned(a.pre_gelu) && aligned(a.dgelu_pre) && aligned(a.bias_grad) &&
         aligned(a.row_sums_a) && (!aux || a.N % 8 == 0) && (!a.bias_grad || a.dgelu_pre) &&
         // row_sums_a is op(A)'s plain sums; whether BGRADB scales them by alpha is not documented
         (!a.row_sums_a || (a.alpha == 1.0 && !(a.bias || a.gelu || a.dgelu_pre || a.bias_grad)));
}

}  // namespace sg::cuda

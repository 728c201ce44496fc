#include "backend/cuda/gemm.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/gemm_environment.h"
#include "core/error.h"

namespace flux8::cuda {

namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // cuBLASLt's recommendation for Hopper

const char* type_name(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_32F: return "f32";
    case CUDA_R_16BF: return "bf16";
    case CUDA_R_16F: return "f16";
    case CUDA_R_8F_E4M3: return "e4m3";
    case CUDA_R_8F_E5M2: return "e5m2";
    default: return "?";
  }
}

bool is_fp8(cudaDataType_t t) { return t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2; }

template <typename T>
void set(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  FLUX8_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
}

// A variable's value; unset and empty are the same ("").
std::string env(const char* name) {
  const char* e = std::getenv(name);
  return e ? e : "";
}

bool profile_from_environment() {
  const std::string v = env("FLUX8_GEMM_PROFILE");
  if (v.empty() || v == "0" || v == "false" || v == "off") return false;
  if (v == "1" || v == "true" || v == "on") return true;
  fail("FLUX8_GEMM_PROFILE={}: expected 1 (time every GEMM per shape, printed at exit) or 0", v);
}

constexpr size_t kTimedBatch = 2048;  // event pairs recorded before they are read (one wait)

// FLUX8_GEMM_AUTOTUNE or PRIMUS_TURBO_AUTO_TUNE (backend/gemm_environment.h).
bool autotune_from_environment() { return gemm_autotune_from_environment(); }

std::string default_cache_path() {
  if (const std::string xdg = env("XDG_CACHE_HOME"); !xdg.empty()) return xdg + "/flux8/gemm_autotune.tsv";
  if (const std::string home = env("HOME"); !home.empty()) return home + "/.cache/flux8/gemm_autotune.tsv";
  return "";
}

constexpr int kCandidates = 8;  // heuristic results timed per description
constexpr int kTimedRuns = 5;   // per candidate, after one warm-up

}  // namespace

std::string describe(const GemmDesc& d) {
  const char* epilogue = d.epilogue == Epilogue::gelu_aux ? " gelu(aux)"
                         : d.epilogue == Epilogue::dgelu  ? " dgelu(aux)"
                                                          : "";
  return fmt::format("{}{} m={} n={} k={} lda={} ldb={} ldd={} {} x {} -> {}{}{}{}{}",
                     d.trans_a == CUBLAS_OP_T ? 'T' : 'N', d.trans_b == CUBLAS_OP_T ? 'T' : 'N', d.m, d.n, d.k, d.lda,
                     d.ldb, d.ldd, type_name(d.type_a), type_name(d.type_b), type_name(d.type_d),
                     d.bias ? (d.bias_type == CUDA_R_32F ? " +bias" : " +bf16 bias") : "", epilogue,
                     d.accumulate ? " +=" : "",
                     d.scale_mode_a == CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F       ? " scales 1x128"
                     : d.scale_mode_a == CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F ? " scales 128x128"
                                                                                     : "");
}

// Everything the key holds, for the autotuning cache (describe() leaves out compute type and
// fast accumulation).
std::string tuning_key(const GemmDesc& d) {
  return fmt::format("{} compute={} fast_accum={} scale_b={} bias_type={}{}", describe(d), static_cast<int>(d.compute),
                     d.fast_accum ? 1 : 0, static_cast<int>(d.scale_mode_b), static_cast<int>(d.bias_type),
                     d.aux_ld ? fmt::format(" aux_ld={}", d.aux_ld) : "");
}

struct Gemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::vector<cublasLtMatmulAlgo_t> candidates;  // autotuning: the heuristic's list, best-ranked first
  bool tuned = false;                            // autotuning: algo is the chosen candidate
  bool found = false;
  bool refused = false;  // found, then refused when run (GemmRefused from then on)
  GemmTiming timing;     // FLUX8_GEMM_PROFILE=1
  bool ran = false;      // its first call (which may load the kernel) is not timed
  std::string why_not;   // heuristic's failure, when !found
  ~Plan() {
    if (desc) cublasLtMatmulDescDestroy(desc);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (d) cublasLtMatrixLayoutDestroy(d);
  }
};

Gemm::Gemm(cudaStream_t stream)
    : stream_(stream), profile_(profile_from_environment()), autotune_(autotune_from_environment()) {
  FLUX8_CUBLAS_CHECK(cublasLtCreate(&handle_));
  try {
    FLUX8_CUDA_CHECK(cudaMalloc(&workspace_, kWorkspaceBytes));
    workspace_bytes_ = kWorkspaceBytes;
    if (autotune_) {
      const std::string path = env("FLUX8_GEMM_AUTOTUNE_CACHE");
      cache_path_ = path.empty() ? default_cache_path() : path;
      int device = 0;
      FLUX8_CUDA_CHECK(cudaGetDevice(&device));
      cudaDeviceProp prop{};
      FLUX8_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
      device_key_ = fmt::format("{} sm_{}{} cublasLt {}", prop.name, prop.major, prop.minor, cublasLtGetVersion());
      load_tuning_cache();
    }
  } catch (...) {  // the destructor does not run for a constructor that throws
    if (workspace_) cudaFree(workspace_);
    cublasLtDestroy(handle_);
    throw;
  }
}

Gemm::~Gemm() {
  if (profile_) {
    try {
      print_profile();
    } catch (...) {  // a device error (or a closed stderr) at exit: the table is lost, not the process
      std::fputs("gemm profile: not printed (an error while reading or printing it)\n", stderr);
    }
    for (const TimedCall& t : timed_) cudaEventDestroy(t.start), cudaEventDestroy(t.stop);
    for (cudaEvent_t e : spare_events_) cudaEventDestroy(e);
  }
  plans_.clear();
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(handle_);
}

// The cache file: one line per tuned description, "device key \t description key \t index \t ms";
// lines of other devices or library versions are skipped; a later line wins.
void Gemm::load_tuning_cache() {
  if (cache_path_.empty()) return;
  std::ifstream f(cache_path_);
  std::string line;
  while (std::getline(f, line)) {
    std::vector<std::string> fields;
    std::stringstream ss(line);
    for (std::string field; std::getline(ss, field, '\t');) fields.push_back(field);
    if (fields.size() < 3 || fields[0] != device_key_) continue;
    try {
      cache_[fields[1]] = std::stoi(fields[2]);
    } catch (const std::exception&) {  // a damaged line: time that description again
    }
  }
}

void Gemm::store_tuning(const std::string& key, int index, double ms) {
  cache_[key] = index;
  if (cache_path_.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(cache_path_).parent_path(), ec);
  // One short line appended at a time: concurrent ranks tuning the same shapes interleave whole
  // lines, and a reader takes the last choice of each description.
  std::ofstream f(cache_path_, std::ios::app);
  if (f) f << device_key_ << '\t' << key << '\t' << index << '\t' << fmt::format("{:.4f}", ms) << '\n';
  static bool warned = false;
  if (!f && !warned) {
    warned = true;
    fmt::print(stderr, "gemm autotune: cannot write {}: choices are kept for this run only\n", cache_path_);
  }
}

// Times every candidate on the call's operands into a scratch output (zeroed, so accumulating
// candidates read finite values) and keeps the fastest of those that run; ties go to the
// heuristic's order. A candidate cuBLASLt refuses for these operands is skipped; when none runs,
// nothing is cached and the heuristic's first choice stays (run() then reports the refusal).
void Gemm::tune(Plan& p, const GemmDesc& g, const GemmArgs& args) {
  p.tuned = true;
  const std::string key = tuning_key(g);
  if (auto it = cache_.find(key);
      it != cache_.end() && it->second >= 0 && it->second < static_cast<int>(p.candidates.size())) {
    p.algo = p.candidates[static_cast<size_t>(it->second)];
    ++tuned_from_cache_;
    return;
  }
  if (p.candidates.size() < 2) {  // nothing to choose from
    ++tuned_here_;
    store_tuning(key, 0, 0.0);
    return;
  }
  const size_t elem = g.type_d == CUDA_R_32F ? 4 : g.type_d == CUDA_R_16BF || g.type_d == CUDA_R_16F ? 2 : 1;
  const size_t bytes = static_cast<size_t>(g.ldd) * static_cast<size_t>(g.n) * elem;
  // The scratch output and the events, released on every path (a failed launch throws).
  struct Scratch {
    void* out = nullptr;
    cudaEvent_t start = nullptr, stop = nullptr;
    ~Scratch() {
      if (out) cudaFree(out);  // synchronises: the timed runs are done with it
      if (start) cudaEventDestroy(start);
      if (stop) cudaEventDestroy(stop);
    }
  } t;
  FLUX8_CUDA_CHECK(cudaMalloc(&t.out, bytes));
  FLUX8_CUDA_CHECK(cudaMemsetAsync(t.out, 0, bytes, stream_));
  FLUX8_CUDA_CHECK(cudaEventCreate(&t.start));
  FLUX8_CUDA_CHECK(cudaEventCreate(&t.stop));
  const float alpha = args.alpha, beta = g.accumulate ? 1.0f : 0.0f;
  int best = -1;
  float best_ms = 0;
  for (size_t i = 0; i < p.candidates.size(); ++i) {
    auto launch = [&] {
      return cublasLtMatmul(handle_, p.desc, &alpha, args.a, p.a, args.b, p.b, &beta, t.out, p.d, t.out, p.d,
                            &p.candidates[i], workspace_, workspace_bytes_, stream_);
    };
    if (launch() != CUBLAS_STATUS_SUCCESS) continue;  // a candidate that refuses these operands
    FLUX8_CUDA_CHECK(cudaEventRecord(t.start, stream_));
    for (int r = 0; r < kTimedRuns; ++r) FLUX8_CUBLAS_CHECK(launch());
    FLUX8_CUDA_CHECK(cudaEventRecord(t.stop, stream_));
    FLUX8_CUDA_CHECK(cudaEventSynchronize(t.stop));
    float ms = 0;
    FLUX8_CUDA_CHECK(cudaEventElapsedTime(&ms, t.start, t.stop));
    ms /= kTimedRuns;
    if (best < 0 || ms < best_ms) best = static_cast<int>(i), best_ms = ms;
  }
  if (best < 0) return;  // no candidate runs on these operands: nothing to remember
  p.algo = p.candidates[static_cast<size_t>(best)];
  ++tuned_here_;
  store_tuning(key, best, best_ms);
}

Gemm::Plan& Gemm::plan(const GemmDesc& g) {
  auto it = plans_.find(g.key());
  if (it != plans_.end()) return *it->second;
  auto p = std::make_unique<Plan>();
  const bool fp8 = is_fp8(g.type_a) || is_fp8(g.type_b);
  FLUX8_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, g.compute, CUDA_R_32F));
  set(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, g.trans_a);
  set(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, g.trans_b);
  if (g.bias && g.epilogue == Epilogue::dgelu)
    fail("GEMM {}: a bias cannot be added in a gradient epilogue", describe(g));
  cublasLtEpilogue_t epilogue = g.bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  switch (g.epilogue) {
    case Epilogue::none: break;
    case Epilogue::gelu_aux: epilogue = g.bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX; break;
    case Epilogue::dgelu: epilogue = CUBLASLT_EPILOGUE_DGELU; break;
  }
  if (epilogue != CUBLASLT_EPILOGUE_DEFAULT) set(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
  if (g.bias) set(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, g.bias_type);
  if (has_aux(g.epilogue)) set(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.aux_ld);
  if (fp8) {
    const int8_t fast = g.fast_accum ? 1 : 0;
    set(p->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast);
    set(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, g.scale_mode_a);
    set(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, g.scale_mode_b);
  }
  const uint64_t a_rows = g.trans_a == CUBLAS_OP_N ? g.m : g.k, a_cols = g.trans_a == CUBLAS_OP_N ? g.k : g.m;
  const uint64_t b_rows = g.trans_b == CUBLAS_OP_N ? g.k : g.n, b_cols = g.trans_b == CUBLAS_OP_N ? g.n : g.k;
  FLUX8_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, g.type_a, a_rows, a_cols, g.lda));
  FLUX8_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, g.type_b, b_rows, b_cols, g.ldb));
  FLUX8_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->d, g.type_d, g.m, g.n, g.ldd));

  // Block-scale modes: the heuristic refuses them unless scale pointers are set ("requires a
  // custom pointer for A scale"). Any device address serves for planning; run() sets the real
  // ones on every call.
  if (fp8 && (g.scale_mode_a != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F ||
              g.scale_mode_b != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F)) {
    set(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(workspace_));
    set(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(workspace_));
  }
  // Epilogue pointers: the heuristic takes their alignment from their values and may refuse an
  // epilogue whose pointer is unset; any aligned device address serves for planning, and run()
  // sets the real ones on every call.
  if (g.bias) set(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(workspace_));
  if (has_aux(g.epilogue))
    set(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, static_cast<const void*>(workspace_));
  cublasLtMatmulPreference_t pref = nullptr;
  FLUX8_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  FLUX8_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                          &workspace_bytes_, sizeof(workspace_bytes_)));
  cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
  int found = 0;
  const int wanted = autotune_ ? kCandidates : 1;
  const cublasStatus_t s =
      cublasLtMatmulAlgoGetHeuristic(handle_, p->desc, p->a, p->b, p->d, p->d, pref, wanted, results, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (s == CUBLAS_STATUS_SUCCESS && found > 0) {
    p->algo = results[0].algo;
    p->found = true;
    if (autotune_)
      for (int i = 0; i < found; ++i)
        if (results[i].state == CUBLAS_STATUS_SUCCESS) p->candidates.push_back(results[i].algo);
  } else {
    p->why_not = s == CUBLAS_STATUS_SUCCESS ? "no algorithm" : cublasLtGetStatusString(s);
  }
  return *plans_.emplace(g.key(), std::move(p)).first->second;
}

namespace {

// The chosen algorithm's configuration as the profile lists it: cuBLASLt's algorithm and tile
// ids, and its split of k, where it has one, with the reduction that adds the parts (a split-K
// algorithm runs a second pass: at the few µs of work of a small GEMM it may be most of a call).
std::string algo_config(const cublasLtMatmulAlgo_t& algo) {
  const auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attr, auto& value) {
    size_t written = 0;
    return cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, sizeof(value), &written) == CUBLAS_STATUS_SUCCESS;
  };
  int32_t id = -1, splits = 1;
  uint32_t tile = 0, reduction = CUBLASLT_REDUCTION_SCHEME_NONE;
  if (!get(CUBLASLT_ALGO_CONFIG_ID, id) || !get(CUBLASLT_ALGO_CONFIG_TILE_ID, tile) ||
      !get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM, splits) || !get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, reduction))
    return " [algorithm: not readable]";
  if (splits <= 1) return fmt::format(" [algo {} tile {}]", id, tile);
  const char* scheme = reduction == CUBLASLT_REDUCTION_SCHEME_INPLACE        ? "in place"
                       : reduction == CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE ? "in the compute type"
                       : reduction == CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE  ? "in the output type"
                                                                             : "none";
  return fmt::format(" [algo {} tile {}, split-K {}: reduction {}]", id, tile, splits, scheme);
}

}  // namespace

std::string Gemm::supported(const GemmDesc& d) {
  Plan& p = plan(d);
  return p.found ? "" : fmt::format("cuBLASLt has no algorithm for {} ({})", describe(d), p.why_not);
}

bool Gemm::has_algorithm(const GemmDesc& d) { return plan(d).found; }

void Gemm::run(const GemmDesc& g, const GemmArgs& args) {
  if (g.m == 0 || g.n == 0) return;
  Plan& p = plan(g);
  if (!p.found) {
    if (p.refused) throw GemmRefused(fmt::format("GEMM {}: {}", describe(g), p.why_not));
    fail("GEMM {}: cuBLASLt found no algorithm on this GPU ({})", describe(g), p.why_not);
  }
  if (g.bias) set(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, args.bias);
  if (has_aux(g.epilogue)) {
    if (!args.aux) fail("GEMM {}: the epilogue's aux matrix is missing", describe(g));
    set(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, args.aux);
  }

  if (is_fp8(g.type_a) || is_fp8(g.type_b)) {
    set(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(args.scale_a));
    set(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(args.scale_b));
    // Set on every call (null = not wanted): the descriptor is shared by all calls of this shape.
    set(p.desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, static_cast<void*>(args.amax_d));
  } else if (args.amax_d) {
    fail("GEMM {}: amax of D is only computed by FP8 GEMMs", describe(g));
  }
  // After the pointers are set: the candidates are timed on this call's operands.
  if (autotune_ && !p.tuned && g.k > 0) tune(p, g, args);
  const float alpha = args.alpha, beta = g.accumulate ? 1.0f : 0.0f;
  // k == 0: the product is empty; cuBLASLt may reject it, and D = beta·D is all it means.
  if (g.k == 0) {
    if (!g.accumulate) fail("GEMM {}: empty reduction (k = 0) is only meaningful when accumulating", describe(g));
    return;
  }
  // FLUX8_GEMM_PROFILE: this call's event pair, back to the spares unless the call is kept as
  // timed (both events recorded around a matmul that ran).
  struct PendingPair {
    std::vector<cudaEvent_t>& spare;
    cudaEvent_t start = nullptr, stop = nullptr;
    bool kept = false;
    void take(cudaEvent_t* e) {
      if (!spare.empty()) {
        *e = spare.back();
        spare.pop_back();
      } else {
        FLUX8_CUDA_CHECK(cudaEventCreate(e));
      }
    }
    ~PendingPair() {
      if (kept) return;
      for (cudaEvent_t e : {start, stop})
        if (e) spare.push_back(e);
    }
  } pair{spare_events_};
  const bool time_it = profile_ && p.ran;
  p.ran = true;
  if (time_it) {
    if (timed_.size() >= kTimedBatch) drain_profile();
    spare_events_.reserve(spare_events_.size() + 2);  // the destructor's push_backs need no allocation
    pair.take(&pair.start);
    pair.take(&pair.stop);
    FLUX8_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the start event then marks this GEMM's launch
    FLUX8_CUDA_CHECK(cudaEventRecord(pair.start, stream_));
  }
  const cublasStatus_t s = cublasLtMatmul(handle_, p.desc, &alpha, args.a, p.a, args.b, p.b, &beta, args.d, p.d, args.d,
                                          p.d, &p.algo, workspace_, workspace_bytes_, stream_);
  if (time_it) {
    FLUX8_CUDA_CHECK(cudaEventRecord(pair.stop, stream_));
    if (s == CUBLAS_STATUS_SUCCESS) {  // else nothing ran: not a timed call
      timed_.push_back(TimedCall{&p, pair.start, pair.stop});
      pair.kept = true;
      if (p.timing.desc.empty()) p.timing.desc = describe(g) + algo_config(p.algo);
      p.timing.flops += 2.0 * static_cast<double>(g.m) * static_cast<double>(g.n) * static_cast<double>(g.k);
    }
  }
  if (s == CUBLAS_STATUS_NOT_SUPPORTED) {
    // The heuristic offered an algorithm the call then refuses (seen for FP8 GEMMs with a bf16
    // D at a few small shapes). Nothing ran; the description is marked unsupported, so
    // supported() says so from now on and callers with another path take it.
    p.found = false;
    p.refused = true;
    p.why_not = "cuBLASLt refused the heuristic's algorithm when run (CUBLAS_STATUS_NOT_SUPPORTED)";
    throw GemmRefused(fmt::format("GEMM {}: {}", describe(g), p.why_not));
  }
  if (s != CUBLAS_STATUS_SUCCESS)
    fail("GEMM {}: cuBLASLt error {} ({})", describe(g), cublasLtGetStatusName(s), cublasLtGetStatusString(s));
  ++runs_[static_cast<size_t>(g.epilogue)];
  bias_runs_ += g.bias ? 1 : 0;
}

void Gemm::drain_profile() {
  if (timed_.empty()) return;
  // The batch's events return to the spares however the reading ends (a failed read leaves
  // none of them in timed_ to be read, or destroyed, twice).
  std::vector<TimedCall> batch;
  batch.swap(timed_);
  spare_events_.reserve(spare_events_.size() + 2 * batch.size());
  struct Recycle {
    const std::vector<TimedCall>& batch;
    std::vector<cudaEvent_t>& spare;
    ~Recycle() {
      for (const TimedCall& t : batch) spare.push_back(t.start), spare.push_back(t.stop);
    }
  } recycle{batch, spare_events_};
  FLUX8_CUDA_CHECK(cudaEventSynchronize(batch.back().stop));
  for (const TimedCall& t : batch) {
    float ms = 0;
    FLUX8_CUDA_CHECK(cudaEventElapsedTime(&ms, t.start, t.stop));
    t.plan->timing.ms += ms;
    ++t.plan->timing.calls;
  }
}

std::vector<GemmTiming> Gemm::profile() {
  drain_profile();
  std::vector<GemmTiming> out;
  for (const auto& [key, p] : plans_)
    if (p->timing.calls > 0) out.push_back(p->timing);
  std::sort(out.begin(), out.end(), [](const GemmTiming& a, const GemmTiming& b) { return a.ms > b.ms; });
  return out;
}

void Gemm::print_profile() {
  const std::vector<GemmTiming> rows = profile();
  if (rows.empty()) return;
  double total = 0;
  for (const GemmTiming& r : rows) total += r.ms;
  fmt::print(stderr,
             "gemm profile (FLUX8_GEMM_PROFILE=1): device time + launch of the cuBLASLt calls of this "
             "process, per description (column-major D[m, n]; each description's first call not timed)\n");
  fmt::print(stderr, "  {:>8} {:>10} {:>10} {:>9} {:>6}  {}\n", "calls", "ms total", "ms/call", "TFLOP/s", "share",
             "description");
  for (const GemmTiming& r : rows)
    fmt::print(stderr, "  {:>8} {:>10.3f} {:>10.4f} {:>9.1f} {:>5.1f}%  {}\n", r.calls, r.ms, r.ms / r.calls,
               r.ms > 0 ? r.flops / (r.ms * 1e9) : 0.0, total > 0 ? 100.0 * r.ms / total : 0.0, r.desc);
}

}  // namespace flux8::cuda

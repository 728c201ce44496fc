#pragma once
// The cuDNN plumbing shared by the CUDA attention ops (attention.cu: the BF16 graphs, the path
// choice; attention_fp8.cu: the FP8 graphs): descriptors of one operation graph built through
// the backend API, the execution plan cache keyed by shape and graph kind, and the staging
// buffer the ops carve their temporaries from. Not part of the backend's interface.
#include <cudnn.h>
#include <fmt/format.h>

#include <array>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "backend/cuda/attention.h"
#include "backend/cuda/check.h"

namespace flux8::cuda {

// Graph tensor ids below this are the graph's inputs and outputs (each graph numbers its own);
// virtual (in-graph) tensors are numbered from here.
constexpr int64_t kFirstVirtual = 100;

// Counts a finalized plan (attention_counters; defined in attention.cu).
void count_plan_built();
// Counts a plan built on the helper thread (attention_counters).
void count_plan_prefetched();
// Counts a call cuDNN ran (attention_counters).
void count_cudnn_call();

// A cuDNN refusal while building a plan: the shape or this GPU/library is not supported.
struct Refused {
  std::string why;
};

inline void build_check(cudnnStatus_t s, std::string_view what) {
  if (s == CUDNN_STATUS_SUCCESS) return;
  char detail[1024] = {0};
  cudnnGetLastErrorString(detail, sizeof(detail));
  throw Refused{fmt::format("{}: {}{}{}", what, cudnnGetErrorString(s), detail[0] ? ": " : "", detail)};
}

using Dims = std::array<int64_t, 4>;

// Creates descriptors (recorded in `owned`, which the plan destroys) and the operations of
// one graph, in order.
class GraphBuilder {
 public:
  explicit GraphBuilder(std::vector<cudnnBackendDescriptor_t>& owned) : owned_(owned) {}

  cudnnBackendDescriptor_t create(cudnnBackendDescriptorType_t type) {
    cudnnBackendDescriptor_t d = nullptr;
    build_check(cudnnBackendCreateDescriptor(type, &d), fmt::format("cudnnBackendCreateDescriptor({})", int(type)));
    owned_.push_back(d);
    return d;
  }
  template <typename T>
  static void set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
                  const T* values, int64_t count = 1) {
    build_check(cudnnBackendSetAttribute(d, name, type, count, values),
                fmt::format("cudnnBackendSetAttribute(attribute {})", int(name)));
  }
  static void finalize(cudnnBackendDescriptor_t d, std::string_view what) {
    build_check(cudnnBackendFinalize(d), fmt::format("finalizing {}", what));
  }

  enum class Kind { memory, by_value, virtual_ };
  cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t type, const Dims& dims, const Dims& strides,
                                  Kind kind = Kind::memory) {
    cudnnBackendDescriptor_t t = create(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t alignment = 16;
    const bool yes = true;
    set(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, &type);
    set(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims.data(), 4);
    set(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides.data(), 4);
    set(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, &uid);
    set(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, &alignment);
    if (kind == Kind::virtual_) set(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, &yes);
    if (kind == Kind::by_value) set(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, &yes);
    finalize(t, fmt::format("tensor {}", uid));
    return t;
  }
  cudnnBackendDescriptor_t virtual_tensor(cudnnDataType_t type, const Dims& dims, const Dims& strides) {
    return tensor(next_virtual_++, type, dims, strides, Kind::virtual_);
  }
  // An f32 scalar whose value is passed with each execution (host pointer in the variant pack).
  cudnnBackendDescriptor_t scalar(int64_t uid) {
    return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, Kind::by_value);
  }

  // y = mode(x) or mode(x, b), computed in f32.
  void pointwise(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                 cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t pw = create(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, &mode);
    set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, &f32);
    finalize(pw, "pointwise descriptor");
    cudnnBackendDescriptor_t op = create(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    const float one = 1.0f;
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, &pw);
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, &x);
    if (b) set(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, &b);
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, &y);
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, &one);
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, &one);
    finalize(op, fmt::format("pointwise operation (mode {})", int(mode)));
    ops_.push_back(op);
  }
  // y = reduction of x over the dimensions where y has extent 1, in f32.
  void reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t red = create(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    set(red, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, &mode);
    set(red, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &f32);
    finalize(red, "reduction descriptor");
    cudnnBackendDescriptor_t op = create(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    set(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, &x);
    set(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, &y);
    set(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, &red);
    finalize(op, fmt::format("reduction operation (mode {})", int(mode)));
    ops_.push_back(op);
  }
  // c = a·b over the last two dimensions (batched over the first two), f32 accumulation.
  void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
    cudnnBackendDescriptor_t mm = create(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    set(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &f32);
    finalize(mm, "matmul descriptor");
    cudnnBackendDescriptor_t op = create(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    set(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, &a);
    set(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, &b);
    set(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, &c);
    set(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, &mm);
    finalize(op, "matmul operation");
    ops_.push_back(op);
  }
  // y = x seen with y's dims and strides (a transpose here).
  void reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t op = create(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    set(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, &x);
    set(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, &y);
    finalize(op, "reshape operation");
    ops_.push_back(op);
  }

  const std::vector<cudnnBackendDescriptor_t>& ops() const { return ops_; }

 private:
  std::vector<cudnnBackendDescriptor_t>& owned_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  int64_t next_virtual_ = kFirstVirtual;
};

// Dims and strides of the [B, H, S, ·] tensors of one shape.
struct Layout {
  Dims bhsd, bhsd_stride;  // Q, K, V, O, dO, dQ, dK, dV
  Dims bhds, bhds_stride;  // Kᵀ, Vᵀ: the same memory with the last two dims swapped
  Dims bhss, bhss_stride;  // scores
  Dims bhss_t_stride;      // scores transposed (restrided, same dims since S_q = S_kv)
  Dims bhs1, bhs1_stride;  // row statistics
  explicit Layout(const AttentionShape& s) {
    const int64_t B = s.batch, H = s.heads, S = s.seq, D = s.head_dim;
    bhsd = {B, H, S, D};
    bhsd_stride = {H * S * D, S * D, D, 1};
    bhds = {B, H, D, S};
    bhds_stride = {H * S * D, S * D, 1, D};
    bhss = {B, H, S, S};
    bhss_stride = {H * S * S, S * S, S, 1};
    bhss_t_stride = {H * S * S, S * S, 1, S};
    bhs1 = {B, H, S, 1};
    bhs1_stride = {H * S, S, 1, 1};
  }
};

// One finalized execution plan (or cuDNN's refusal) with every descriptor it was built from.
struct CudnnPlan {
  std::vector<cudnnBackendDescriptor_t> descriptors;
  cudnnBackendDescriptor_t plan = nullptr;
  int64_t workspace_bytes = 0;
  std::string refused;               // non-empty: cuDNN does not run this graph, and why
  bool logged = false;               // the fallback to the reference kernel was reported
  std::shared_future<void> pending;  // valid while the helper thread builds it (Cudnn::prefetch)
  void drop_descriptors() {
    for (auto it = descriptors.rbegin(); it != descriptors.rend(); ++it) cudnnBackendDestroyDescriptor(*it);
    descriptors.clear();
    plan = nullptr;
  }
  ~CudnnPlan() { drop_descriptors(); }
};

struct Attention::Cudnn {
  cudaStream_t stream;
  cudnnHandle_t handle = nullptr;
  std::string unavailable;  // why no handle could be made ("" when it could, or not tried)
  bool tried = false;
  std::map<std::tuple<int, int, int64_t, int64_t, int64_t, int64_t>, std::unique_ptr<CudnnPlan>> plans;
  void* staging = nullptr;
  size_t staging_bytes = 0;
  uint64_t staging_moves = 0;  // reallocations of `staging` (Attention::reallocations)
  // Prefetch: plans built on a helper thread with a handle of its own (cuDNN handles are not
  // shared between threads), one at a time.
  cudnnHandle_t helper = nullptr;
  std::mutex helper_mutex;

  const BufferHooks& hooks;  // the Attention's: told of the staging buffer

  Cudnn(cudaStream_t s, const BufferHooks& h) : stream(s), hooks(h) {}
  ~Cudnn() {
    for (auto& [key, p] : plans)
      if (p->pending.valid()) p->pending.wait();
    plans.clear();
    if (staging) cudaFree(staging);
    if (helper) cudnnDestroy(helper);
    if (handle) cudnnDestroy(handle);
  }

  // The handle is made at the first cuDNN call (or when a model asks which dtype its attention
  // heads get, Attention::cudnn_takes_head_dim), so a process without attention never loads it.
  bool ensure_handle() {
    if (tried) return handle != nullptr;
    tried = true;
    const size_t version = cudnnGetVersion();
    if (version < 90800) {
      unavailable = fmt::format("cuDNN {} is older than 9.8, the oldest this code was written for", version);
      return false;
    }
    const cudnnStatus_t s = cudnnCreate(&handle);
    if (s != CUDNN_STATUS_SUCCESS) {
      handle = nullptr;
      char detail[1024] = {0};
      cudnnGetLastErrorString(detail, sizeof(detail));
      unavailable = fmt::format("cudnnCreate failed: {}{}{}", cudnnGetErrorString(s), detail[0] ? ": " : "", detail);
      return false;
    }
    FLUX8_CUDNN_CHECK(cudnnSetStream(handle, stream));
    return true;
  }

  // The plan of one graph kind (`kind`, and `variant`: its element types) at one shape, built
  // by `describe` at first use and cached, refusals included.
  using PlanKey = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t>;
  CudnnPlan& plan(int kind, int variant, const AttentionShape& s, const std::function<void(GraphBuilder&)>& describe) {
    const PlanKey key{kind, variant, s.batch, s.heads, s.seq, s.head_dim};
    auto it = plans.find(key);
    if (it != plans.end()) {
      CudnnPlan& p = *it->second;
      if (p.pending.valid()) {  // built by the helper thread: wait for it (its errors rethrown here)
        const std::shared_future<void> done = std::move(p.pending);
        p.pending = {};
        try {
          done.get();
        } catch (...) {
          plans.erase(it);  // as a failed build on this thread: nothing cached, the next call retries
          throw;
        }
      }
      return p;
    }
    auto p = std::make_unique<CudnnPlan>();
    if (!ensure_handle())
      p->refused = unavailable;
    else
      build_or_refuse(handle, *p, describe);
    return *plans.emplace(key, std::move(p)).first->second;
  }

  // Builds p with handle h, or marks it refused with cuDNN's reason (the partial graph's
  // descriptors dropped); other errors propagate. Returns whether it was built.
  static bool build_or_refuse(cudnnHandle_t h, CudnnPlan& p, const std::function<void(GraphBuilder&)>& describe) {
    try {
      build(h, p, describe);
      count_plan_built();
      return true;
    } catch (const Refused& r) {
      p.drop_descriptors();
      p.workspace_bytes = 0;
      p.refused = r.why;
      return false;
    }
  }

  // Starts building the plan plan() will be asked for later (the backward's, at the first
  // forward) on a helper thread, so that cuDNN's runtime compilation of the two overlaps: on a
  // machine whose driver JIT cache is cold each plan compiles for about a second
  // (docs/PERFORMANCE.md). A plan already cached
  // or being built is left alone (an invalid future returned); plan() waits for this one and
  // rethrows its errors. `describe` is run on the helper thread: it must hold its arguments by
  // value.
  std::shared_future<void> prefetch(int kind, int variant, const AttentionShape& s,
                                    std::function<void(GraphBuilder&)> describe) {
    const PlanKey key{kind, variant, s.batch, s.heads, s.seq, s.head_dim};
    if (plans.count(key) || !ensure_handle()) return {};
    auto p = std::make_unique<CudnnPlan>();
    CudnnPlan* raw = p.get();
    raw->pending = std::async(std::launch::async, [this, raw, describe = std::move(describe)] {
                     const std::lock_guard<std::mutex> lock(helper_mutex);
                     if (!helper) {
                       if (const cudnnStatus_t st = cudnnCreate(&helper); st != CUDNN_STATUS_SUCCESS) {
                         helper = nullptr;
                         raw->refused = fmt::format("cudnnCreate for the plan-building thread failed: {}",
                                                    cudnnGetErrorString(st));
                         return;
                       }
                     }
                     if (build_or_refuse(helper, *raw, describe)) count_plan_prefetched();
                   }).share();
    std::shared_future<void> started = raw->pending;
    plans.emplace(key, std::move(p));
    return started;
  }

  static void build(cudnnHandle_t h, CudnnPlan& p, const std::function<void(GraphBuilder&)>& describe) {
    GraphBuilder g(p.descriptors);
    describe(g);

    cudnnBackendDescriptor_t graph = g.create(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    GraphBuilder::set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, g.ops().data(),
                      static_cast<int64_t>(g.ops().size()));
    // Optional since cuDNN 9.8 (deprecated there); cudnn-frontend still sets it.
    GraphBuilder::set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, &h);
    GraphBuilder::finalize(graph, "operation graph");

    cudnnBackendDescriptor_t heuristics = g.create(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    GraphBuilder::set(heuristics, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, &graph);
    GraphBuilder::set(heuristics, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, &mode);
    GraphBuilder::finalize(heuristics, "engine heuristics");
    int64_t count = 0;
    build_check(cudnnBackendGetAttribute(heuristics, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0,
                                         &count, nullptr),
                "counting the heuristic's engine configurations");
    if (count <= 0) throw Refused{"the heuristic offers no engine for this graph"};
    std::vector<cudnnBackendDescriptor_t> configs;
    for (int64_t i = 0; i < count; ++i) configs.push_back(g.create(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
    int64_t returned = 0;
    build_check(cudnnBackendGetAttribute(heuristics, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                         count, &returned, configs.data()),
                "reading the heuristic's engine configurations");

    // The first configuration that finalizes is the heuristic's best runnable one.
    std::string first_error;
    for (int64_t i = 0; i < returned; ++i) {
      cudnnBackendDescriptor_t plan = g.create(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      try {
        GraphBuilder::set(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, &configs[i]);
        GraphBuilder::finalize(plan, fmt::format("execution plan of engine configuration {}", i));
        int64_t n = 0;
        build_check(cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n,
                                             &p.workspace_bytes),
                    "reading the plan's workspace size");
        p.plan = plan;
        return;
      } catch (const Refused& r) {
        if (first_error.empty()) first_error = r.why;
      }
    }
    throw Refused{fmt::format("none of the heuristic's {} engine configurations finalizes; the first: {}", returned,
                              first_error)};
  }

  void* staging_buffer(size_t bytes) {
    if (bytes > staging_bytes) {
      if (staging) {
        FLUX8_CUDA_CHECK(cudaStreamSynchronize(stream));  // queued work may still use it
        hooks.on_released(staging);
        FLUX8_CUDA_CHECK(cudaFree(staging));
        staging = nullptr;
      }
      FLUX8_CUDA_CHECK(cudaMalloc(&staging, bytes));
      hooks.on_allocated(staging, bytes);
      staging_bytes = bytes;
      ++staging_moves;
    }
    return staging;
  }

  void execute(const CudnnPlan& p, const std::vector<int64_t>& ids, const std::vector<void*>& ptrs, void* workspace) {
    cudnnBackendDescriptor_t pack = nullptr;
    FLUX8_CUDNN_CHECK(cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack));
    cudnnStatus_t s = cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64,
                                               static_cast<int64_t>(ids.size()), ids.data());
    if (s == CUDNN_STATUS_SUCCESS)
      s = cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
                                   static_cast<int64_t>(ptrs.size()), ptrs.data());
    if (s == CUDNN_STATUS_SUCCESS)
      s = cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
    if (s == CUDNN_STATUS_SUCCESS) s = cudnnBackendFinalize(pack);
    if (s == CUDNN_STATUS_SUCCESS) s = cudnnBackendExecute(handle, p.plan, pack);
    cudnnBackendDestroyDescriptor(pack);
    FLUX8_CUDNN_CHECK(s);
  }
};

// Byte offsets of the regions of one staging buffer, each 256-byte aligned.
struct Regions {
  size_t total = 0;
  size_t take(size_t bytes) {
    const size_t at = total;
    total += (bytes + 255) / 256 * 256;
    return at;
  }
};

template <typename T>
T* at(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

}  // namespace flux8::cuda

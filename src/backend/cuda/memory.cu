// The CUDA backend's lifetime, memory and the generic fill/copy/add/accumulate.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <type_traits>

#include "backend/cuda/attention.h"
#include "backend/cuda/common.cuh"
#include "backend/cuda/factory.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/nvml.h"
#include "core/parallel_copy.h"
#include "core/rng.h"

namespace flux8 {
using namespace cuda;

std::string cuda_unavailable_reason() {
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess || driver == 0) {
    cudaGetLastError();
    return "no NVIDIA driver on this machine (no GPU)";
  }
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return fmt::format("{} ({})", cudaGetErrorName(e), cudaGetErrorString(e));
  }
  if (count == 0) return "no CUDA device";
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "cannot query device 0";
  if (prop.major < 9)
    return fmt::format("{} is compute capability {}.{}; this build targets Hopper (sm_90a)", prop.name, prop.major,
                       prop.minor);
  if (prop.major != 9)
    return fmt::format(
        "{} is compute capability {}.{}; this build has sm_90a code only (rebuild with "
        "CMAKE_CUDA_ARCHITECTURES for it)",
        prop.name, prop.major, prop.minor);
  return "";
}

std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& options) {
  if (const std::string why = cuda_unavailable_reason(); !why.empty())
    fail("backend 'cuda': no usable GPU here: {}. Use backend: cpu (or run on a Hopper GPU)", why);
  if (options.device >= 0) {
    int count = 0;
    FLUX8_CUDA_CHECK(cudaGetDeviceCount(&count));
    if (options.device >= count && !options.share_device)
      fail(
          "backend 'cuda': this rank is number {} on its node, which has {} GPU{}: launch at most {} rank{} per node "
          "(mpirun --map-by ppr:{}:node, or srun --ntasks-per-node={})",
          options.device, count, count == 1 ? "" : "s", count, count == 1 ? "" : "s", count, count);
    FLUX8_CUDA_CHECK(cudaSetDevice(options.device % count));
  }
  return std::make_unique<CudaBackend>(options);
}

CudaBackend::CudaBackend(const BackendOptions& options) : options_(options) {
  FLUX8_CUDA_CHECK(cudaGetDevice(&device_));
  FLUX8_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  try {
    FLUX8_CUDA_CHECK(cudaMallocHost(&pinned_, 4096));
    gemm_ = std::make_unique<Gemm>(stream_);  // may refuse a bad FLUX8_GEMM_AUTOTUNE
    // The libraries' workspaces count as allocated, as a framework's allocator counts them: a
    // step's peak includes cuBLASLt's workspace and the attention's staging and dP regions.
    track_allocation(gemm_.get(), gemm_->workspace_size());
    cuda::BufferHooks hooks{[this](void* p, size_t n) { track_allocation(p, n); },
                            [this](void* p) { track_release(p); }};
    attention_ =
        make_attention(stream_, options.deterministic_attention, options.attention_workspace_limit, std::move(hooks));
  } catch (...) {  // the destructor does not run for a constructor that throws
    gemm_.reset();
    if (pinned_) cudaFreeHost(pinned_);
    cudaStreamDestroy(stream_);
    throw;
  }
}

CudaBackend::~CudaBackend() {
  if (stream_) cudaStreamSynchronize(stream_);
  attention_.reset();
  gemm_.reset();
  if (scratch_) cudaFree(scratch_);
  if (scratch2_) cudaFree(scratch2_);
  if (epilogue_scratch_) cudaFree(epilogue_scratch_);
  if (reduction_scratch_) cudaFree(reduction_scratch_);
  if (pinned_) cudaFreeHost(pinned_);
  for (ChunkTable* t : {&adamw_table_, &squares_table_, &ranges_table_})
    if (t->data) cudaFree(t->data);
  if (stats_dev_) cudaFree(stats_dev_);
  if (stats_host_) cudaFreeHost(stats_host_);
  for (cudaEvent_t e : timing_events_) cudaEventDestroy(e);
  if (stream_) cudaStreamDestroy(stream_);
}

void* CudaBackend::allocate(size_t bytes) {
  if (capturing_) fail("cuda backend: an op allocated device memory while a CUDA graph was being captured");
  void* p = nullptr;
  const size_t n = bytes ? bytes : 1;
  const cudaError_t e = cudaMalloc(&p, n);  // 256-byte aligned
  if (e != cudaSuccess) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    // The sizes travel with the error: whoever catches it says which settings would fit.
    throw OutOfMemoryError(
        fmt::format("cuda backend: out of device memory allocating {:.2f} GiB ({:.2f} GiB free of "
                    "{:.1f} GiB): {}",
                    n / 1073741824.0, free_b / 1073741824.0, total_b / 1073741824.0, cudaGetErrorString(e)),
        n, free_b, total_b);
  }
  FLUX8_CUDA_CHECK(cudaMemsetAsync(p, 0, n, stream_));
  FLUX8_CUDA_CHECK(cudaStreamSynchronize(stream_));
  track_allocation(p, n);
  return p;
}

MemoryUse CudaBackend::memory_use() const {
  MemoryUse m = memory_;
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) m.device_used = total_b - free_b;
  return m;
}

PowerReading CudaBackend::power_reading() {
  if (!nvml_) nvml_ = std::make_unique<cuda::NvmlDevice>(device_);
  return nvml_->read();
}

void CudaBackend::do_release(void* p) {
  if (!p) return;
  track_release(p);
  FLUX8_CUDA_CHECK(cudaStreamSynchronize(stream_));  // no kernel may still use it
  FLUX8_CUDA_CHECK(cudaFree(p));
}

bool CudaBackend::register_host_memory(void* p, size_t bytes) {
  if (!p || !bytes) return false;
  if (cudaHostRegister(p, bytes, cudaHostRegisterDefault) != cudaSuccess) {
    (void)cudaGetLastError();  // not fatal: the copies stage through the pinned chunks instead
    return false;
  }
  const std::lock_guard<std::mutex> lock(registered_mutex_);
  registered_.emplace_back(static_cast<const char*>(p), bytes);
  return true;
}

void CudaBackend::unregister_host_memory(void* p) {
  const std::lock_guard<std::mutex> lock(registered_mutex_);
  for (auto it = registered_.begin(); it != registered_.end(); ++it)
    if (it->first == p) {
      FLUX8_CUDA_CHECK(cudaHostUnregister(p));
      registered_.erase(it);
      return;
    }
}

bool CudaBackend::registered_range(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  const std::lock_guard<std::mutex> lock(registered_mutex_);
  for (const auto& [start, size] : registered_)
    if (c >= start && c + bytes <= start + size) return true;
  return false;
}

void CudaBackend::do_upload(void* dst, const void* host_src, size_t bytes) {
  if (!bytes) return;
  if (bytes < kStagedUploadBytes || registered_range(host_src, bytes)) {
    FLUX8_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_));
    // The host buffer may be reused by the caller right away.
    FLUX8_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return;
  }
  upload_staging_.copy(dst, host_src, bytes, stream_);  // a step's batch: W1's is 134 MB
  FLUX8_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

cuda::PinnedStaging::~PinnedStaging() {
  for (int i = 0; i < 2; ++i) {
    if (chunk_free_[i]) {
      cudaEventSynchronize(chunk_free_[i]);
      cudaEventDestroy(chunk_free_[i]);
    }
    if (chunk_[i]) cudaFreeHost(chunk_[i]);
  }
}

void cuda::PinnedStaging::make_chunks() {
  for (int i = 0; i < 2; ++i) {
    if (!chunk_[i]) FLUX8_CUDA_CHECK(cudaMallocHost(&chunk_[i], kChunkBytes));
    if (!chunk_free_[i]) FLUX8_CUDA_CHECK(cudaEventCreateWithFlags(&chunk_free_[i], cudaEventDisableTiming));
  }
}

void cuda::PinnedStaging::copy(void* dst, const void* host_src, size_t bytes, cudaStream_t stream) {
  make_chunks();
  const char* src = static_cast<const char*>(host_src);
  char* out = static_cast<char*>(dst);
  for (size_t offset = 0; offset < bytes; offset += kChunkBytes) {
    const int b = next_;
    next_ ^= 1;
    FLUX8_CUDA_CHECK(cudaEventSynchronize(chunk_free_[b]));  // its previous copy has left
    const size_t n = std::min(kChunkBytes, bytes - offset);
    parallel_copy(chunk_[b], src + offset, n);  // one thread is too slow for a step's batch
    FLUX8_CUDA_CHECK(cudaMemcpyAsync(out + offset, chunk_[b], n, cudaMemcpyHostToDevice, stream));
    FLUX8_CUDA_CHECK(cudaEventRecord(chunk_free_[b], stream));
  }
}

void cuda::PinnedStaging::copy_to_host(void* host_dst, const void* src, size_t bytes, cudaStream_t stream) {
  make_chunks();
  const char* in = static_cast<const char*>(src);
  char* out = static_cast<char*>(host_dst);
  // The chunk whose copy is in flight, copied out once the next one's is queued.
  int pending = -1;
  size_t pending_offset = 0, pending_bytes = 0;
  auto drain = [&] {
    FLUX8_CUDA_CHECK(cudaEventSynchronize(chunk_free_[pending]));  // here: the chunk has arrived
    parallel_copy(out + pending_offset, chunk_[pending], pending_bytes);
    pending = -1;
  };
  for (size_t offset = 0; offset < bytes; offset += kChunkBytes) {
    const int b = next_;  // not `pending`: the chunks alternate, and b's last contents were drained
    next_ ^= 1;
    FLUX8_CUDA_CHECK(cudaEventSynchronize(chunk_free_[b]));  // an earlier copy from it has left
    const size_t n = std::min(kChunkBytes, bytes - offset);
    FLUX8_CUDA_CHECK(cudaMemcpyAsync(chunk_[b], in + offset, n, cudaMemcpyDeviceToHost, stream));
    FLUX8_CUDA_CHECK(cudaEventRecord(chunk_free_[b], stream));
    if (pending >= 0) drain();
    pending = b;
    pending_offset = offset;
    pending_bytes = n;
  }
  if (pending >= 0) drain();
}

namespace {
class CudaEvent final : public Backend::Event {
 public:
  CudaEvent() { FLUX8_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming)); }
  ~CudaEvent() override { cudaEventDestroy(event); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t event = nullptr;
};

cudaEvent_t cuda_event(const Backend::Event& e) {
  const auto* c = dynamic_cast<const CudaEvent*>(&e);
  if (!c) fail("cuda backend: an event made by another backend");
  return c->event;
}

// A stream of its own and its own pinned chunks: another thread's uploads, or the offloaded
// optimizer's transfers, run beside the backend's ops. Registered host memory is copied directly
// and asynchronously; other memory stages through the chunks.
class CudaCopyQueue final : public Backend::CopyQueue {
 public:
  CudaCopyQueue(int device, std::function<bool(const void*, size_t)> registered)
      : device_(device), registered_(std::move(registered)) {
    FLUX8_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~CudaCopyQueue() override {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  CudaCopyQueue(const CudaCopyQueue&) = delete;
  CudaCopyQueue& operator=(const CudaCopyQueue&) = delete;

  void upload(void* dst, const void* host_src, size_t bytes) override {
    if (!bytes) return;
    FLUX8_CUDA_CHECK(cudaSetDevice(device_));  // the calling thread's device may be another
    if (registered_(host_src, bytes))
      FLUX8_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_));
    else
      staging_.copy(dst, host_src, bytes, stream_);
  }
  void download(void* host_dst, const void* src, size_t bytes) override {
    if (!bytes) return;
    FLUX8_CUDA_CHECK(cudaSetDevice(device_));
    if (registered_(host_dst, bytes))
      FLUX8_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    else
      staging_.copy_to_host(host_dst, src, bytes, stream_);  // done when it returns
  }
  void synchronize() override {
    FLUX8_CUDA_CHECK(cudaSetDevice(device_));
    FLUX8_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void record_event(Backend::Event& e) override {
    FLUX8_CUDA_CHECK(cudaSetDevice(device_));
    FLUX8_CUDA_CHECK(cudaEventRecord(cuda_event(e), stream_));
  }
  void wait_event(const Backend::Event& e) override {
    FLUX8_CUDA_CHECK(cudaSetDevice(device_));
    FLUX8_CUDA_CHECK(cudaStreamWaitEvent(stream_, cuda_event(e), 0));
  }
  bool asynchronous() const override { return true; }

 private:
  int device_ = 0;
  std::function<bool(const void*, size_t)> registered_;
  cudaStream_t stream_ = nullptr;
  PinnedStaging staging_;  // freed after the destructor has drained the stream
};
}  // namespace

std::unique_ptr<Backend::Event> CudaBackend::make_event() { return std::make_unique<CudaEvent>(); }
cudaEvent_t CudaBackend::native_event(const Event& e) { return cuda_event(e); }
std::unique_ptr<Backend::CopyQueue> CudaBackend::make_copy_queue() {
  return std::make_unique<CudaCopyQueue>(device_,
                                         [this](const void* p, size_t bytes) { return registered_range(p, bytes); });
}

void CudaBackend::do_record_event(Event& e) {
  if (capturing_) fail("cuda backend: record_event while a CUDA graph is being captured");
  FLUX8_CUDA_CHECK(cudaEventRecord(cuda_event(e), stream_));
}

void CudaBackend::do_wait_event(const Event& e) {
  if (capturing_) fail("cuda backend: wait_event while a CUDA graph is being captured");
  FLUX8_CUDA_CHECK(cudaStreamWaitEvent(stream_, cuda_event(e), 0));
}

void CudaBackend::do_download(void* host_dst, const void* src, size_t bytes) {
  if (!bytes) return;
  if (bytes < kStagedUploadBytes || registered_range(host_dst, bytes)) {
    FLUX8_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
  } else {
    download_staging_.copy_to_host(host_dst, src, bytes, stream_);  // a checkpoint's snapshot: GBs
  }
  FLUX8_CUDA_CHECK(cudaStreamSynchronize(stream_));
  flush_cast_stats();
}

void CudaBackend::do_synchronize() {
  FLUX8_CUDA_CHECK(cudaStreamSynchronize(stream_));
  flush_cast_stats();
}

void* CudaBackend::grow(void*& buf, size_t& have, size_t want) {
  if (want <= have && buf) return buf;
  FLUX8_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (buf) {
    track_release(buf);
    FLUX8_CUDA_CHECK(cudaFree(buf));
  }
  buf = nullptr;
  const size_t n = std::max<size_t>(want + want / 4, 1 << 20);
  FLUX8_CUDA_CHECK(cudaMalloc(&buf, n));
  track_allocation(buf, n);
  have = n;
  ++scratch_generation_;
  return buf;
}

void* CudaBackend::scratch(size_t bytes) { return grow(scratch_, scratch_bytes_, bytes); }
void* CudaBackend::scratch2(size_t bytes) { return grow(scratch2_, scratch2_bytes_, bytes); }
void* CudaBackend::epilogue_scratch(size_t bytes) { return grow(epilogue_scratch_, epilogue_scratch_bytes_, bytes); }
void* CudaBackend::reduction_scratch(size_t bytes) { return grow(reduction_scratch_, reduction_scratch_bytes_, bytes); }

// ---- graphs ----------------------------------------------------------------------------------
namespace {
class CudaGraph final : public Backend::Graph {
 public:
  explicit CudaGraph(cudaGraphExec_t e) : exec(e) {}
  ~CudaGraph() override { cudaGraphExecDestroy(exec); }
  cudaGraphExec_t exec;
};
}  // namespace

void CudaBackend::begin_capture() {
  if (capturing_) fail("cuda backend: begin_capture while a capture is open");
  // Thread-local: a forbidden call (a synchronisation, an allocation) from this thread fails
  // the capture; other threads (cuDNN's plan builds) are not affected.
  FLUX8_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  capturing_ = true;
}

std::unique_ptr<Backend::Graph> CudaBackend::end_capture() {
  if (!capturing_) return nullptr;
  capturing_ = false;
  cudaGraph_t graph = nullptr;
  cudaError_t e = cudaStreamEndCapture(stream_, &graph);
  if (e != cudaSuccess || !graph) {
    cudaGetLastError();  // an invalidated capture: not sticky, the stream is usable again
    if (graph) cudaGraphDestroy(graph);
    return nullptr;
  }
  cudaGraphExec_t exec = nullptr;
  e = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return std::make_unique<CudaGraph>(exec);
}

void CudaBackend::launch_graph(const Graph& g) {
  const auto* cg = dynamic_cast<const CudaGraph*>(&g);
  if (!cg) fail("cuda backend: launch_graph of a graph another backend made");
  FLUX8_CUDA_CHECK(cudaGraphLaunch(cg->exec, stream_));
}

uint64_t CudaBackend::capture_generation() const {
  return scratch_generation_ + (attention_ ? attention_->reallocations() : 0);
}
void* CudaBackend::pinned_result() { return pinned_; }

int64_t CudaBackend::do_timing_mark() {
  if (timing_marks_used_ == timing_events_.size()) {
    cudaEvent_t e = nullptr;
    FLUX8_CUDA_CHECK(cudaEventCreate(&e));  // with timing (cudaEventDefault)
    timing_events_.push_back(e);
  }
  FLUX8_CUDA_CHECK(cudaEventRecord(timing_events_[timing_marks_used_], stream_));
  return static_cast<int64_t>(timing_marks_used_++);
}

double CudaBackend::timing_elapsed_ms(int64_t from, int64_t to) {
  const auto n = static_cast<int64_t>(timing_marks_used_);
  if (from < 0 || to < 0 || from >= n || to >= n)
    fail("timing_elapsed_ms: marks {} and {} are not both among the {} recorded", from, to, n);
  float ms = 0.0f;
  FLUX8_CUDA_CHECK(
      cudaEventElapsedTime(&ms, timing_events_[static_cast<size_t>(from)], timing_events_[static_cast<size_t>(to)]));
  return ms;
}

void CudaBackend::release_timing_marks() { timing_marks_used_ = 0; }

// ---- fill / copy / add / accumulate --------------------------------------------------------
// Each of them also serves activations (Backend::activation_dtype): the tensors of one call are
// f32 or bf16 (copy may convert), and bf16 values are computed in f32 and stored rounded to
// nearest even. The f32 code paths are those of an f32-only backend.

namespace {

using bf16 = __nv_bfloat16;

// y = x converted between f32 and bf16 (round to nearest even one way, exact the other).
// Contiguous pairs go through convert.cu's flat kernels (any length and alignment); column
// windows row by row, 4 elements a thread where both sides allow.
template <typename Y, typename X>
void convert(CudaBackend& be, const Tensor& y, const Tensor& x) {
  const MatOf<Y> YM = mat_of<Y>(y);
  const MatOf<X> XM = mat_of<X>(x);
  const int64_t n = YM.rows * YM.cols;
  if (n == 0) return;
  if (y.contiguous() && x.contiguous()) {
    if constexpr (std::is_same_v<Y, bf16>)
      to_bf16(YM.p, XM.p, n, be.stream());
    else
      to_f32(YM.p, XM.p, n, be.stream());
    return;
  }
  if (vec4_rows(YM) && vec4_rows(XM)) {
    for_each_row(be, YM.rows, YM.cols / 4,
                 [=] __device__(int64_t r, int q) { store4(&YM.at(r, 4 * q), load4(&XM.at(r, 4 * q))); });
    return;
  }
  for_each_row(be, YM.rows, YM.cols, [=] __device__(int64_t r, int c) { YM.set(r, c, XM.get(r, c)); });
}

// copy_batch: up to kCopyBatch copies in one launch, blockIdx.y the pair, the blocks along x
// striding over its elements. Each value is converted as copy() converts it (f32 → bf16
// rounded to nearest even, bf16 → f32 exact, or moved as it is).
constexpr int kCopyBatch = 16;
struct CopyEntry {
  void* y;
  const void* x;
  int64_t rows, cols, y_ld, x_ld;
  bool y_bf16, x_bf16;
};
struct CopyEntries {
  CopyEntry e[kCopyBatch];
};

__global__ void copy_batch_kernel(CopyEntries batch) {
  const CopyEntry c = batch.e[blockIdx.y];
  const int64_t n = c.rows * c.cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / c.cols, k = i - r * c.cols;
    const float v =
        c.x_bf16 ? load(static_cast<const bf16*>(c.x)[r * c.x_ld + k]) : static_cast<const float*>(c.x)[r * c.x_ld + k];
    if (c.y_bf16)
      store(static_cast<bf16*>(c.y)[r * c.y_ld + k], v);
    else
      static_cast<float*>(c.y)[r * c.y_ld + k] = v;
  }
}

// y = f(a, b) elementwise over bf16 tensors, computed in f32 (accumulate: a is y). Contiguous
// tensors run flat (4 elements a thread where all three are 8-byte aligned, the tail one by
// one), column windows row by row (4 a thread where every row allows).
template <typename F>
void bf16_binary(CudaBackend& be, const Tensor& y, const Tensor& a, const Tensor& b, F f) {
  const MatOf<bf16> Y = mat_of<bf16>(y), A = mat_of<bf16>(a), B = mat_of<bf16>(b);
  const int64_t n = Y.rows * Y.cols;
  if (n == 0) return;
  if (y.contiguous() && a.contiguous() && b.contiguous()) {
    const bool vec = vec4_aligned(Y.p) && vec4_aligned(A.p) && vec4_aligned(B.p);
    const int64_t n4 = vec ? n / 4 : 0;
    for_each(be, n4 + (n - 4 * n4), [=] __device__(int64_t i) {
      if (i < n4) {
        const float4 u = load4(A.p + 4 * i), v = load4(B.p + 4 * i);
        store4(Y.p + 4 * i, make_float4(f(u.x, v.x), f(u.y, v.y), f(u.z, v.z), f(u.w, v.w)));
      } else {
        const int64_t e = 3 * n4 + i;  // 4·n4 + (i − n4)
        store(Y.p[e], f(load(A.p[e]), load(B.p[e])));
      }
    });
    return;
  }
  if (vec4_rows(Y) && vec4_rows(A) && vec4_rows(B)) {
    for_each_row(be, Y.rows, Y.cols / 4, [=] __device__(int64_t r, int q) {
      const float4 u = load4(&A.at(r, 4 * q)), v = load4(&B.at(r, 4 * q));
      store4(&Y.at(r, 4 * q), make_float4(f(u.x, v.x), f(u.y, v.y), f(u.z, v.z), f(u.w, v.w)));
    });
    return;
  }
  for_each_row(be, Y.rows, Y.cols, [=] __device__(int64_t r, int c) { Y.set(r, c, f(A.get(r, c), B.get(r, c))); });
}

}  // namespace

void CudaBackend::execute(const op::Fill& args) {
  const bool bf = activations_in_bf16(args);
  const float v = static_cast<float>(args.value);
  const int64_t n = args.y.rows() * args.y.cols();
  if (n == 0) return;
  if (v == 0.0f && !std::signbit(v) && args.y.contiguous()) {  // +0.0 is all-zero bytes (f32 and bf16): a memset
    FLUX8_CUDA_CHECK(cudaMemsetAsync(args.y.data, 0, args.y.bytes(), stream_));
    return;
  }
  if (bf) {  // the f32 value rounded once, as bf16 storage of the CPU's f32 fill holds it
    const MatOf<bf16> Y = mat_of<bf16>(args.y);
    const bf16 h = __float2bfloat16_rn(v);
    if (args.y.contiguous()) {
      bf16* p = Y.p;
      for_each(*this, n, [=] __device__(int64_t i) { p[i] = h; });
      return;
    }
    for_each_row(*this, Y.rows, Y.cols, [=] __device__(int64_t r, int c) { Y.at(r, c) = h; });
    return;
  }
  const Mat Y = mat(args.y);
  if (args.y.contiguous()) {  // also flat parameter-sized vectors, beyond for_each_row's 2^30 columns
    float* p = Y.p;
    for_each(*this, n, [=] __device__(int64_t i) { p[i] = v; });
    return;
  }
  for_each_row(*this, Y.rows, Y.cols, [=] __device__(int64_t r, int c) { Y.at(r, c) = v; });
}

void CudaBackend::execute(const op::FillRandom& args) {
  require_f32(args);
  require_contiguous("fill_random", {"y", args.y});
  float* out = args.y.ptr<float>();
  const bool normal = args.dist == Random::normal;
  for_each(*this, args.y.numel(), [=] __device__(int64_t i) {  // the CPU backend's formula
    const uint64_t k = static_cast<uint64_t>(i);
    const double v = normal ? static_cast<double>(rng_normal(args.seed, args.stream, k))
                            : 2.0 * static_cast<double>(rng_uniform(args.seed, args.stream, k)) - 1.0;
    out[i] = static_cast<float>(args.scale * v);
  });
}

// y's storage type may differ from x's: each is f32 or bf16, and the values convert.
void CudaBackend::execute(const op::Copy& args) {
  require_defined("copy", {"y", args.y});
  require_defined("copy", {"x", args.x});
  const bool y_bf = activations_in_bf16("copy", tensor_fields(args, {"y"})),
             x_bf = activations_in_bf16("copy", tensor_fields(args, {"x"}));
  require_same_matrix("copy", {"y", args.y}, {"x", args.x});
  if (y_bf != x_bf) {
    if (y_bf)
      convert<bf16, float>(*this, args.y, args.x);
    else
      convert<float, bf16>(*this, args.y, args.x);
    return;
  }
  const size_t elem = dtype_size(args.x.dtype);
  if (args.y.contiguous() && args.x.contiguous()) {
    FLUX8_CUDA_CHECK(cudaMemcpyAsync(args.y.data, args.x.data, args.x.bytes(), cudaMemcpyDeviceToDevice, stream_));
    return;
  }
  FLUX8_CUDA_CHECK(cudaMemcpy2DAsync(args.y.data, args.y.ld * elem, args.x.data, args.x.ld * elem, args.x.cols() * elem,
                                     args.x.rows(), cudaMemcpyDeviceToDevice, stream_));
}

void CudaBackend::execute(const op::CopyBatch& args) {
  constexpr std::string_view op = "copy_batch";
  // The batch's largest copy sets the grid's width: a small copy's extra blocks find no work.
  for (size_t first = 0; first < args.pairs.size(); first += kCopyBatch) {
    const size_t count = std::min<size_t>(kCopyBatch, args.pairs.size() - first);
    CopyEntries batch{};
    int64_t widest = 0;
    for (size_t i = 0; i < count; ++i) {
      const CopyPair& p = args.pairs[first + i];
      // Checked without building names (this runs every step); a failure names the pair.
      const auto storable = [](const Tensor& t) {
        return t.defined() && (t.dtype == DType::f32 || t.dtype == DType::bf16) && t.ld >= t.cols();
      };
      if (!storable(p.y) || !storable(p.x) || p.y.rows() != p.x.rows() || p.y.cols() != p.x.cols())
        fail(
            "{}: pair {}: y {} and x {} must be f32 or bf16 tensors of one [rows, cols] (rows at least their "
            "columns apart)",
            op, first + i, p.y.defined() ? p.y.str() : "undefined", p.x.defined() ? p.x.str() : "undefined");
      batch.e[i] = CopyEntry{p.y.data,
                             p.x.data,
                             p.y.rows(),
                             p.y.cols(),
                             p.y.ld,
                             p.x.ld,
                             p.y.dtype == DType::bf16,
                             p.x.dtype == DType::bf16};
      widest = std::max(widest, p.y.numel());
    }
    if (widest == 0) continue;
    const dim3 grid(std::min(blocks_for(widest), 64u), static_cast<unsigned>(count));
    copy_batch_kernel<<<grid, kThreads, 0, stream_>>>(batch);
    FLUX8_LAUNCH_CHECK(copy_batch_kernel);
  }
}

void CudaBackend::execute(const op::Add& args) {
  const bool bf = activations_in_bf16(args);
  require_same_matrix("add", {"y", args.y}, {"a", args.a});
  require_same_matrix("add", {"y", args.y}, {"b", args.b});
  if (bf) return bf16_binary(*this, args.y, args.a, args.b, [] __device__(float u, float v) { return u + v; });
  const Mat Y = mat(args.y), A = mat(args.a), B = mat(args.b);
  if (args.y.contiguous() && args.a.contiguous() && args.b.contiguous()) {
    for_each(*this, Y.rows * Y.cols, [=] __device__(int64_t i) { Y.p[i] = A.p[i] + B.p[i]; });
    return;
  }
  for_each_row(*this, Y.rows, Y.cols, [=] __device__(int64_t r, int c) { Y.at(r, c) = A.at(r, c) + B.at(r, c); });
}

void CudaBackend::execute(const op::Accumulate& args) {
  const bool bf = activations_in_bf16(args);
  require_same_matrix("accumulate", {"y", args.y}, {"x", args.x});
  if (bf) return bf16_binary(*this, args.y, args.y, args.x, [] __device__(float u, float v) { return u + v; });
  const Mat Y = mat(args.y), X = mat(args.x);
  if (args.y.contiguous() && args.x.contiguous()) {
    for_each(*this, Y.rows * Y.cols, [=] __device__(int64_t i) { Y.p[i] += X.p[i]; });
    return;
  }
  for_each_row(*this, Y.rows, Y.cols, [=] __device__(int64_t r, int c) { Y.at(r, c) += X.at(r, c); });
}

}  // namespace flux8

// The CUDA backend's lifetime, memory and the generic fill/copy/add/accumulate.
#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "backend/cuda/attention.h"
#include "backend/cuda/common.cuh"
#include "backend/cuda/factory.h"
#include "backend/cuda/gemm.h"
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
    return fmt::format("{} is compute capability {}.{}; this build has sm_90a code only (rebuild with "
                       "CMAKE_CUDA_ARCHITECTURES for it)",
                       prop.name, prop.major, prop.minor);
  return "";
}

std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& options) {
  if (const std::string why = cuda_unavailable_reason(); !why.empty())
    fail("backend 'cuda': no usable GPU here: {}. Use backend: cpu (or run on a Hopper GPU)", why);
  return std::make_unique<CudaBackend>(options);
}

CudaBackend::CudaBackend(const BackendOptions& options) : options_(options) {
  FLUX8_CUDA_CHECK(cudaGetDevice(&device_));
  FLUX8_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  FLUX8_CUDA_CHECK(cudaMallocHost(&pinned_, 4096));
  gemm_ = std::make_unique<Gemm>(stream_);
  attention_ = make_attention(stream_);
}

CudaBackend::~CudaBackend() {
  if (stream_) cudaStreamSynchronize(stream_);
  attention_.reset();
  gemm_.reset();
  if (scratch_) cudaFree(scratch_);
  if (scratch2_) cudaFree(scratch2_);
  if (reduction_scratch_) cudaFree(reduction_scratch_);
  if (pinned_) cudaFreeHost(pinned_);
  if (stats_dev_) cudaFree(stats_dev_);
  if (stats_host_) cudaFreeHost(stats_host_);
  if (stream_) cudaStreamDestroy(stream_);
}

void* CudaBackend::allocate(size_t bytes) {
  void* p = nullptr;
  const size_t n = bytes ? bytes : 1;
  const cudaError_t e = cudaMalloc(&p, n);  // 256-byte aligned
  if (e != cudaSuccess) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    fail("cuda backend: out of device memory allocating {:.2f} GiB ({} free of {:.1f} GiB): {}", n / 1073741824.0,
         fmt::format("{:.2f} GiB", free_b / 1073741824.0), total_b / 1073741824.0, cudaGetErrorString(e));
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

void CudaBackend::release(void* p) {
  if (!p) return;
  track_release(p);
  FLUX8_CUDA_CHECK(cudaStreamSynchronize(stream_));  // no kernel may still use it
  FLUX8_CUDA_CHECK(cudaFree(p));
}

void CudaBackend::upload(void* dst, const void* host_src, size_t bytes) {
  if (!bytes) return;
  FLUX8_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_));
  // The host buffer may be reused by the caller right away.
  FLUX8_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackend::download(void* host_dst, const void* src, size_t bytes) {
  if (!bytes) return;
  FLUX8_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
  FLUX8_CUDA_CHECK(cudaStreamSynchronize(stream_));
  flush_cast_stats();
}

void CudaBackend::synchronize() {
  FLUX8_CUDA_CHECK(cudaStreamSynchronize(stream_));
  flush_cast_stats();
}

namespace {
void* grow(void*& buf, size_t& have, size_t want, cudaStream_t s) {
  if (want <= have && buf) return buf;
  FLUX8_CUDA_CHECK(cudaStreamSynchronize(s));
  if (buf) FLUX8_CUDA_CHECK(cudaFree(buf));
  const size_t n = std::max<size_t>(want + want / 4, 1 << 20);
  FLUX8_CUDA_CHECK(cudaMalloc(&buf, n));
  have = n;
  return buf;
}
}  // namespace

void* CudaBackend::scratch(size_t bytes) { return grow(scratch_, scratch_bytes_, bytes, stream_); }
void* CudaBackend::scratch2(size_t bytes) { return grow(scratch2_, scratch2_bytes_, bytes, stream_); }
void* CudaBackend::reduction_scratch(size_t bytes) {
  return grow(reduction_scratch_, reduction_scratch_bytes_, bytes, stream_);
}
void* CudaBackend::pinned_result() { return pinned_; }

// ---- fill / copy / add / accumulate --------------------------------------------------------

void CudaBackend::fill(Tensor y, double value) {
  require_f32("fill", {{"y", y}});
  const Mat Y = mat(y);
  const float v = static_cast<float>(value);
  if (Y.rows * Y.cols == 0) return;
  if (v == 0.0f && !std::signbit(v) && y.contiguous()) {  // +0.0 is all-zero bytes: a memset
    FLUX8_CUDA_CHECK(cudaMemsetAsync(Y.p, 0, static_cast<size_t>(Y.rows * Y.cols) * sizeof(float), stream_));
    return;
  }
  if (y.contiguous()) {  // also flat parameter-sized vectors, beyond for_each_row's 2^30 columns
    float* p = Y.p;
    for_each(*this, Y.rows * Y.cols, [=] __device__(int64_t i) { p[i] = v; });
    return;
  }
  for_each_row(*this, Y.rows, Y.cols, [=] __device__(int64_t r, int c) { Y.at(r, c) = v; });
}

void CudaBackend::fill_random(Tensor y, Random dist, uint64_t seed, uint64_t stream, double scale) {
  require_f32("fill_random", {{"y", y}});
  require_contiguous("fill_random", {"y", y});
  float* out = y.ptr<float>();
  const bool normal = dist == Random::normal;
  for_each(*this, y.numel(), [=] __device__(int64_t i) {  // the CPU backend's formula
    const uint64_t k = static_cast<uint64_t>(i);
    const double v = normal ? static_cast<double>(rng_normal(seed, stream, k))
                            : 2.0 * static_cast<double>(rng_uniform(seed, stream, k)) - 1.0;
    out[i] = static_cast<float>(scale * v);
  });
}

void CudaBackend::copy(Tensor y, Tensor x) {
  require_f32("copy", {{"y", y}, {"x", x}});
  require_same_matrix("copy", {"y", y}, {"x", x});
  if (y.contiguous() && x.contiguous()) {
    FLUX8_CUDA_CHECK(cudaMemcpyAsync(y.data, x.data, x.bytes(), cudaMemcpyDeviceToDevice, stream_));
    return;
  }
  FLUX8_CUDA_CHECK(cudaMemcpy2DAsync(y.data, y.ld * sizeof(float), x.data, x.ld * sizeof(float),
                                     x.cols() * sizeof(float), x.rows(), cudaMemcpyDeviceToDevice, stream_));
}

void CudaBackend::add(Tensor y, Tensor a, Tensor b) {
  require_f32("add", {{"y", y}, {"a", a}, {"b", b}});
  require_same_matrix("add", {"y", y}, {"a", a});
  require_same_matrix("add", {"y", y}, {"b", b});
  const Mat Y = mat(y), A = mat(a), B = mat(b);
  if (y.contiguous() && a.contiguous() && b.contiguous()) {
    for_each(*this, Y.rows * Y.cols, [=] __device__(int64_t i) { Y.p[i] = A.p[i] + B.p[i]; });
    return;
  }
  for_each_row(*this, Y.rows, Y.cols, [=] __device__(int64_t r, int c) { Y.at(r, c) = A.at(r, c) + B.at(r, c); });
}

void CudaBackend::accumulate(Tensor y, Tensor x) {
  require_f32("accumulate", {{"y", y}, {"x", x}});
  require_same_matrix("accumulate", {"y", y}, {"x", x});
  const Mat Y = mat(y), X = mat(x);
  if (y.contiguous() && x.contiguous()) {
    for_each(*this, Y.rows * Y.cols, [=] __device__(int64_t i) { Y.p[i] += X.p[i]; });
    return;
  }
  for_each_row(*this, Y.rows, Y.cols, [=] __device__(int64_t r, int c) { Y.at(r, c) += X.at(r, c); });
}

}  // namespace flux8

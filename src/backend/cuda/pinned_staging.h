#pragma once
// Copies between the device and pageable host memory through two pinned chunks. Up: the
// calling thread copies chunk k + 1 into pinned memory (over several threads,
// core/parallel_copy.h) while the copy engine moves chunk k. Copies from pageable memory are
// several times slower (docs/PERFORMANCE.md, Measurements behind the kernels). Down: the copy engine moves chunk k + 1
// while the calling thread copies chunk k out (a checkpoint's host snapshot: gigabytes). Used by
// CudaBackend::upload and download and by the copy queue (memory.cu); one instance per thread
// that copies.
#include <cuda_runtime.h>

#include <cstddef>

namespace flux8::cuda {

class PinnedStaging {
 public:
  static constexpr size_t kChunkBytes = size_t(8) << 20;
  PinnedStaging() = default;
  ~PinnedStaging();  // after the chunks' last copies
  PinnedStaging(const PinnedStaging&) = delete;
  PinnedStaging& operator=(const PinnedStaging&) = delete;

  // Queues the copy of `bytes` from host_src to dst on `stream`; host_src may be reused when
  // it returns (a chunk is refilled only after its previous copy has left). The chunks are
  // made on first use.
  void copy(void* dst, const void* host_src, size_t bytes, cudaStream_t stream);
  // Copies `bytes` from device memory src to host_dst after the work queued on `stream`;
  // host_dst holds them when it returns.
  void copy_to_host(void* host_dst, const void* src, size_t bytes, cudaStream_t stream);

 private:
  void* chunk_[2] = {nullptr, nullptr};
  cudaEvent_t chunk_free_[2] = {nullptr, nullptr};
  int next_ = 0;
  void make_chunks();
};

}  // namespace flux8::cuda

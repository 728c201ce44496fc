#include <cblas.h>
#include <omp.h>

#include <cstdlib>
#include <cstring>

#include "backend/cpu/common.h"
#include "backend/cpu/cpu_backend.h"

namespace flux8 {

CpuBackend::CpuBackend(const BackendOptions& options) : options_(options) {
  // flux8 parallelises with OpenMP itself (GEMMs split by rows, attention by heads) and runs
  // OpenBLAS single-threaded: two thread pools spinning on the same cores (OpenBLAS's threads
  // busy-wait with sched_yield) slow small-model training several-fold.
  openblas_set_num_threads(1);
  // A pinned thread count applies to every OpenMP region of the process, including the FP8
  // reference quantizers (src/fp8/quantize.cpp), which run outside the backend's own loops.
  if (options_.threads > 0) omp_set_num_threads(options_.threads);
}

void* CpuBackend::allocate(size_t bytes) {
  constexpr size_t kAlign = 256;  // matches the CUDA allocator's guarantee
  const size_t padded = std::max<size_t>(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
  void* p = std::aligned_alloc(kAlign, padded);
  if (!p) fail("cpu backend: out of host memory allocating {} bytes", bytes);
  std::memset(p, 0, padded);
  track_allocation(p, padded);
  return p;
}

void CpuBackend::do_release(void* p) {
  track_release(p);
  std::free(p);
}

void CpuBackend::do_upload(void* dst, const void* host_src, size_t bytes) {
  if (bytes) std::memcpy(dst, host_src, bytes);
}

namespace {
// Host memory to host memory, done before upload() or download() returns (any thread: no shared state).
class CpuCopyQueue final : public Backend::CopyQueue {
 public:
  void upload(void* dst, const void* host_src, size_t bytes) override {
    if (bytes) std::memcpy(dst, host_src, bytes);
  }
  void download(void* host_dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(host_dst, src, bytes);
  }
  void synchronize() override {}
  void record_event(Backend::Event&) override {}
  void wait_event(const Backend::Event&) override {}
  bool asynchronous() const override { return false; }
};
}  // namespace

std::unique_ptr<Backend::CopyQueue> CpuBackend::make_copy_queue() { return std::make_unique<CpuCopyQueue>(); }

void CpuBackend::do_download(void* host_dst, const void* src, size_t bytes) {
  if (bytes) std::memcpy(host_dst, src, bytes);
}

}  // namespace flux8

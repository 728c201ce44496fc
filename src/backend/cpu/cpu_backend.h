#pragma once
// The CPU reference backend: plain C++ with OpenMP over independent rows/heads/samples and
// OpenBLAS for matrix products. Every op runs on f32 and on f64 tensors (f64 is what the
// finite-difference gradient checks use). Results never depend on the thread count: no
// reduction is split in a way that depends on how many threads run it.
//
// Implementation is split by concern: memory.cpp, layout.cpp, linear.cpp, activations.cpp,
// norms.cpp, rope.cpp, attention.cpp, embedding.cpp; shared helpers in common.h.
#include "backend/backend.h"

namespace flux8 {

class CpuBackend : public Backend {
 public:
  explicit CpuBackend(const BackendOptions& options);

  std::string name() const override { return "cpu"; }
  bool memory_is_host() const override { return true; }
  const BackendOptions& options() const override { return options_; }

  void* allocate(size_t bytes) override;
  // Ops are done when they return: events are points already passed, the copy queue copies.
  std::unique_ptr<Event> make_event() override { return std::make_unique<Event>(); }
  std::unique_ptr<CopyQueue> make_copy_queue() override;

  // Every op (fill/copy/add/accumulate serve parameter and gradient buffers as well as
  // activations, so they never apply the bf16 activation rounding: their callers know what they
  // hold); the defaulted ones are Backend's.
  FLUX8_REQUIRED_OPS(FLUX8_DECLARE_EXECUTE)
  using Backend::execute;

 protected:
  void do_release(void* p) override;
  void do_upload(void* dst, const void* host_src, size_t bytes) override;
  void do_download(void* host_dst, const void* src, size_t bytes) override;
  void do_record_event(Event&) override {}
  void do_wait_event(const Event&) override {}

 private:
  BackendOptions options_;
};

}  // namespace flux8

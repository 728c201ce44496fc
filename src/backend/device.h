#pragma once
// The device a backend computes on: its memory, its queues and events, its clock, its energy
// counter and its graphs. The trainer and the bench see this interface; the model sees ops
// (backend/ops.h) and precision (backend/precision.h).
//
// The calls through which the host reaches past the queued ops (release, upload, download,
// synchronize, events, timing marks) are non-virtual: each goes through host_access() first, so an
// op interceptor holding ops back (the graph recorder) issues them before (backend/ops.h). They
// are defined out of line (backend.cpp), as is everything in this layer's headers that holds a
// lambda: nvcc's and the host compiler's closures of one inline function need not agree, and the
// linker keeps one of them for the CUDA backend's objects and the others alike.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/ops.h"

namespace flux8 {

// Memory handed out by allocate() (parameters, gradients, moments, arenas, buffers) and, on CUDA,
// what the backend holds for itself (cuBLASLt's workspace, the attention's staging and dP
// region, op scratch): what a framework's caching allocator would count.
struct MemoryUse {
  size_t allocated = 0, peak_allocated = 0;
  size_t device_used = 0;  // CUDA: all device memory in use (context and library workspaces too)
};

// The device's energy counter, power limit and clock, where the backend can read them (CUDA: NVML,
// the driver's management library). A step's energy is the difference of two readings; `available`
// false (with `why`) elsewhere.
struct PowerReading {
  bool available = false;
  std::string why;             // when not available
  double energy_j = 0;         // since the driver loaded (monotonic): use differences
  double power_limit_w = 0;    // the limit the driver enforces
  double sm_clock_mhz = 0;     // at the time of reading
  uint64_t clock_reasons = 0;  // what holds the clock back: NVML's clocks-event reason bits
};

class Device {
 public:
  virtual ~Device() = default;
  virtual std::string name() const = 0;

  // ---- memory -------------------------------------------------------------------------------------
  virtual void* allocate(size_t bytes) = 0;  // 256-byte aligned, zero-filled
  // After the work queued so far (which may still use p).
  void release(void* p);
  void upload(void* dst, const void* host_src, size_t bytes);
  void download(void* host_dst, const void* src, size_t bytes);
  void synchronize();
  virtual MemoryUse memory_use() const { return memory_; }
  // The device's energy counter and clock now (see PowerReading): not available on the CPU.
  virtual PowerReading power_reading() { return PowerReading{.why = name() + " backend: no energy counter"}; }

  // ---- a second queue: uploads from another host thread beside the ops ----------------------------
  // The trainer builds and uploads micro-batch k + 1 on a thread of its own while the device
  // computes k (train/batch_pipeline.h). The copies go to a CopyQueue; Events order the two queues
  // without the host waiting: record_event(e) marks the point the ops queued so far reach,
  // CopyQueue::wait_event(e) holds the queue's later copies until then (the slot being refilled is
  // no longer read), and the reverse pair holds the ops until the copies are in. A backend whose ops
  // are done when they return (the CPU) has trivial events and a queue that copies before upload()
  // returns (asynchronous() false).
  class Event {
   public:
    virtual ~Event() = default;
  };
  class CopyQueue {
   public:
    virtual ~CopyQueue() = default;
    // Host -> backend memory, after what the queue waits for; host_src may be reused once upload()
    // returns. Called from one host thread at a time (any thread).
    virtual void upload(void* dst, const void* host_src, size_t bytes) = 0;
    // Backend memory -> host, after what the queue waits for; host_dst holds the bytes once
    // synchronize() returns. Copies of registered host memory (register_host_memory) run beside
    // the host; others may return only when done.
    virtual void download(void* host_dst, const void* src, size_t bytes) = 0;
    virtual void synchronize() = 0;               // the host waits for the copies queued so far
    virtual void record_event(Event& e) = 0;      // after the copies queued so far
    virtual void wait_event(const Event& e) = 0;  // later copies start after e's point
    // True when the copies run beside the backend's ops (a CUDA copy stream).
    virtual bool asynchronous() const = 0;
  };
  virtual std::unique_ptr<Event> make_event() = 0;
  virtual std::unique_ptr<CopyQueue> make_copy_queue() = 0;
  void record_event(Event& e);      // after the ops queued so far
  void wait_event(const Event& e);  // ops queued later start after e's point

  // True when the ops run on a device of their own and the host's cores are free while they run
  // (CUDA): the trainer then writes checkpoints behind training (async_save: auto). False where the
  // host's cores are the ones that compute (the CPU backend).
  virtual bool computes_beside_host() const { return false; }
  // True when every op gives the same bits on every run of the same inputs (false: the CUDA
  // backend with deterministic_attention off, whose attention backward sums with atomics).
  virtual bool repeats_bit_for_bit() const { return true; }
  // True when allocate()'s memory is the host's (the CPU backend): collectives then send it as it
  // is; otherwise they go through the device (NCCL) or stage through host buffers (src/dist).
  virtual bool memory_is_host() const { return false; }
  // Host memory that upload() and download() then copy straight from and into (on the GPU:
  // page-locked, no staging through the backend's pinned buffers): the optimizer state that
  // optimizer_offload keeps in host memory. False where the device cannot (the copies then stage
  // as before) or needs nothing (the CPU). Unregister before the memory is freed.
  virtual bool register_host_memory(void* /*p*/, size_t /*bytes*/) { return false; }
  virtual void unregister_host_memory(void* /*p*/) {}

  // ---- device timing (flux8 bench --profile) ------------------------------------------------------
  // timing_mark() records the point the backend's queued work has reached (on the GPU an event in
  // its stream: nothing waits) and returns its handle; after synchronize(), timing_elapsed_ms(a, b)
  // is the device time from mark a to mark b. Marks stay valid until release_timing_marks(). The
  // default, for a backend whose ops are done when they return (the CPU), reads the host clock.
  int64_t timing_mark();
  virtual double timing_elapsed_ms(int64_t from, int64_t to);
  virtual void release_timing_marks();

  // ---- graphs: queued work recorded once, launched many times (backend/step_graph.h) --------------
  // Between begin_capture() and end_capture() the ops called are recorded into a graph instead of
  // run; launch_graph() then runs that work, with the same pointers and arguments, as often as asked
  // — in one launch, where issuing the ops one by one costs the host more than the device needs for
  // the small ones. A backend without graphs (the CPU) says so in can_capture(), and the others
  // fail. end_capture() ends the capture in every case and returns null when it failed (an op that
  // synchronises or allocates cannot be captured; nothing of the captured work ran); an op that
  // threw during a capture has ended it too.
  class Graph {
   public:
    virtual ~Graph() = default;
  };
  virtual bool can_capture() const { return false; }
  virtual void begin_capture();
  virtual std::unique_ptr<Graph> end_capture();
  virtual void launch_graph(const Graph& g);
  // Changes whenever memory the backend owns and its ops use (scratch buffers, workspaces) is freed
  // or moved: a graph captured before holds the old addresses and must not run again.
  virtual uint64_t capture_generation() const { return 0; }

 protected:
  virtual void do_release(void* p) = 0;
  virtual void do_upload(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void do_download(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void do_synchronize() {}
  virtual void do_record_event(Event& e) = 0;
  virtual void do_wait_event(const Event& e) = 0;
  virtual int64_t do_timing_mark();
  // Runs `access` (Backend: after its op interceptor has issued what it holds).
  virtual void host_access(HostAccess what, const std::function<void()>& access) { access(); }

  // Implementations call these from allocate()/do_release() so memory_use() is known everywhere.
  void track_allocation(void* p, size_t bytes);
  void track_release(void* p);
  MemoryUse memory_;

 private:
  std::unordered_map<void*, size_t> sizes_;
  std::vector<std::chrono::steady_clock::time_point> host_marks_;  // the default timing marks
};

}  // namespace flux8

#include "dist/nccl/nccl_communicator.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/cuda_backend.h"
#include "core/error.h"
#include "dist/watchdog.h"

namespace flux8 {

namespace {

using Clock = std::chrono::steady_clock;

class NcclCommunicator final : public Communicator, public WatchedQueue {
 public:
  NcclCommunicator(CudaBackend& backend, const NcclGroup& group, CollectiveWatchdog& watchdog);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string describe() const override { return fmt::format("{} group (NCCL, rank {} of {})", name_, rank_, size_); }

  void all_reduce(const Tensor& t, ReduceOp op, bool async) override;
  void reduce_scatter(const Tensor& out, const Tensor& in, bool async) override;
  void reduce(const Tensor& t, int root, bool async) override;
  void all_gather(const Tensor& out, const Tensor& in, bool async) override;
  void broadcast(const Tensor& t, int root) override;
  void join() override;
  void barrier() override;

  // WatchedQueue, from the watchdog's thread.
  std::optional<Pending> oldest_pending() override;
  std::string failure() override;
  void abort() override;

 private:
  struct InFlight {
    std::unique_ptr<Device::Event> done;  // recorded on stream_ after the collective
    std::string what;
    Clock::time_point since;
  };

  void set_up(const NcclGroup& group);
  // "all_reduce on data-parallel group (NCCL, rank 1 of 2)": what errors and the watchdog name.
  std::string where(std::string_view collective) const { return fmt::format("{} on {}", collective, describe()); }
  ncclDataType_t nccl_type(std::string_view collective, const Tensor& t, bool reduces) const;
  // Queues `call` (one NCCL collective on stream_) between the two events described above.
  template <typename Call>
  void enqueue(std::string_view collective, bool async, Call&& call);
  // Waits out ncclInProgress (non-blocking communicator) within the timeout; fails on an error.
  void settle(ncclResult_t result, std::string_view what);
  std::unique_ptr<Device::Event> take_event();
  void forget_completed();  // mutex_ held

  CudaBackend& backend_;
  CollectiveWatchdog& watchdog_;
  std::string name_;
  int rank_ = 0, size_ = 1;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  std::unique_ptr<Device::Event> compute_ready_, joined_;
  void* barrier_word_ = nullptr;  // one f32 the barrier's all-reduce sums
  bool async_pending_ = false;
  std::atomic<bool> aborted_{false};
  std::mutex mutex_;  // in_flight_ and free_events_, shared with the watchdog's thread
  std::deque<InFlight> in_flight_;
  std::vector<std::unique_ptr<Device::Event>> free_events_;
};

NcclCommunicator::NcclCommunicator(CudaBackend& backend, const NcclGroup& group, CollectiveWatchdog& watchdog)
    : backend_(backend), watchdog_(watchdog), name_(group.name), rank_(group.rank), size_(group.size) {
  if (size_ < 1 || rank_ < 0 || rank_ >= size_)
    fail("{} group (NCCL): rank {} of {} is not a place in a group", name_, rank_, size_);
  device_ = backend.device();
  FLUX8_CUDA_CHECK(cudaSetDevice(device_));
  FLUX8_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  compute_ready_ = backend.make_event();
  joined_ = backend.make_event();
  try {
    set_up(group);
    barrier_word_ = backend.allocate(sizeof(float));
  } catch (...) {
    if (comm_ && !aborted_.exchange(true)) ncclCommAbort(comm_);
    cudaStreamDestroy(stream_);
    throw;
  }
  watchdog_.watch(this);
}

void NcclCommunicator::set_up(const NcclGroup& group) {
  ncclUniqueId id{};
  if (rank_ == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess)
      fail("{}: ncclGetUniqueId failed: {} (NCCL_DEBUG=WARN says more)", where("set-up"), ncclGetErrorString(r));
  }
  if (size_ > 1) {
    if (!group.share_from_first_rank)
      fail("{}: a group of {} ranks needs a way to share NCCL's unique id (MPI)", where("set-up"), size_);
    const auto wait = watchdog_.host_wait(where("sharing NCCL's unique id"));
    group.share_from_first_rank(&id, sizeof id);
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  config.commName = name_.c_str();
  settle(ncclCommInitRankConfig(&comm_, size_, id, rank_, &config), "set-up");
}

NcclCommunicator::~NcclCommunicator() {
  cudaSetDevice(device_);
  // Unwinding from an error: the other ranks may never join what this rank queued, so nothing is
  // waited for (the job is ending); else the queued collectives finish under the watchdog's eye.
  const bool unwinding = std::uncaught_exceptions() > 0;
  if (!unwinding && !aborted_) cudaStreamSynchronize(stream_);
  watchdog_.unwatch(this);
  if (unwinding || aborted_) {
    if (!aborted_.exchange(true)) ncclCommAbort(comm_);
  } else {
    try {
      settle(ncclCommFinalize(comm_), "finalize");
      ncclCommDestroy(comm_);
    } catch (const std::exception&) {
      ncclCommAbort(comm_);
    }
  }
  if (barrier_word_) backend_.release(barrier_word_);
  cudaStreamDestroy(stream_);
}

void NcclCommunicator::settle(ncclResult_t result, std::string_view what) {
  const auto deadline = Clock::now() + watchdog_.timeout();
  while (result == ncclInProgress) {
    if (Clock::now() > deadline) {
      if (!aborted_.exchange(true)) ncclCommAbort(comm_);
      fail(
          "{}: waited more than {} s for the other ranks (distributed_timeout_minutes; "
          "FLUX8_COLLECTIVE_TIMEOUT_S): a rank of the group died or hangs",
          where(what), std::chrono::duration_cast<std::chrono::seconds>(watchdog_.timeout()).count());
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
    if (const ncclResult_t query = ncclCommGetAsyncError(comm_, &result); query != ncclSuccess) result = query;
  }
  if (result != ncclSuccess)
    fail("{}: NCCL failed: {}: {} (NCCL_DEBUG=WARN says more)", where(what), ncclGetErrorString(result),
         comm_ ? ncclGetLastError(comm_) : "");
}

ncclDataType_t NcclCommunicator::nccl_type(std::string_view collective, const Tensor& t, bool reduces) const {
  if (!t.defined()) fail("{}: an undefined tensor", where(collective));
  if (!t.contiguous())
    fail("{}: {} is a strided view; collectives take contiguous tensors", where(collective), t.str());
  switch (t.dtype) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
    case DType::u8:
      // FP8 codes (and other bytes) are moved, never summed.
      if (!reduces) return ncclUint8;
      break;
    default: break;
  }
  fail("{}: {} is not a type this collective takes (f32, f64, bf16, f16{})", where(collective), t.str(),
       reduces ? "" : "; u8 bytes");
}

std::unique_ptr<Device::Event> NcclCommunicator::take_event() {
  {
    std::lock_guard lock(mutex_);
    forget_completed();
    if (!free_events_.empty()) {
      auto e = std::move(free_events_.back());
      free_events_.pop_back();
      return e;
    }
  }
  return backend_.make_event();
}

void NcclCommunicator::forget_completed() {
  while (!in_flight_.empty() && cudaEventQuery(CudaBackend::native_event(*in_flight_.front().done)) == cudaSuccess) {
    free_events_.push_back(std::move(in_flight_.front().done));
    in_flight_.pop_front();
  }
}

template <typename Call>
void NcclCommunicator::enqueue(std::string_view collective, bool async, Call&& call) {
  if (aborted_) fail("{}: the communicator was aborted after an earlier failure", where(collective));
  backend_.record_event(*compute_ready_);  // after the ops queued so far
  FLUX8_CUDA_CHECK(cudaSetDevice(device_));
  FLUX8_CUDA_CHECK(cudaStreamWaitEvent(stream_, CudaBackend::native_event(*compute_ready_), 0));
  const auto since = Clock::now();
  settle(call(), collective);
  std::unique_ptr<Device::Event> done = take_event();
  FLUX8_CUDA_CHECK(cudaEventRecord(CudaBackend::native_event(*done), stream_));
  if (async)
    async_pending_ = true;
  else
    backend_.wait_event(*done);
  std::lock_guard lock(mutex_);
  in_flight_.push_back(InFlight{std::move(done), where(collective), since});
}

void NcclCommunicator::all_reduce(const Tensor& t, ReduceOp op, bool async) {
  const ncclDataType_t type = nccl_type("all_reduce", t, true);
  const ncclRedOp_t nccl_op = op == ReduceOp::max ? ncclMax : ncclSum;
  enqueue("all_reduce", async,
          [&] { return ncclAllReduce(t.data, t.data, static_cast<size_t>(t.numel()), type, nccl_op, comm_, stream_); });
}

void NcclCommunicator::reduce_scatter(const Tensor& out, const Tensor& in, bool async) {
  const ncclDataType_t type = nccl_type("reduce_scatter", in, true);
  if (out.dtype != in.dtype || in.numel() != out.numel() * size_)
    fail("{}: in {} must hold {} times the elements of out {}, of the same type", where("reduce_scatter"), in.str(),
         size_, out.str());
  nccl_type("reduce_scatter", out, true);
  enqueue("reduce_scatter", async, [&] {
    return ncclReduceScatter(in.data, out.data, static_cast<size_t>(out.numel()), type, ncclSum, comm_, stream_);
  });
}

void NcclCommunicator::reduce(const Tensor& t, int root, bool async) {
  const ncclDataType_t type = nccl_type("reduce", t, true);
  if (root < 0 || root >= size_) fail("{}: root {} is not a rank of the group", where("reduce"), root);
  // In place: the other ranks only send, their t stays as it was.
  enqueue("reduce", async, [&] {
    return ncclReduce(t.data, t.data, static_cast<size_t>(t.numel()), type, ncclSum, root, comm_, stream_);
  });
}

void NcclCommunicator::all_gather(const Tensor& out, const Tensor& in, bool async) {
  const ncclDataType_t type = nccl_type("all_gather", in, false);
  if (out.dtype != in.dtype || out.numel() != in.numel() * size_)
    fail("{}: out {} must hold {} times the elements of in {}, of the same type", where("all_gather"), out.str(), size_,
         in.str());
  nccl_type("all_gather", out, false);
  enqueue("all_gather", async,
          [&] { return ncclAllGather(in.data, out.data, static_cast<size_t>(in.numel()), type, comm_, stream_); });
}

void NcclCommunicator::broadcast(const Tensor& t, int root) {
  const ncclDataType_t type = nccl_type("broadcast", t, false);
  if (root < 0 || root >= size_) fail("{}: root {} is not a rank of the group", where("broadcast"), root);
  enqueue("broadcast", false,
          [&] { return ncclBroadcast(t.data, t.data, static_cast<size_t>(t.numel()), type, root, comm_, stream_); });
}

void NcclCommunicator::join() {
  if (!async_pending_) return;
  FLUX8_CUDA_CHECK(cudaSetDevice(device_));
  // The stream holds collectives only: its tail is reached when every async one has finished.
  FLUX8_CUDA_CHECK(cudaEventRecord(CudaBackend::native_event(*joined_), stream_));
  backend_.wait_event(*joined_);
  async_pending_ = false;
}

void NcclCommunicator::barrier() {
  const Tensor word(barrier_word_, DType::f32, Shape{1});
  enqueue("barrier", false,
          [&] { return ncclAllReduce(word.data, word.data, 1, ncclFloat32, ncclSum, comm_, stream_); });
  // The barrier's all-reduce followed this rank's queued ops and needed every rank's: once the
  // stream has drained, all of it is done. A stall here is the watchdog's to end.
  FLUX8_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

std::optional<WatchedQueue::Pending> NcclCommunicator::oldest_pending() {
  cudaSetDevice(device_);  // the watchdog's thread
  std::lock_guard lock(mutex_);
  forget_completed();
  if (in_flight_.empty()) return std::nullopt;
  return Pending{in_flight_.front().what, in_flight_.front().since};
}

std::string NcclCommunicator::failure() {
  if (aborted_) return "";
  ncclResult_t state = ncclSuccess;
  const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
  if (r != ncclSuccess) state = r;
  if (state == ncclSuccess || state == ncclInProgress) return "";
  return fmt::format("{}: NCCL reports {}: {}", describe(), ncclGetErrorString(state), ncclGetLastError(comm_));
}

void NcclCommunicator::abort() {
  if (!aborted_.exchange(true)) ncclCommAbort(comm_);
}

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(CudaBackend& backend, const NcclGroup& group,
                                                     CollectiveWatchdog& watchdog) {
  return std::make_unique<NcclCommunicator>(backend, group, watchdog);
}

}  // namespace flux8

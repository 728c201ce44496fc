#include "dist/mpi_communicator.h"

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.h"
#include "dist/mpi_runtime.h"

namespace flux8 {

namespace {

// MPI counts are ints: collectives move at most this many bytes per call per rank.
constexpr int64_t kMaxChunkBytes = int64_t{1} << 30;

double load(const char* p, DType t, int64_t i) {
  switch (t) {
    case DType::f64: return reinterpret_cast<const double*>(p)[i];
    case DType::f32: return reinterpret_cast<const float*>(p)[i];
    case DType::bf16: return bf16_bits_to_f32(reinterpret_cast<const uint16_t*>(p)[i]);
    case DType::f16: return f16_bits_to_f32(reinterpret_cast<const uint16_t*>(p)[i]);
    case DType::u8: return reinterpret_cast<const uint8_t*>(p)[i];
  }
  return 0;
}

// out[i] = parts[i] of rank 0 + ... + of rank ranks - 1, each rank's part `stride` bytes on.
template <typename T>
void sum_in_rank_order(const char* parts, char* out, int64_t count, int64_t stride, int ranks) {
  auto* o = reinterpret_cast<T*>(out);
  for (int64_t i = 0; i < count; ++i) {
    T s = reinterpret_cast<const T*>(parts)[i];
    for (int r = 1; r < ranks; ++r) s += reinterpret_cast<const T*>(parts + r * stride)[i];
    o[i] = s;
  }
}

}  // namespace

MpiCommunicator::MpiCommunicator(MPI_Comm comm, Device* device, std::string what)
    : device_(device), what_(std::move(what)) {
  check_mpi(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (comm_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm_);
}

std::string MpiCommunicator::describe() const {
  return fmt::format("{} group (MPI{}, rank {} of {})", what_, device_ ? ", host-staged" : "", rank_, size_);
}

void MpiCommunicator::check_mpi(int rc, const char* what) const {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  fail("{}{}: {} failed: {} (another rank of the job may have failed; its message says why)", rank_prefix(), what_,
       what, std::string(text, static_cast<size_t>(len)));
}

void MpiCommunicator::check_tensor(const Tensor& t, const char* what) const {
  if (!t.contiguous()) fail("{}: {} of a non-contiguous tensor {}", describe(), what, t.str());
}

char* MpiCommunicator::host_in(const Tensor& t) {
  if (!device_) return static_cast<char*>(t.data);
  stage_.resize(t.bytes());
  device_->download(stage_.data(), t.data, t.bytes());  // after the ops queued before
  return stage_.data();
}

void MpiCommunicator::host_out(const Tensor& t, const char* host) {
  if (!device_) {
    if (host != t.data) std::memcpy(t.data, host, t.bytes());
    return;
  }
  device_->upload(t.data, host, t.bytes());
}

void MpiCommunicator::reduce_parts(const char* parts, char* out, int64_t count, DType t, ReduceOp op) const {
  const size_t es = dtype_size(t);
  const int64_t stride = count * static_cast<int64_t>(es);
  if (op == ReduceOp::sum && t == DType::f64) return sum_in_rank_order<double>(parts, out, count, stride, size_);
  if (op == ReduceOp::sum && t == DType::f32) return sum_in_rank_order<float>(parts, out, count, stride, size_);
  if (t == DType::u8 && op == ReduceOp::sum) fail("{}: sums of FP8 codes (u8) are not defined", describe());
  // max in any type (NaN wins: a non-finite amax must reach every rank), sums of 16-bit floats in f32.
  for (int64_t i = 0; i < count; ++i) {
    double acc = load(parts, t, i);
    for (int r = 1; r < size_; ++r) {
      const double x = load(parts + r * stride, t, i);
      if (op == ReduceOp::sum)
        acc = static_cast<float>(static_cast<float>(acc) + static_cast<float>(x));
      else if (std::isnan(x) || x > acc)
        acc = x;
    }
    if (t == DType::u8)
      reinterpret_cast<uint8_t*>(out)[i] = static_cast<uint8_t>(acc);
    else if (t == DType::f64)
      reinterpret_cast<double*>(out)[i] = acc;
    else
      store_f32_as(static_cast<float>(acc), t, out, static_cast<size_t>(i));
  }
}

// Rank r's slice r of the sum over the ranks of `slices` (size() slices of `per` elements, host
// memory) into `mine`: an all-to-all of each chunk, then the rank-ordered reduction.
void MpiCommunicator::reduce_slices(const char* slices, int64_t per, DType t, ReduceOp op, char* mine,
                                    const char* what) {
  const size_t es = dtype_size(t);
  const int64_t chunk = std::max<int64_t>(1, kMaxChunkBytes / static_cast<int64_t>(es) / size_);
  std::vector<char> send(static_cast<size_t>(std::min(chunk, std::max<int64_t>(per, 1)) * size_) * es);
  std::vector<char> parts(send.size());
  for (int64_t begin = 0; begin < per; begin += chunk) {
    const int64_t c = std::min(chunk, per - begin);
    const size_t cb = static_cast<size_t>(c) * es;
    for (int r = 0; r < size_; ++r)
      std::memcpy(send.data() + r * cb, slices + (static_cast<size_t>(r * per + begin)) * es, cb);
    check_mpi(
        MPI_Alltoall(send.data(), static_cast<int>(cb), MPI_BYTE, parts.data(), static_cast<int>(cb), MPI_BYTE, comm_),
        what);
    reduce_parts(parts.data(), mine + static_cast<size_t>(begin) * es, c, t, op);
  }
}

// Every rank's `mine` (`per` elements, host memory) into slice r of `all`, chunk by chunk.
void MpiCommunicator::gather_slices(const char* mine, int64_t per, DType t, char* all, const char* what) {
  const size_t es = dtype_size(t);
  const int64_t chunk = std::max<int64_t>(1, kMaxChunkBytes / static_cast<int64_t>(es) / size_);
  std::vector<char> recv(static_cast<size_t>(std::min(chunk, std::max<int64_t>(per, 1)) * size_) * es);
  for (int64_t begin = 0; begin < per; begin += chunk) {
    const int64_t c = std::min(chunk, per - begin);
    const size_t cb = static_cast<size_t>(c) * es;
    check_mpi(MPI_Allgather(mine + static_cast<size_t>(begin) * es, static_cast<int>(cb), MPI_BYTE, recv.data(),
                            static_cast<int>(cb), MPI_BYTE, comm_),
              what);
    for (int r = 0; r < size_; ++r)
      std::memcpy(all + (static_cast<size_t>(r * per + begin)) * es, recv.data() + r * cb, cb);
  }
}

void MpiCommunicator::reduce_scatter(const Tensor& out, const Tensor& in, bool) {
  check_tensor(out, "reduce_scatter");
  check_tensor(in, "reduce_scatter");
  const int64_t n = out.numel();
  if (in.numel() != n * size_ || in.dtype != out.dtype)
    fail("{}: reduce_scatter of {} into {}: the input must hold {} x the output's elements, of its type", describe(),
         in.str(), out.str(), size_);
  std::vector<char> result(out.bytes());
  reduce_slices(host_in(in), n, in.dtype, ReduceOp::sum, result.data(), "reduce_scatter (MPI_Alltoall)");
  host_out(out, result.data());
}

void MpiCommunicator::reduce(const Tensor& t, int root, bool) {
  check_tensor(t, "reduce");
  if (root < 0 || root >= size_) fail("{}: reduce to rank {}, which is not in the group", describe(), root);
  if (size_ == 1) return;
  const size_t es = dtype_size(t.dtype);
  const int64_t n = t.numel();
  const int64_t chunk = std::max<int64_t>(1, kMaxChunkBytes / static_cast<int64_t>(es) / size_);
  const char* host = host_in(t);
  std::vector<char> result(rank_ == root ? t.bytes() : 0);
  std::vector<char> parts(rank_ == root ? static_cast<size_t>(std::min(chunk, std::max<int64_t>(n, 1)) * size_) * es
                                        : 0);
  for (int64_t begin = 0; begin < n; begin += chunk) {
    const int64_t c = std::min(chunk, n - begin);
    const size_t cb = static_cast<size_t>(c) * es;
    check_mpi(MPI_Gather(host + static_cast<size_t>(begin) * es, static_cast<int>(cb), MPI_BYTE, parts.data(),
                         static_cast<int>(cb), MPI_BYTE, root, comm_),
              "reduce (MPI_Gather)");
    if (rank_ == root)
      reduce_parts(parts.data(), result.data() + static_cast<size_t>(begin) * es, c, t.dtype, ReduceOp::sum);
  }
  if (rank_ == root) host_out(t, result.data());
}

void MpiCommunicator::all_gather(const Tensor& out, const Tensor& in, bool) {
  check_tensor(out, "all_gather");
  check_tensor(in, "all_gather");
  const int64_t n = in.numel();
  if (out.numel() != n * size_ || in.dtype != out.dtype)
    fail("{}: all_gather of {} into {}: the output must hold {} x the input's elements, of its type", describe(),
         in.str(), out.str(), size_);
  // (A copy of the input first: `in` may be out's own slice.)
  std::vector<char> mine(in.bytes());
  std::memcpy(mine.data(), host_in(in), in.bytes());
  std::vector<char> all(out.bytes());
  gather_slices(mine.data(), n, in.dtype, all.data(), "all_gather (MPI_Allgather)");
  host_out(out, all.data());
}

void MpiCommunicator::all_reduce(const Tensor& t, ReduceOp op, bool) {
  check_tensor(t, "all_reduce");
  if (size_ == 1) return;
  const size_t es = dtype_size(t.dtype);
  // Padded to a multiple of the group's size: rank r reduces slice r, then every slice is gathered.
  const int64_t per = (t.numel() + size_ - 1) / size_;
  std::vector<char> padded(static_cast<size_t>(per * size_) * es, 0);
  std::memcpy(padded.data(), host_in(t), t.bytes());
  std::vector<char> mine(static_cast<size_t>(per) * es);
  reduce_slices(padded.data(), per, t.dtype, op, mine.data(), "all_reduce (MPI_Alltoall)");
  gather_slices(mine.data(), per, t.dtype, padded.data(), "all_reduce (MPI_Allgather)");
  host_out(t, padded.data());
}

void MpiCommunicator::broadcast(const Tensor& t, int root) {
  check_tensor(t, "broadcast");
  if (root < 0 || root >= size_) fail("{}: broadcast from rank {}, which is not in the group", describe(), root);
  char* host = host_in(t);
  for (int64_t begin = 0; begin < static_cast<int64_t>(t.bytes()); begin += kMaxChunkBytes) {
    const int64_t c = std::min<int64_t>(kMaxChunkBytes, static_cast<int64_t>(t.bytes()) - begin);
    check_mpi(MPI_Bcast(host + begin, static_cast<int>(c), MPI_BYTE, root, comm_), "broadcast (MPI_Bcast)");
  }
  host_out(t, host);
}

void MpiCommunicator::barrier() {
  if (device_) device_->synchronize();
  check_mpi(MPI_Barrier(comm_), "barrier (MPI_Barrier)");
}

}  // namespace flux8

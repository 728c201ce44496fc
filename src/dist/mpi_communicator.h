#pragma once
// Communicator over an MPI communicator. Tensors in host memory (the CPU backend) are sent as
// they are; tensors in device memory are staged through host buffers (download, MPI, upload) —
// the path that lets several ranks share one GPU in tests (FLUX8_COMM=mpi), where NCCL refuses.
//
// Sums are formed on the host in rank order: reduce_scatter is an all-to-all that gives rank r
// every rank's slice r, which it adds up rank 0 first; all_reduce is that and an all-gather;
// reduce gathers every rank's tensor to the root, which adds them up the same way. The
// result depends only on the group's size (never on MPI's choice of algorithm, which varies with
// message size and can differ between ranks), every rank holds identical bits, and the bytes a
// rank sends are those of a ring's reduce-scatter. bf16 and f16 are summed in f32 and rounded
// once.
#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "backend/communicator.h"
#include "backend/device.h"

namespace flux8 {

class MpiCommunicator final : public Communicator {
 public:
  // `comm` is duplicated (the communicator owns its copy); `device` is the backend whose memory
  // the tensors are in, null for host memory; `what` names the group in messages.
  MpiCommunicator(MPI_Comm comm, Device* device, std::string what);
  ~MpiCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string describe() const override;
  void all_reduce(const Tensor& t, ReduceOp op = ReduceOp::sum, bool async = false) override;
  void reduce_scatter(const Tensor& out, const Tensor& in, bool async = false) override;
  void reduce(const Tensor& t, int root, bool async = false) override;
  void all_gather(const Tensor& out, const Tensor& in, bool async = false) override;
  void broadcast(const Tensor& t, int root) override;
  void barrier() override;
  MPI_Comm mpi_comm() const { return comm_; }

 private:
  // A host view of a tensor's bytes: the tensor itself in host memory, else stage_ (valid until
  // the next host_in); host_out writes them back.
  char* host_in(const Tensor& t);
  void host_out(const Tensor& t, const char* host);
  // The rank-ordered reduction of `count` elements: parts[r * count ...] over r into out.
  void reduce_parts(const char* parts, char* out, int64_t count, DType t, ReduceOp op) const;
  void reduce_slices(const char* slices, int64_t per, DType t, ReduceOp op, char* mine, const char* what);
  void gather_slices(const char* mine, int64_t per, DType t, char* all, const char* what);
  void check_mpi(int rc, const char* what) const;
  void check_tensor(const Tensor& t, const char* what) const;

  MPI_Comm comm_ = MPI_COMM_NULL;
  Device* device_;
  std::string what_;
  int rank_ = 0, size_ = 1;
  std::vector<char> stage_;
};

}  // namespace flux8

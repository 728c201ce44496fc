#pragma once
// A group of processes (ranks) that reduce, scatter and gather tensors together: what data and
// tensor parallelism need, with nothing of how it is done (MPI for host memory and the CPU
// backend, NCCL for CUDA device memory: src/dist). The model sees this interface only.
//
// Every rank of a group calls the same collectives in the same order, with tensors of the same
// dtype and element count; tensors are contiguous and live in the memory of the backend the
// communicator serves. A collective is ordered with the backend's ops: it reads its inputs after
// the ops queued before the call, and ops queued after the call see its result — unless it is
// started `async`, when it runs beside the ops queued after it (a CUDA stream of its own) and its
// tensors must not be touched until join(), after which queued ops see every async result. On a
// backend whose ops are done when they return (the CPU), async collectives complete in the call.
//
// A collective that waits longer than the communicator's timeout for the other ranks (a rank
// died or hangs) ends the whole job with an error naming the group and the rank that waited.
#include <cstdint>
#include <memory>
#include <string>

#include "core/tensor.h"

namespace flux8 {

enum class ReduceOp : uint8_t { sum, max };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;  // within this group
  virtual int size() const = 0;
  // What it runs on and which group it is, for logs and errors: "mpi tensor-parallel", ...
  virtual std::string describe() const = 0;

  // t = op over the ranks' t, on every rank. Sums of floating-point values are formed in an
  // order fixed by the group's size alone, so a run repeats bit for bit.
  virtual void all_reduce(const Tensor& t, ReduceOp op = ReduceOp::sum, bool async = false) = 0;
  // in: size() * n elements; out: n elements, rank r's out = the sum over ranks of in's slice r.
  virtual void reduce_scatter(const Tensor& out, const Tensor& in, bool async = false) = 0;
  // t = the sum over the ranks' t, on `root` alone; the other ranks' t are left as they were.
  // The distributed optimizer's reduction of a gradient bucket that lies in the shards of one or
  // a few ranks. Sums are formed in an order fixed by the group's size alone (MPI: the rank order
  // of all_reduce and reduce_scatter, so the same elements give the same bits by either path).
  virtual void reduce(const Tensor& t, int root, bool async = false) = 0;
  // in: n elements; out: size() * n, slice r = rank r's in. `in` may be out's slice rank().
  virtual void all_gather(const Tensor& out, const Tensor& in, bool async = false) = 0;
  // t = root's t on every rank.
  virtual void broadcast(const Tensor& t, int root) = 0;
  // Queued ops after this see the results of every async collective started before it.
  virtual void join() {}
  // Returns when every rank has called it (host side: it also waits for this rank's queued work).
  virtual void barrier() = 0;
};

// A group that passes every call on to `inner`, which outlives it: the base of a group that
// counts or times another's collectives, overriding those calls alone.
class ForwardingCommunicator : public Communicator {
 public:
  explicit ForwardingCommunicator(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string describe() const override { return inner_.describe(); }
  void all_reduce(const Tensor& t, ReduceOp op, bool async) override { inner_.all_reduce(t, op, async); }
  void reduce_scatter(const Tensor& out, const Tensor& in, bool async) override {
    inner_.reduce_scatter(out, in, async);
  }
  void reduce(const Tensor& t, int root, bool async) override { inner_.reduce(t, root, async); }
  void all_gather(const Tensor& out, const Tensor& in, bool async) override { inner_.all_gather(out, in, async); }
  void broadcast(const Tensor& t, int root) override { inner_.broadcast(t, root); }
  void join() override { inner_.join(); }
  void barrier() override { inner_.barrier(); }

 protected:
  Communicator& inner() const { return inner_; }

 private:
  Communicator& inner_;
};

// The group of one rank: every collective is the identity (a copy where in and out differ), no
// process is involved. Its copies (of any dtype, FP8 codes too) go through host memory: no
// training path copies between different tensors in a group of one.
class Device;
std::unique_ptr<Communicator> make_single_rank_communicator(Device& device, std::string what);

}  // namespace flux8

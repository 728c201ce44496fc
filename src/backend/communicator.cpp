#include "backend/communicator.h"

#include <utility>
#include <vector>

#include "backend/device.h"
#include "core/error.h"

namespace flux8 {

namespace {

class SingleRankCommunicator final : public Communicator {
 public:
  SingleRankCommunicator(Device& device, std::string what) : device_(device), what_(std::move(what)) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string describe() const override { return "single-rank " + what_; }
  void all_reduce(const Tensor&, ReduceOp, bool) override {}
  void reduce_scatter(const Tensor& out, const Tensor& in, bool) override { copy(out, in, "reduce_scatter"); }
  void all_gather(const Tensor& out, const Tensor& in, bool) override { copy(out, in, "all_gather"); }
  void reduce(const Tensor&, int root, bool) override {
    if (root != 0) fail("{}: reduce to rank {} in a group of one rank", describe(), root);
  }
  void broadcast(const Tensor&, int root) override {
    if (root != 0) fail("{}: broadcast from rank {} in a group of one rank", describe(), root);
  }
  void barrier() override {}

 private:
  void copy(const Tensor& out, const Tensor& in, const char* what) {
    if (out.numel() != in.numel() || out.dtype != in.dtype)
      fail("{}: {} of {} into {}: a group of one rank needs the same size and type", describe(), what, in.str(),
           out.str());
    if (out.data == in.data) return;
    std::vector<char> host(in.bytes());
    device_.download(host.data(), in.data, host.size());
    device_.upload(out.data, host.data(), host.size());
  }
  Device& device_;
  std::string what_;
};

}  // namespace

std::unique_ptr<Communicator> make_single_rank_communicator(Device& device, std::string what) {
  return std::make_unique<SingleRankCommunicator>(device, std::move(what));
}

}  // namespace flux8

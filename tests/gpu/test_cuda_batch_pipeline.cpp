// The trainer's input pipeline on the GPU: micro-batches uploaded by the producer thread on the
// copy stream equal the CPU's, even when the device is still busy reading the previous slot
// (the copy stream must wait for it), and `flux8 train` with the overlap gives the same run as
// without it.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "gpu_test_util.h"
#include "train/batch_pipeline.h"
#include "train_test_util.h"

namespace flux8 {
namespace {

using testing::Downloaded;
using testing::gpu;
using Mode = BatchPipelineSpec::Mode;

double rel_l2(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return 1.0;
  double d = 0, n = 0;
  for (size_t i = 0; i < a.size(); ++i) d += (a[i] - b[i]) * (a[i] - b[i]), n += b[i] * b[i];
  return std::sqrt(d / std::max(n, 1e-300));
}

TEST(CudaBatchPipeline, MicroBatchesEqualTheCpuOnesWhileTheDeviceIsBusy) {
  FLUX8_REQUIRE_GPU();
  const testing::PipelineFixture f;
  const int64_t global = 4, micro = 2, first = 1, end = 7, count = (end - first) * (global / micro);
  std::vector<Downloaded> expected;
  {
    auto cpu = make_backend("cpu");
    DataLoader loader(f.loader_options());
    BatchPipeline pipeline(*cpu, loader, f.spec(Mode::caller, global, micro, first, end));
    for (int64_t k = 0; k < count; ++k) {
      const BatchPipeline::MicroBatch mb = pipeline.acquire();
      expected.push_back(testing::download(*cpu, *mb.in, mb.target));
      pipeline.release();
    }
  }
  Backend& be = gpu();
  DataLoader loader(f.loader_options());
  BatchPipeline pipeline(be, loader, f.spec(Mode::automatic, global, micro, first, end));
  EXPECT_TRUE(pipeline.background());  // CUDA: a copy stream, so the producer runs on a thread
  // Before each micro-batch's inputs are copied out, ~10 ms of device work: the producer
  // fills the other slot meanwhile and must not start on this one until the copies have run.
  Tensor busy(be.allocate(size_t(64) << 20), DType::f32, Shape{int64_t(16) << 20});
  std::vector<void*> owned;
  auto copy_of = [&](const Tensor& x) {
    Tensor y(be.allocate(static_cast<size_t>(x.numel()) * sizeof(float)), DType::f32, x.shape);
    owned.push_back(y.data);
    return y;
  };
  std::vector<FluxInputs> inputs;
  std::vector<Tensor> targets;
  for (int64_t k = 0; k < count; ++k) {
    const BatchPipeline::MicroBatch mb = pipeline.acquire();
    for (int rep = 0; rep < 400; ++rep) be.fill(busy, static_cast<double>(rep));  // ~10 ms
    FluxInputs in;
    in.img = copy_of(mb.in->img);
    in.img_ids = copy_of(mb.in->img_ids);
    in.txt = copy_of(mb.in->txt);
    in.txt_ids = copy_of(mb.in->txt_ids);
    in.timesteps = copy_of(mb.in->timesteps);
    in.y = copy_of(mb.in->y);
    const Tensor target = copy_of(mb.target);
    for (auto [y, x] : {std::pair{in.img, mb.in->img},
                        {in.img_ids, mb.in->img_ids},
                        {in.txt, mb.in->txt},
                        {in.txt_ids, mb.in->txt_ids},
                        {in.timesteps, mb.in->timesteps},
                        {in.y, mb.in->y},
                        {target, mb.target}})
      be.copy(y, x);
    pipeline.release();  // queued, not done: the producer may now refill this slot after them
    inputs.push_back(in);
    targets.push_back(target);
  }
  be.synchronize();
  for (int64_t k = 0; k < count; ++k) {
    const Downloaded got = testing::download(be, inputs[static_cast<size_t>(k)], targets[static_cast<size_t>(k)]);
    const Downloaded& want = expected[static_cast<size_t>(k)];
    // The inputs bit for bit; x_t and the target through the GPU's logf/cosf (1 ulp).
    EXPECT_EQ(got.img_ids, want.img_ids) << k;
    EXPECT_EQ(got.txt, want.txt) << k;
    EXPECT_EQ(got.txt_ids, want.txt_ids) << k;
    EXPECT_EQ(got.t, want.t) << k;
    EXPECT_EQ(got.y, want.y) << k;
    EXPECT_LT(rel_l2(got.img, want.img), 1e-6) << k;
    EXPECT_LT(rel_l2(got.target, want.target), 1e-6) << k;
  }
  for (void* p : owned) be.release(p);
  be.release(busy.data);
}

// `flux8 train` on the GPU, CUDA graphs on: the overlap (the CUDA default) against none, and a
// run stopped at step 3 and resumed with it: the same losses and checkpoint bit for bit.
TEST(CudaBatchPipeline, TrainingWithTheOverlapEqualsTrainingWithout) {
  FLUX8_REQUIRE_GPU();
  const testing::RunDir dir("cuda_data_overlap");
  testing::expect_overlap_changes_nothing(dir, {"backend=cuda", "cuda_graph=true", "eval_interval=3"}, "auto");
}

}  // namespace
}  // namespace flux8

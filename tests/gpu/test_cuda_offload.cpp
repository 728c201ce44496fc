// optimizer_offload on the GPU: the moments (moments), and the moments with the f32 master
// weights (cpu), streamed through the device in chunks — one chunk after another, or overlapped
// (two device slots, uploads and downloads on copy streams of their own, ordered by events) —
// train bit for bit as state kept on the device: the same kernels read the same bytes, whatever
// order the copies run in. A chunk that went up before its slot was free, or came down before
// its update ended, changes the bits.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "train_test_util.h"

namespace flux8 {
namespace {

using testing::RunDir;

// Six steps with the state on the device, then offloaded with and without overlap (the
// overlapped run stops after step 3 and resumes); `model`: keys that size the model and chunks.
void expect_offload_matches_the_device(const std::string& offload, const std::vector<std::string>& model) {
  const RunDir dir("cuda_offload");
  auto options = [&](const char* save, const std::vector<std::string>& keys) {
    TrainOptions o = dir.options(save);
    o.overrides.insert(o.overrides.end(), {"backend=cuda", "fp8=hybrid", "fp8_recipe=delayed", "save_interval=3"});
    o.overrides.insert(o.overrides.end(), model.begin(), model.end());
    o.overrides.insert(o.overrides.end(), keys.begin(), keys.end());
    return o;
  };
  run_training(options("device", {}));
  run_training(options("sequential", {"optimizer_offload=" + offload, "optimizer_offload_overlap=false"}));
  testing::train_across_a_resume(
      options("overlapped", {"optimizer_offload=" + offload, "optimizer_offload_overlap=true"}), 3, 6);
  const std::vector<double> losses = testing::step_losses(dir.root / "device" / "metrics.jsonl");
  ASSERT_EQ(losses.size(), 6u);
  for (const char* run : {"sequential", "overlapped"}) {
    SCOPED_TRACE(run);
    EXPECT_EQ(testing::step_losses(dir.root / run / "metrics.jsonl"), losses);
    for (const char* file : {"model.safetensors", "optimizer.safetensors"})
      testing::expect_same_tensors((dir.root / "device" / "step-0000006" / file).string(),
                                   (dir.root / run / "step-0000006" / file).string());
  }
}

// The test config's tiny model in chunks of 256 elements: many chunks, each slot reused often.
TEST(CudaOffload, SmallChunksTrainAsStateOnTheDevice) {
  FLUX8_REQUIRE_GPU();
  for (const char* offload : {"moments", "cpu"}) {
    SCOPED_TRACE(offload);
    expect_offload_matches_the_device(offload, {"optimizer_offload_chunk=256"});
  }
}

// A wider model (hidden size 256) in chunks of 2^18 elements: copies of a megabyte each, long
// enough for the copy streams to run beside the updates.
TEST(CudaOffload, LargeChunksTrainAsStateOnTheDevice) {
  FLUX8_REQUIRE_GPU();
  const std::vector<std::string> model{"hidden_size=256", "num_attention_heads=2", "axes_dim=[16, 56, 56]",
                                       "optimizer_offload_chunk=262144"};
  for (const char* offload : {"moments", "cpu"}) {
    SCOPED_TRACE(offload);
    expect_offload_matches_the_device(offload, model);
  }
}

}  // namespace
}  // namespace flux8

// Fault test: a training run whose shards are damaged after its first checkpoint, before it
// reads them: a member that does not decode, a sample whose shapes do not fit the model, a tar
// header that fails its checksum. Resumed without data_skip_corrupt, `flux8 train` exits non-zero naming shard and
// member, and the checkpoint stays the newest, intact; with it, the run completes, each skip
// named on stderr.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "data/demo.h"
#include "data/loader.h"
#include "data/tar.h"
#include "data_test_util.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/signals.h"
#include "train_test_util.h"

namespace fs = std::filesystem;
using namespace flux8;
using flux8::testing::expect_mentions;
using flux8::testing::read_bytes;
using flux8::testing::RunDir;
using flux8::testing::write_bytes;
using flux8::testing::data::npy_f32;

namespace {

constexpr int kSamplesPerShard = 8;
constexpr uint64_t kSeed = 11;

// The members of `shard` (in order) with their headers' offsets: a header is 512 bytes before
// its data when no long-name header precedes it, as the demo's short names never need.
std::vector<TarMember> members_of(const std::string& shard) {
  std::vector<TarMember> out;
  TarReader r(shard);
  TarMember m;
  while (r.next(m)) out.push_back(m);
  return out;
}

// The first member of sample `index` (0-based, in shard order) of a demo shard.
TarMember first_member_of_sample(const std::string& shard, int index) {
  const std::vector<TarMember> all = members_of(shard);
  const size_t per_sample = all.size() / kSamplesPerShard;
  return all.at(static_cast<size_t>(index) * per_sample);
}

}  // namespace

TEST(TrainFaultTest, ShardCorruptedMidRunStopsOrIsSkipped) {
  RunDir dir("data_corrupt_train");
  const fs::path data = dir.root / "data";
  DemoSpec spec;
  spec.image_size = 8;
  spec.text_seq_len = 4;
  spec.context_dim = 8;
  spec.vec_dim = 8;
  spec.train_samples = 48;
  spec.val_samples = 8;
  spec.samples_per_shard = kSamplesPerShard;
  spec.seed = kSeed;
  write_demo_dataset(data.string(), spec);
  // No shuffle buffer: step k reads the epoch's samples 4(k-1) .. 4k-1 in shard order.
  const std::string sets =
      " --set demo_data=false --set data_shuffle_buffer=0 --set save_interval=3 --set seed=" + std::to_string(kSeed);
  const std::string config = (dir.root / "exp.yaml").string();
  const auto train = [&](const std::string& save, const std::string& extra, std::string* log) {
    return flux8::testing::run_flux8(
        "train -c " + config + sets + " --set save_dir=" + (dir.root / save).string() + extra,
        (dir.root / (save + ".log")).string(), log);
  };
  std::string log;
  ASSERT_EQ(train("run", " --stop-after 3", &log), kStoppedExitCode) << log;
  ASSERT_TRUE(fs::exists(dir.root / "run" / "step-0000003"));
  fs::copy(dir.root / "run", dir.root / "skip", fs::copy_options::recursive);

  // Steps 4 to 6 read samples 12..23: the second shard's last four, the third's eight.
  const std::vector<std::string> order =
      epoch_shards(resolve_shards((data / "train-*.tar").string()), kSeed, 0, 0, 1, /*shuffle=*/true);
  ASSERT_GE(order.size(), 3u);
  const std::string wrong_shape = fmt::format("{}.t5.npy", first_member_of_sample(order[1], 6).name.substr(0, 6));
  // A sample whose text features do not fit the model: sample 14's t5 of context_dim 7.
  {
    std::vector<std::pair<std::string, std::vector<uint8_t>>> members;
    TarReader r(order[1]);
    TarMember m;
    while (r.next(m)) members.emplace_back(m.name, r.read_data());
    TarWriter w(order[1]);
    for (const auto& [name, data] : members) {
      if (name == wrong_shape)
        w.add(name, npy_f32({4, 7}, std::vector<float>(28, 0.5f)));
      else
        w.add(name, data.data(), data.size());
    }
    w.finish();
  }
  // A member that does not decode: sample 13's first .npy loses its magic.
  const TarMember bad_member = first_member_of_sample(order[1], 5);
  std::string bytes = read_bytes(order[1]);
  bytes.replace(bad_member.data_offset, 6, "NOTNPY");
  write_bytes(order[1], bytes);
  // Broken framing: the header of sample 20's first member fails its checksum.
  const TarMember bad_header = first_member_of_sample(order[2], 4);
  bytes = read_bytes(order[2]);
  bytes[bad_header.data_offset - 512 + 1] ^= 0x01;
  write_bytes(order[2], bytes);

  // Without data_skip_corrupt: a non-zero exit naming the shard and member; step 3 stays the
  // newest checkpoint, and it verifies.
  EXPECT_NE(train("run", " --resume", &log), 0) << log;
  expect_mentions(log, {"shard " + order[1] + ", member " + bad_member.name, "not a .npy"});
  EXPECT_FALSE(fs::exists(dir.root / "run" / "step-0000004"));
  std::string report;
  EXPECT_EQ(find_latest_checkpoint((dir.root / "run").string(), &report),
            std::optional<std::string>((dir.root / "run" / "step-0000003").string()))
      << report;

  // With it: the run completes; the two samples and the rest of the third shard are skipped,
  // each named.
  ASSERT_EQ(train("skip", " --resume --set data_skip_corrupt=true", &log), 0) << log;
  EXPECT_TRUE(fs::exists(dir.root / "skip" / "step-0000006"));
  expect_mentions(log, {"shard " + order[1] + ", member " + bad_member.name, "skipping sample",
                        "shard " + order[1] + ", member ", " / " + wrong_shape + " / ", "t5 must be [tokens, 8]",
                        "shard " + order[2] + ", member", "checksum", "skipping the rest of shard " + order[2]});
}

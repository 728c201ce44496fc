// Checkpoints of a tensor-parallel job (train/checkpoint_shards.h) over MPI ranks, CPU backend:
// a checkpoint saved at TP=2 (x DP=2 at 4 ranks) and at TP=4 has the same bytes, file for file,
// as the one-rank save of the same weights and moments, which every rank makes on its own; it
// loads back bit for bit at the layout it was written at, and at TP=1; a one-rank checkpoint
// loads into the shards.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "backend/registry.h"
#include "backend/transfer.h"
#include "core/error.h"
#include "core/rng.h"
#include "dist/process_groups.h"
#include "mpi/mpi_test_util.h"
#include "test_tp_util.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/checkpoint_shards.h"
#include "train/data_parallel.h"
#include "train/optimizer.h"

namespace flux8 {
namespace {

namespace fs = std::filesystem;
using testing::file_bytes;
using testing::SharedDir;
using testing::tp_config;
using testing::Values;
using testing::world_rank;
using testing::world_size;

// The whole model's parameters and moments (one-rank layout order), f32-representable as they
// are after training in f32; v > 0.
struct WholeState {
  Values params, m, v;
};

WholeState random_f32_state(const FluxConfig& cfg) {
  WholeState w;
  const ParamLayout layout = ParamLayout::build(cfg);
  for (size_t i = 0; i < layout.params().size(); ++i) {
    const ParamInfo& p = layout.params()[i];
    std::vector<double> x(static_cast<size_t>(p.shape.numel())), m(x.size()), v(x.size());
    for (size_t j = 0; j < x.size(); ++j) {
      x[j] = static_cast<float>(0.3 * rng_normal(5, i, j));
      m[j] = static_cast<float>(1e-3 * rng_normal(6, i, j));
      v[j] = static_cast<float>(1e-6 * std::exp(rng_normal(7, i, j)));
    }
    w.params.emplace_back(p.name, std::move(x));
    w.m.emplace_back(p.name, std::move(m));
    w.v.emplace_back(p.name, std::move(v));
  }
  return w;
}

// One rank's shard of a model (tp_size 1: the whole model) with its moments.
struct RankState {
  std::unique_ptr<Backend> be = make_backend("cpu");
  ParamStore store;
  void* mem[2];
  Tensor m, v;

  RankState(const FluxConfig& cfg, int tp_rank, int tp_size, DType moments)
      : store(cfg, *be, DType::f32, tp_rank, tp_size) {
    const int64_t n = store.layout().total();
    for (void*& p : mem) p = be->allocate(static_cast<size_t>(n) * dtype_size(moments));
    m = Tensor(mem[0], moments, Shape{n});
    v = Tensor(mem[1], moments, Shape{n});
  }
  ~RankState() {
    for (void* p : mem) be->release(p);
  }
  Tensor slice(const Tensor& flat, const ParamInfo& p) const {
    return Tensor(static_cast<char*>(flat.data) + static_cast<size_t>(p.offset) * dtype_size(flat.dtype), flat.dtype,
                  p.shape);
  }
  void fill(const WholeState& w) {
    for (const auto& [flat, whole] :
         {std::pair{store.flat_params(), &w.params}, std::pair{m, &w.m}, std::pair{v, &w.v}})
      for (size_t i = 0; i < whole->size(); ++i) {
        const ParamInfo& p = store.layout().params()[i];
        const std::vector<double>& values = (*whole)[i].second;
        from_host(*be, slice(flat, p), p.shard.sharded() ? take_shard(p.shard, p.shard.rank, values) : values);
      }
    store.params_changed();
  }
  Values read(const Tensor& flat) const {
    Values out;
    for (const ParamInfo& p : store.layout().params()) out.emplace_back(p.name, to_host(*be, slice(flat, p)));
    return out;
  }
};

// random_f32_state with the moments as a one-rank store of `moments` holds them (bf16: rounded).
WholeState random_whole_state(const FluxConfig& cfg, DType moments) {
  WholeState w = random_f32_state(cfg);
  RankState whole(cfg, 0, 1, moments);
  whole.fill(w);
  w.m = whole.read(whole.m);
  w.v = whole.read(whole.v);
  return w;
}

// Every tensor the same bits; a difference is reported with the tensor's name and first element.
void expect_same_values(const Values& got, const Values& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i].first, want[i].first) << what;
    const std::vector<double>& a = got[i].second;
    const std::vector<double>& b = want[i].second;
    ASSERT_EQ(a.size(), b.size()) << what << ", " << got[i].first;
    const auto at = std::mismatch(a.begin(), a.end(), b.begin());
    if (at.first != a.end())
      ADD_FAILURE() << what << ", " << got[i].first << "[" << (at.first - a.begin()) << "]: " << *at.first << " vs "
                    << *at.second;
  }
}

// This rank's shards of the whole tensors.
Values shards_of(const ParamStore& store, const Values& whole) {
  Values out;
  for (size_t i = 0; i < whole.size(); ++i) {
    const ParamShard& s = store.layout().params()[i].shard;
    out.emplace_back(whole[i].first, s.sharded() ? take_shard(s, s.rank, whole[i].second) : whole[i].second);
  }
  return out;
}

// Every file of checkpoint `got` has the bytes of the same file of `want`, and no file is missing.
void expect_same_files(const std::string& got, const std::string& want) {
  size_t files = 0;
  for (const fs::directory_entry& e : fs::directory_iterator(want)) {
    ++files;
    const fs::path mine = fs::path(got) / e.path().filename();
    ASSERT_TRUE(fs::exists(mine)) << mine << " is missing";
    EXPECT_TRUE(file_bytes(mine) == file_bytes(e.path())) << mine << " differs from " << e.path();
  }
  EXPECT_EQ(static_cast<size_t>(std::distance(fs::directory_iterator(got), fs::directory_iterator())), files);
}

TrainerState test_state() {
  TrainerState s;
  s.step = 40;
  s.consumed_samples = 320;
  s.data_position = 9;
  s.seed = 1234;
  s.last_loss = 0.25;
  s.config_yaml = "model:\n  name: tp_test\n";
  s.flux8_version = "0.1.0-test";
  return s;
}

// Loads `dir` into a fresh rank state of this layout; its parameters and moments must be the
// shards of `w`, bit for bit.
void expect_loads(const std::string& dir, const FluxConfig& cfg, int tp_rank, int tp_size, DType moments,
                  const WholeState& w) {
  RankState r(cfg, tp_rank, tp_size, moments);
  TrainerState state;
  load_checkpoint(dir, state, cfg, r.store, r.m, r.v);
  EXPECT_EQ(state.step, test_state().step);
  const std::string where = fmt::format("{} at TP={} rank {}", dir, tp_size, tp_rank);
  expect_same_values(r.read(r.store.flat_params()), shards_of(r.store, w.params), "parameters of " + where);
  expect_same_values(r.read(r.m), shards_of(r.store, w.m), "exp_avg of " + where);
  expect_same_values(r.read(r.v), shards_of(r.store, w.v), "exp_avg_sq of " + where);
}

void expect_tp_checkpoint_is_the_one_rank_checkpoint(int tp, DType moments) {
  if (world_size() % tp != 0) GTEST_SKIP() << "needs a multiple of " << tp << " ranks";
  const FluxConfig cfg = tp_config(1, 2);
  const WholeState w = random_whole_state(cfg, moments);
  const TrainerState state = test_state();
  RankState mine(cfg, world_rank() % tp, tp, moments);
  mine.fill(w);
  ProcessGroups groups(MPI_COMM_WORLD, ParallelSizes{.tp = tp}, *mine.be);
  const SharedDir root("ckpt_shards_tp" + std::to_string(tp));

  const std::string saved = save_checkpoint_shards(groups, root / "tp", state, cfg, mine.store, mine.m, mine.v, 0);
  EXPECT_EQ(saved.empty(), world_rank() != 0);
  std::string one_rank;
  if (world_rank() == 0) {
    RankState whole(cfg, 0, 1, moments);
    whole.fill(w);
    one_rank = save_checkpoint(root / "one", state, cfg, whole.store, whole.m, whole.v, 0);
    verify_checkpoint(saved);
    expect_same_files(saved, one_rank);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const std::string dir = (fs::path(root / "tp") / checkpoint_dir_name(state.step)).string();
  expect_loads(dir, cfg, groups.tp_rank(), tp, moments, w);  // at the layout it was written at
  expect_loads(dir, cfg, 0, 1, moments, w);                  // at TP=1
  const std::string one_dir = (fs::path(root / "one") / checkpoint_dir_name(state.step)).string();
  expect_loads(one_dir, cfg, groups.tp_rank(), tp, moments, w);  // a one-rank checkpoint into shards
}

TEST(CheckpointShards, TwoRanksWriteTheOneRankCheckpoint) {
  expect_tp_checkpoint_is_the_one_rank_checkpoint(2, DType::f32);
}

TEST(CheckpointShards, FourRanksWriteTheOneRankCheckpoint) {
  expect_tp_checkpoint_is_the_one_rank_checkpoint(4, DType::f32);
}

TEST(CheckpointShards, Bf16MomentsRoundTrip) { expect_tp_checkpoint_is_the_one_rank_checkpoint(2, DType::bf16); }

// A rank of a TP x DP job whose AdamW moments are sharded over the data-parallel group (ZeRO-1).
struct ZeroRank {
  std::unique_ptr<Backend> be = make_backend("cpu");
  ParamStore store;
  DataParallel dp;
  AdamWOptimizer opt;

  ZeroRank(const FluxConfig& cfg, ProcessGroups& groups)
      : store(cfg, *be, DType::f32, groups.tp_rank(), groups.tp_size()),
        dp(groups.dp(), *be),
        opt(store, AdamWConfig{.clip_grad = 0}) {
    opt.set_data_parallel(&dp, /*distributed=*/true);
  }
  // One AdamW step on this rank's shards of whole random gradients (the same on every rank).
  void step(int64_t n) {
    for (size_t i = 0; i < store.layout().params().size(); ++i) {
      const ParamInfo& p = store.layout().params()[i];
      std::vector<double> g(static_cast<size_t>(p.shard.full.numel()));
      for (size_t j = 0; j < g.size(); ++j) g[j] = rng_normal(static_cast<uint64_t>(20 + n), i, j);
      from_host(*be, store.grad(p.name), p.shard.sharded() ? take_shard(p.shard, p.shard.rank, g) : g);
    }
    opt.step(n, 1e-2);
  }
};

// Written at TP=2 x DP=2 (TP=2 at 2 ranks) with sharded moments, loaded at that layout, and the
// next step taken from both: the same parameters and moments, bit for bit.
TEST(CheckpointShards, ShardedOptimizerResumesBitExactly) {
  if (world_size() % 2 != 0) GTEST_SKIP() << "needs a multiple of 2 ranks";
  const FluxConfig cfg = tp_config(1, 1);
  auto group_be = make_backend("cpu");
  ProcessGroups groups(MPI_COMM_WORLD, ParallelSizes{.tp = 2}, *group_be);
  const SharedDir root("ckpt_shards_zero");
  ZeroRank a(cfg, groups);
  RankState filled(cfg, groups.tp_rank(), 2, DType::f32);
  filled.fill(random_f32_state(cfg));
  a.be->upload(a.store.flat_params().data, filled.store.flat_params().data,
               static_cast<size_t>(a.store.layout().total()) * sizeof(float));
  a.store.params_changed();
  a.step(1);
  a.opt.gather_moments();
  save_checkpoint_shards(groups, root / "ckpt", test_state(), cfg, a.store, a.opt.full_exp_avg(),
                         a.opt.full_exp_avg_sq(), 0);
  a.opt.release_full_moments();
  MPI_Barrier(MPI_COMM_WORLD);

  ZeroRank b(cfg, groups);
  TrainerState state;
  load_checkpoint((fs::path(root / "ckpt") / checkpoint_dir_name(test_state().step)).string(), state, cfg, b.store,
                  b.opt.exp_avg(), b.opt.exp_avg_sq(), nullptr, nullptr, CheckpointVerify::digests, nullptr,
                  b.opt.owned());
  a.step(2);
  b.step(2);
  for (const auto& [what, resumed, straight] : {std::tuple{"parameters", b.store.flat_params(), a.store.flat_params()},
                                                std::tuple{"exp_avg", b.opt.exp_avg(), a.opt.exp_avg()},
                                                std::tuple{"exp_avg_sq", b.opt.exp_avg_sq(), a.opt.exp_avg_sq()}})
    expect_same_values({{what, to_host(*b.be, resumed)}}, {{what, to_host(*a.be, straight)}},
                       fmt::format("rank {} after the resumed step", world_rank()));
}

// A store that is not this rank's shard is refused on every rank before any collective, naming
// the rank and the parameter.
TEST(CheckpointShards, StoreOfAnotherLayoutIsRefused) {
  if (world_size() % 2 != 0) GTEST_SKIP() << "needs a multiple of 2 ranks";
  const FluxConfig cfg = tp_config(1, 1);
  RankState whole(cfg, 0, 1, DType::f32);
  ProcessGroups groups(MPI_COMM_WORLD, ParallelSizes{.tp = 2}, *whole.be);
  const SharedDir root("ckpt_shards_refused");
  if (groups.dp_rank() != 0) return;  // returns at once: nothing of group 0's state is theirs
  const std::string e = testing::error_of(
      [&] { save_checkpoint_shards(groups, root / "ckpt", test_state(), cfg, whole.store, whole.m, whole.v, 0); });
  EXPECT_NE(e.find(fmt::format("rank {}", world_rank())), std::string::npos) << e;
  EXPECT_NE(e.find("img_in.weight"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(root / "ckpt")) << "nothing is written";
}

}  // namespace
}  // namespace flux8

// The distributed optimizer with sharded master weights (each data-parallel rank holds the f32
// masters of its shard of the flat buffer only: ParamStore MasterShards), CPU backend over MPI
// ranks. It trains as the distributed optimizer over whole masters does, bit for bit — f64 and
// f32, bf16 moments, FP8 with delayed and tensorwise scaling, with gradient clipping and a
// skipped non-finite step — and within 1e-12 of one process in f64; every rank's device forms
// (the residents the CPU backend's model reads) hold the gathered masters, each gathered once an
// update and never in a forward, and the FP8 casts are current after every step; its checkpoint,
// gathered to rank 0's host memory, has the bytes of a one-rank save of the same state and
// resumes bit for bit. Runs at any job size.
#include <fmt/format.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "backend/registry.h"
#include "backend/transfer.h"
#include "dist/process_groups.h"
#include "model_test_util.h"
#include "mpi/mpi_test_util.h"
#include "train/checkpoint.h"
#include "train/data_parallel.h"
#include "train/optimizer.h"
#include "train/train_step.h"
#include "train_test_util.h"

namespace flux8 {
namespace {

namespace fs = std::filesystem;

using testing::file_bytes;
using testing::SharedDir;
using testing::world_rank;
using testing::world_size;

constexpr int64_t kGlobal = 8;
constexpr const char* kNanParam = "final_layer.linear.weight";

struct RunSetup {
  DType dtype = DType::f64;
  DType moments = DType::f32;  // f32: the parameters' type
  const Fp8Config* fp8 = nullptr;
  int64_t nan_step = 3;  // 1-based: that step's gradient gets a NaN and the step is skipped
};

// A data-parallel group that counts the elements its broadcasts carry (the sharded masters'
// gathers: each holder broadcasts its part), passing every collective on to `inner`.
class CountingGroup final : public ForwardingCommunicator {
 public:
  explicit CountingGroup(Communicator& inner) : ForwardingCommunicator(inner) {}
  void broadcast(const Tensor& t, int root) override {
    broadcast_elements += t.numel();
    inner().broadcast(t, root);
  }
  int64_t broadcast_elements = 0;
};

// One rank's model and optimizer: one process (no group), the distributed optimizer over whole
// masters, or over sharded ones.
class Trainee {
 public:
  enum class Kind { one_process, whole_masters, sharded_masters };
  Trainee(const FluxConfig& cfg, Communicator* group, Kind kind, const RunSetup& s)
      : cfg_(cfg), setup_(s), be_(make_backend("cpu")), empty_(testing::zero_prompt(cfg)), buf_(*be_, s.dtype) {
    if (group) {
      counting_ = std::make_unique<CountingGroup>(*group);
      dp_ = std::make_unique<DataParallel>(*counting_, *be_);
    }
    const int64_t total = ParamLayout::build(cfg).total();
    model_ =
        std::make_unique<FluxModel>(cfg, *be_, s.dtype, s.fp8, Recompute::none, TensorParallel{}, nullptr,
                                    AdamWOptimizer::master_shards(dp_.get(), kind == Kind::sharded_masters, total));
    testing::randomize_params(model_->params(), 3);
    AdamWConfig ac;
    ac.clip_grad = 0.05;  // small enough to clip: the norm spans every shard
    ac.moment_dtype = s.moments;
    ac.offload_chunk = 256;  // the checkpoint's gather in several pieces
    opt_ = std::make_unique<AdamWOptimizer>(model_->params(), ac);
    if (dp_) opt_->set_data_parallel(dp_.get(), kind != Kind::one_process);
    if (dp_ && model_->fp8())
      model_->fp8()->registry().set_allreduce_hook([this](float* row, int n) {
        std::vector<double> v(row, row + n);
        dp_->max(v);
        for (int i = 0; i < n; ++i) row[i] = static_cast<float>(v[static_cast<size_t>(i)]);
      });
  }

  // Step `step` (1-based) of the global batch: this rank's share, the losses summed over the group.
  StepStats step(int64_t step) {
    const int ranks = dp_ ? dp_->size() : 1, rank = dp_ ? dp_->rank() : 0;
    const int64_t share = kGlobal / ranks;
    StepContext ctx{*model_, cfg_, obj_, empty_, buf_, 77};
    if (dp_) ctx.data_parallel = &dp_->group();
    const std::vector<Sample> samples =
        testing::demo_batch(cfg_, static_cast<int>(share), static_cast<int>((step - 1) * kGlobal + rank * share));
    const int64_t before = broadcast_elements();
    const StepLoss sl =
        accumulate_step_gradients(ctx, samples, 2, static_cast<uint64_t>(step - 1), rank * share, kGlobal);
    gathered_in_passes.push_back(broadcast_elements() - before);
    losses.push_back(sl.loss);
    if (step == setup_.nan_step) {
      const Tensor g = model_->params().grad(kNanParam);
      std::vector<double> v = to_host(*be_, g);
      v.at(0) = std::numeric_limits<double>::quiet_NaN();
      from_host(*be_, g, v);
    }
    const int64_t before_update = broadcast_elements();
    const StepStats st = apply_optimizer_step(*model_, *opt_, step, 1e-2);
    gathered_in_updates.push_back(broadcast_elements() - before_update);
    norms.push_back(st.grad_norm);
    return st;
  }

  // The whole masters (gathered to rank 0 where sharded, then sent to every rank) and moments.
  struct State {
    std::vector<double> params, m, v;
  };
  State whole_state() {
    opt_->gather_moments();
    State s;
    const CheckpointFlats f = flats();
    const int64_t total = model_->params().layout().total();
    for (auto [t, on, out] : {std::tuple{f.params, f.params_on, &s.params}, std::tuple{f.adam_m, f.moments_on, &s.m},
                              std::tuple{f.adam_v, f.moments_on, &s.v}}) {
      *out = t.defined() ? to_host(*on, t) : std::vector<double>(static_cast<size_t>(total));
      if (dp_) dp_->broadcast(*out, 0);
    }
    opt_->release_full_moments();
    return s;
  }
  CheckpointFlats flats() const {
    return {opt_->full_masters(), opt_->full_exp_avg(), opt_->full_exp_avg_sq(), &opt_->full_masters_backend(),
            &opt_->full_state_backend()};
  }
  // The f32 residents the model reads (every parameter but the FP8 sites' weights, which are cast
  // from gathered masters), in the layout's order; NaN for those without one.
  std::vector<double> forms() {
    ParamStore& store = model_->params();
    std::vector<double> out;
    for (const ParamInfo& p : store.layout().params()) {
      std::vector<double> v(static_cast<size_t>(p.shape.numel()), std::numeric_limits<double>::quiet_NaN());
      const bool fp8_site = model_->fp8() && p.block_linear;
      if (!fp8_site) v = to_host(*be_, store.operand(store.param(p.name)));
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  }

  FluxModel& model() { return *model_; }
  AdamWOptimizer& opt() { return *opt_; }
  DataParallel* dp() { return dp_.get(); }
  std::vector<double> losses, norms;
  // Per step: the elements the group broadcast in the forwards and backwards, and in the update.
  std::vector<int64_t> gathered_in_passes, gathered_in_updates;

 private:
  int64_t broadcast_elements() const { return counting_ ? counting_->broadcast_elements : 0; }
  const FluxConfig& cfg_;
  RunSetup setup_;
  std::unique_ptr<Backend> be_;
  std::unique_ptr<CountingGroup> counting_;
  std::unique_ptr<DataParallel> dp_;
  std::unique_ptr<FluxModel> model_;
  std::unique_ptr<AdamWOptimizer> opt_;
  ObjectiveConfig obj_;
  EmptyPrompt empty_;
  StepBuffers buf_;
};

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

void expect_same_bits(const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t first = got.size();
  for (size_t i = 0; i < got.size() && first == got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(double)) != 0) first = i;
  EXPECT_EQ(first, got.size()) << what << " on rank " << world_rank() << " differ first at element " << first << ": "
                               << got[first] << " vs " << want[first];
}

// Five steps (the third skipped) with sharded masters against the distributed optimizer over
// whole masters: the same losses, norms, masters and moments, bit for bit; every rank's forms
// hold the masters. f64 also against one process, within 1e-12.
void expect_sharded_masters_change_nothing(const RunSetup& s, const std::string& what) {
  SCOPED_TRACE(what);
  const FluxConfig cfg = testing::tiny_demo_model();
  auto be = make_backend("cpu");
  ProcessGroups groups(MPI_COMM_WORLD, ParallelSizes{}, *be);
  if (kGlobal % (2 * world_size())) GTEST_SKIP() << "8 samples do not split into micro-batches of 2 over this job";
  Trainee whole(cfg, &groups.dp(), Trainee::Kind::whole_masters, s);
  Trainee sharded(cfg, &groups.dp(), Trainee::Kind::sharded_masters, s);
  if (world_size() > 1) {
    EXPECT_TRUE(sharded.model().params().masters_sharded());
    EXPECT_LT(sharded.model().params().held_count(), sharded.model().params().layout().total());
  }
  for (int64_t step = 1; step <= 5; ++step) {
    const StepStats a = whole.step(step), b = sharded.step(step);
    EXPECT_EQ(a.applied, step != s.nan_step) << "step " << step;
    EXPECT_EQ(b.applied, a.applied) << "step " << step;
    // Made with the update: a forward rank 0 runs alone (a sample preview) needs no collective —
    // the FP8 weights' casts too, after a skipped step as well (made again with the new scales).
    EXPECT_TRUE(sharded.model().params().device_forms_current()) << "step " << step;
    if (sharded.model().fp8() && sharded.model().params().masters_sharded())
      EXPECT_TRUE(sharded.model().fp8()->weight_casts_current()) << "step " << step;
  }
  if (world_size() > 1) {  // every master gathered once by each update, none by the passes but the first
    const int64_t total = sharded.model().params().layout().total();
    for (size_t i = 0; i < sharded.gathered_in_passes.size(); ++i) {
      const bool applied = static_cast<int64_t>(i) + 1 != s.nan_step;
      // The first forward makes the forms of the initialised masters.
      EXPECT_EQ(sharded.gathered_in_passes[i], i == 0 ? total : 0) << "step " << i + 1;
      if (applied) EXPECT_EQ(sharded.gathered_in_updates[i], total) << "step " << i + 1;
      if (!applied) EXPECT_LE(sharded.gathered_in_updates[i], s.fp8 ? total : 0) << "step " << i + 1;
    }
  }
  expect_same_bits(sharded.losses, whole.losses, "losses");
  const auto finite = [](std::vector<double> v) {  // the skipped step's NaN norm, whatever its payload
    for (double& x : v) x = std::isfinite(x) ? x : 0.0;
    return v;
  };
  EXPECT_FALSE(std::isfinite(sharded.norms.at(static_cast<size_t>(s.nan_step - 1))));
  expect_same_bits(finite(sharded.norms), finite(whole.norms), "gradient norms");
  const Trainee::State ws = whole.whole_state(), ss = sharded.whole_state();
  expect_same_bits(ss.params, ws.params, "masters");
  expect_same_bits(ss.m, ws.m, "exp_avg");
  expect_same_bits(ss.v, ws.v, "exp_avg_sq");
  const std::vector<double> forms = sharded.forms();
  size_t compared = 0;
  for (size_t i = 0; i < forms.size(); ++i)
    if (!std::isnan(forms[i])) {
      ++compared;
      if (std::memcmp(&forms[i], &ss.params[i], sizeof(double)) != 0) {
        ADD_FAILURE() << "rank " << world_rank() << ": the device form of flat element " << i << " is " << forms[i]
                      << ", its master " << ss.params[i];
        break;
      }
    }
  EXPECT_GT(compared, forms.size() / 100);
  if (s.dtype != DType::f64) return;
  Trainee one(cfg, nullptr, Trainee::Kind::one_process, s);
  for (int64_t step = 1; step <= 5; ++step) one.step(step);
  EXPECT_LT(testing::max_rel_error(sharded.losses, one.losses), 1e-12);
  EXPECT_LT(testing::max_rel_error(ss.params, one.whole_state().params), 1e-12);
}

TEST(ShardedMasters, TrainAsWholeMastersInF64) { expect_sharded_masters_change_nothing(RunSetup{}, "f64"); }

TEST(ShardedMasters, TrainAsWholeMastersWithBf16Moments) {
  expect_sharded_masters_change_nothing(RunSetup{DType::f32, DType::bf16}, "f32, bf16 moments");
}

// Delayed: the casts are made at first use from masters gathered over the group; tensorwise: every
// cast's scale comes from the gathered master's amax.
TEST(ShardedMasters, TrainAsWholeMastersInFp8) {
  for (const Fp8Recipe recipe : {Fp8Recipe::delayed, Fp8Recipe::tensorwise}) {
    Fp8Config fp8 = testing::delayed_hybrid_fp8();
    fp8.recipe = recipe;
    expect_sharded_masters_change_nothing(RunSetup{DType::f32, DType::bf16, &fp8},
                                          recipe == Fp8Recipe::delayed ? "fp8 delayed" : "fp8 tensorwise");
  }
}

// The checkpoint of sharded masters and moments, gathered to rank 0's host memory, has the bytes
// of the one-rank save of the same state, file for file; loaded into sharded masters it resumes
// bit for bit.
TEST(ShardedMasters, CheckpointIsTheOneRankCheckpointAndResumes) {
  const FluxConfig cfg = testing::tiny_demo_model();
  auto be = make_backend("cpu");
  ProcessGroups groups(MPI_COMM_WORLD, ParallelSizes{}, *be);
  if (kGlobal % (2 * world_size())) GTEST_SKIP() << "8 samples do not split into micro-batches of 2 over this job";
  const SharedDir dir("sharded_masters_ckpt");
  const RunSetup s{DType::f32, DType::bf16, nullptr, 0};
  Trainee a(cfg, &groups.dp(), Trainee::Kind::sharded_masters, s);
  for (int64_t step = 1; step <= 3; ++step) a.step(step);
  TrainerState state;
  state.step = 3;
  state.seed = 5;
  state.config_yaml = "model:\n  name: sharded_masters_test\n";
  a.opt().gather_moments();
  std::string saved;
  if (world_rank() == 0) {
    saved = save_checkpoint(dir / "sharded", state, a.model().params(), a.flats(), 0);
    // The one-rank save of the same state: a store of whole masters holding the gathered values.
    const CheckpointFlats f = a.flats();
    FluxModel one(cfg, *be, DType::f32);
    from_host(*be, one.params().flat_params(), to_host(*f.params_on, f.params));
    const std::string one_dir =
        save_checkpoint(dir / "one", state, cfg, one.params(), f.adam_m, f.adam_v, 0, nullptr, f.moments_on);
    size_t files = 0;
    for (const fs::directory_entry& e : fs::directory_iterator(one_dir)) {
      ++files;
      EXPECT_TRUE(file_bytes(fs::path(saved) / e.path().filename()) == file_bytes(e.path()))
          << e.path().filename() << " differs from the one-rank save's";
    }
    EXPECT_GE(files, 3u);
  }
  a.opt().release_full_moments();
  MPI_Barrier(MPI_COMM_WORLD);

  Trainee b(cfg, &groups.dp(), Trainee::Kind::sharded_masters, s);
  TrainerState loaded;
  load_checkpoint(dir / "sharded/step-0000003", loaded, cfg, b.model().params(), b.opt().exp_avg(),
                  b.opt().exp_avg_sq(), nullptr, nullptr, CheckpointVerify::digests, &b.opt().moments_backend(),
                  b.opt().owned());
  EXPECT_EQ(loaded.step, 3);
  for (int64_t step = 4; step <= 5; ++step) {
    a.step(step);
    b.step(step);
  }
  expect_same_bits(b.losses, std::vector<double>(a.losses.begin() + 3, a.losses.end()), "losses after the resume");
  const Trainee::State sa = a.whole_state(), sb = b.whole_state();
  expect_same_bits(sb.params, sa.params, "masters after the resume");
  expect_same_bits(sb.m, sa.m, "exp_avg after the resume");
  expect_same_bits(sb.v, sa.v, "exp_avg_sq after the resume");
}

}  // namespace
}  // namespace flux8

#include "bench/step_bench.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <memory>

#include "backend/energy.h"
#include "backend/step_graph.h"
#include "backend/transfer.h"
#include "bench/op_profiler.h"
#include "config/config.h"
#include "core/error.h"
#include "core/process_clock.h"
#include "core/rng.h"
#include "data/synthetic.h"
#include "dist/mpi_runtime.h"
#include "dist/process_groups.h"
#include "model/flops.h"
#include "model/flux_model.h"
#include "model/input_batch.h"
#include "train/data_parallel.h"
#include "train/gradient_buckets.h"
#include "train/optimizer.h"
#include "train/train_step.h"

namespace flux8 {

namespace {

using Clock = std::chrono::steady_clock;

// A group whose blocking collectives the profiler times as rows of their own ("tensor-parallel
// all_reduce", ...): the collectives are the communicator's, not the backend's ops, so the
// profile would otherwise count their time as the device idle or in the op after them. The
// asynchronous ones (gradient buckets) run untimed: their start returns at once.
class ProfiledGroup final : public ForwardingCommunicator {
 public:
  ProfiledGroup(Communicator& inner, OpProfiler& profiler, std::string name)
      : ForwardingCommunicator(inner), profiler_(profiler), name_(std::move(name)) {}
  void all_reduce(const Tensor& t, ReduceOp op, bool async) override {
    timed("all_reduce", async, [&] { inner().all_reduce(t, op, async); });
  }
  void reduce_scatter(const Tensor& out, const Tensor& in, bool async) override {
    timed("reduce_scatter", async, [&] { inner().reduce_scatter(out, in, async); });
  }
  void reduce(const Tensor& t, int root, bool async) override {
    timed("reduce", async, [&] { inner().reduce(t, root, async); });
  }
  void all_gather(const Tensor& out, const Tensor& in, bool async) override {
    timed("all_gather", async, [&] { inner().all_gather(out, in, async); });
  }
  void broadcast(const Tensor& t, int root) override {
    timed("broadcast", false, [&] { inner().broadcast(t, root); });
  }

 private:
  void timed(const char* what, bool async, const std::function<void()>& f) {
    if (async)
      f();
    else
      profiler_.time_call(name_ + " " + what, f);
  }
  OpProfiler& profiler_;
  std::string name_;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

// Median wall time of f() in ms over `repeats` runs after one warm-up, each synchronised.
template <typename F>
double median_ms(Backend& be, int repeats, F&& f) {
  f();
  be.synchronize();
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) {
    const auto ts = Clock::now();
    f();
    be.synchronize();
    t.push_back(1e3 * seconds_since(ts));
  }
  return median(t);
}

// median_ms of `batch` back-to-back calls of f, per call: a call of a few tens of µs is then not
// read with the launch and the synchronisation around it.
template <typename F>
double median_ms_per_call(Backend& be, int repeats, int batch, F&& f) {
  return median_ms(be, repeats,
                   [&] {
                     for (int i = 0; i < batch; ++i) f();
                   }) /
         batch;
}

std::vector<double> randn(uint64_t seed, uint64_t stream, int64_t n, double scale) {
  std::vector<double> v(static_cast<size_t>(n));
  // Each value is a pure function of (seed, stream, i): any thread count gives the same data.
#pragma omp parallel for schedule(static) if (n >= (1 << 16))
  for (int64_t i = 0; i < n; ++i)
    v[static_cast<size_t>(i)] = scale * rng_normal(seed, stream, static_cast<uint64_t>(i));
  return v;
}

}  // namespace

StepBenchSpec workload_spec(const std::string& id, const std::string& source_dir) {
  const auto model_file = [&](const char* name) {
    const std::string rel = std::string("configs/models/") + name;
    if (std::filesystem::exists(rel)) return rel;
    return (std::filesystem::path(source_dir) / rel).string();
  };
  StepBenchSpec s;
  s.workload = id;
  if (id == "W1") {
    s.model = FluxConfig::from_config(Config::load(model_file("flux_535m.yaml")));
    s.shape = StepShape{32, 256, s.model.image_tokens(256)};
  } else if (id == "W2") {
    s.model = FluxConfig::from_config(
        Config::load(model_file("flux_12b_dev.yaml"), {"num_double_blocks=2", "num_single_blocks=4"}));
    s.model.name = "flux_12b_width_slice";
    s.shape = StepShape{2, 512, s.model.image_tokens(1024)};
  } else {
    fail("bench: unknown workload '{}': choose W1 or W2, or give a config with -c", id);
  }
  return s;
}

namespace {
// What `flux8 train` does on the host before each step, outside the bench's step clock: a batch
// of MLPerf-shaped samples (`flux8 data synthetic`'s: a VAE posterior's mean and logvar, T5 and CLIP)
// assembled by make_train_batch into the reused host batch, then StepBuffers::upload (the copies
// to the device and the flow-matching noise). Median of 5 after one warm-up.
void time_data_path(Backend& be, const StepBenchSpec& spec, StepBenchResult& r) {
  const FluxConfig& cfg = spec.model;
  const StepShape sh = spec.shape;
  const int64_t grid = static_cast<int64_t>(std::lround(std::sqrt(static_cast<double>(sh.img_tokens))));
  if (grid * grid != sh.img_tokens) return;  // not a square image: no such samples to make
  SyntheticLatentSpec data;                  // what `flux8 data synthetic` writes for this model
  data.latent_channels = cfg.latent_channels;
  data.latent_side = grid * cfg.patch_size;
  data.text_seq_len = sh.txt_tokens;
  data.context_dim = cfg.context_dim;
  data.vec_dim = cfg.vec_dim;
  data.seed = spec.seed;
  std::vector<Sample> samples;
  for (int64_t i = 0; i < sh.batch; ++i) samples.push_back(synthetic_latent_sample(data, i));
  const EmptyPrompt empty{HostTensor{{sh.txt_tokens, cfg.context_dim},
                                     std::vector<float>(static_cast<size_t>(sh.txt_tokens * cfg.context_dim))},
                          HostTensor{{cfg.vec_dim}, std::vector<float>(static_cast<size_t>(cfg.vec_dim))}};
  const ObjectiveConfig obj;
  StepBuffers buffers(be, DType::f32);
  std::vector<double> assemble, upload;
  for (int rep = 0; rep < 6; ++rep) {
    const auto t0 = Clock::now();
    make_train_batch(buffers.host, samples, cfg, obj, empty, spec.seed, static_cast<uint64_t>(rep), 0, 0);
    const double a = 1e3 * seconds_since(t0);
    const auto t1 = Clock::now();
    buffers.upload(buffers.host, cfg, spec.seed);
    be.synchronize();
    if (rep > 0) assemble.push_back(a), upload.push_back(1e3 * seconds_since(t1));
  }
  r.data_assemble_ms = median(assemble);
  r.data_upload_ms = median(upload);
}

// Synthetic data with something to learn: 64 fixed "images" (latents ~ N(0, 1)), each with its
// own text features and pooled vector; every step each sample draws one of them and a fresh
// timestep, so the loss falls as the model learns the text -> image mapping (a loss curve to
// compare precisions on), while the noise keeps every step different. The prototypes live on
// the device; each step's batch is gathered from them (a copy per sample) before the step's
// clock starts, so a 500-step curve is not dominated by host work (W1's text features are
// 134 MB a step).
//
// --data structured instead: each sample draws a fresh code z ~ N(0, I_32); the latents are
// 0.8·A_x z + 0.6·noise (unit variance), the text features A_t z and the pooled vector A_y z,
// with fixed random maps A (entries N(0, 1/32)) made on the device by one GEMM each. The text
// determines z, so the model can learn the text -> image map, but not the noise part: the
// loss has a floor, as on real data, instead of falling to 0 by memorisation.
class SyntheticBatches {
 public:
  static constexpr int64_t kPrototypes = 64, kCode = 32;

  SyntheticBatches(Backend& be, const StepBenchSpec& spec)
      : be_(be), spec_(spec), structured_(spec.data == BenchData::structured), batch_(be, DType::f32) {
    const FluxConfig& cfg = spec.model;
    const int64_t B = spec.shape.batch, Lt = spec.shape.txt_tokens, Li = spec.shape.img_tokens;
    nx_ = Li * cfg.in_channels;
    const int64_t nt = Lt * cfg.context_dim, ny = cfg.vec_dim;
    // The prototypes, or the maps as Linear weights [out, kCode].
    if (structured_) {
      const double a = 1.0 / std::sqrt(static_cast<double>(kCode));
      map_x_ = batch_.make(Shape{nx_, kCode}, randn(spec.seed, 1, nx_ * kCode, 0.8 * a));
      map_t_ = batch_.make(Shape{nt, kCode}, randn(spec.seed, 2, nt * kCode, a));
      map_y_ = batch_.make(Shape{ny, kCode}, randn(spec.seed, 3, ny * kCode, a));
      code_ = batch_.make(Shape{B, kCode}, zeros(B * kCode));
      noise_ = batch_.make(Shape{B, nx_}, zeros(B * nx_));
    } else {
      proto_x_ = batch_.make(Shape{kPrototypes, nx_}, randn(spec.seed, 1, kPrototypes * nx_, 1.0));
      proto_t_ = batch_.make(Shape{kPrototypes, nt}, randn(spec.seed, 2, kPrototypes * nt, 1.0));
      proto_y_ = batch_.make(Shape{kPrototypes, ny}, randn(spec.seed, 3, kPrototypes * ny, 1.0));
    }
    x0 = batch_.make(Shape{B, Li, cfg.in_channels}, zeros(B * nx_));
    in.img = batch_.make(x0.shape, zeros(B * nx_));
    in.txt = batch_.make(Shape{B, Lt, cfg.context_dim}, zeros(B * nt));
    in.y = batch_.make(Shape{B, cfg.vec_dim}, zeros(B * ny));
    std::vector<double> img_ids;
    const int64_t side = std::max<int64_t>(1, static_cast<int64_t>(std::sqrt(static_cast<double>(Li))));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t l = 0; l < Li; ++l) img_ids.insert(img_ids.end(), {0.0, double(l / side), double(l % side)});
    in.img_ids = batch_.make(Shape{B, Li, 3}, img_ids);
    in.txt_ids = batch_.make(Shape{B, Lt, 3}, zeros(B * Lt * 3));
    in.timesteps = batch_.make(Shape{B}, zeros(B));
    if (cfg.guidance_embed) in.guidance = batch_.make(Shape{B}, std::vector<double>(static_cast<size_t>(B), 3.5));
    target = batch_.make(x0.shape, zeros(B * nx_));
    dpred = batch_.make(Shape{B, Li, cfg.out_channels}, zeros(B * Li * cfg.out_channels));
    streams.resize(static_cast<size_t>(B));
    timesteps_.resize(static_cast<size_t>(B));
    x0_rows_ = x0.reshaped(Shape{B, nx_});
    txt_rows_ = in.txt.reshaped(Shape{B, nt});
    code_host_.resize(static_cast<size_t>(structured_ ? B * kCode : 0));
  }

  // Step s's batch into x0, in.txt, in.y and in.timesteps, and its noise streams.
  void load(int s) {
    const int64_t B = spec_.shape.batch;
    const uint64_t seed = spec_.seed;
    for (int64_t b = 0; b < B; ++b) {
      const uint64_t draw = static_cast<uint64_t>(s) * static_cast<uint64_t>(B) + static_cast<uint64_t>(b);
      if (structured_) {
        for (int64_t c = 0; c < kCode; ++c)
          code_host_[static_cast<size_t>(b * kCode + c)] = rng_normal(seed, 6, draw * kCode + static_cast<uint64_t>(c));
      } else {
        const int64_t k = static_cast<int64_t>(rng_uniform(seed, 5, draw) * kPrototypes) % kPrototypes;
        be_.copy(x0_rows_.rows_slice(b, 1), proto_x_.rows_slice(k, 1));
        be_.copy(txt_rows_.rows_slice(b, 1), proto_t_.rows_slice(k, 1));
        be_.copy(in.y.rows_slice(b, 1), proto_y_.rows_slice(k, 1));
      }
      timesteps_[static_cast<size_t>(b)] = rng_uniform(seed, 4, draw);
      streams[static_cast<size_t>(b)] = rng_stream(seed, static_cast<uint64_t>(s), static_cast<uint64_t>(b));
    }
    if (structured_) {
      from_host(be_, code_, code_host_);
      from_host(be_, noise_, randn(seed, 100 + static_cast<uint64_t>(s), B * nx_, 0.6));  // streams 100 + step
      be_.linear(x0_rows_, code_, map_x_, Tensor{});
      be_.accumulate(x0_rows_, noise_);
      be_.linear(txt_rows_, code_, map_t_, Tensor{});
      be_.linear(in.y, code_, map_y_, Tensor{});
    }
    from_host(be_, in.timesteps, timesteps_);
  }

  FluxInputs in;
  Tensor x0, target, dpred;
  std::vector<uint64_t> streams;  // each sample's noise stream this step

 private:
  static std::vector<double> zeros(int64_t n) { return std::vector<double>(static_cast<size_t>(n), 0.0); }

  Backend& be_;
  const StepBenchSpec& spec_;
  const bool structured_;
  InputBatch batch_;
  int64_t nx_ = 0;
  Tensor proto_x_, proto_t_, proto_y_, map_x_, map_t_, map_y_, code_, noise_, x0_rows_, txt_rows_;
  std::vector<double> timesteps_, code_host_;
};

// The step's loss, on the device until the backward is queued (as the trainer reads it).
struct DeviceLoss {
  Backend& be;
  Tensor t{be.allocate(sizeof(double)), DType::f64, Shape{1}};
  ~DeviceLoss() { be.release(t.data); }
};

// What run_step_bench reads after its steps: graph counts, the profile's rows, the memory peak
// and the activation estimate.
void summarize_run(Backend& be, const StepBenchSpec& spec, const StepGraph* graph, const OpProfiler* profiler,
                   StepBenchResult& r) {
  if (graph) {
    const StepGraph::Stats& gs = graph->stats();
    const double steps = spec.warmup > 0 ? spec.steps : spec.steps + spec.warmup;
    r.cuda_graph = true;
    r.graph_segments_per_step = static_cast<double>(gs.launched) / steps;
    r.graph_ops_per_step = static_cast<double>(gs.ops_launched) / steps;
    r.eager_ops_per_step = static_cast<double>(gs.ops_eager) / steps;
    r.graph_capture_failures = gs.capture_failed;
  }
  if (profiler) {
    for (const OpProfiler::Row& row : profiler->rows())
      r.ops.push_back(OpTime{row.op, static_cast<double>(row.calls) / spec.steps, row.ms / spec.steps});
    for (const OpProfiler::Row& row : profiler->idle_before())
      r.idle_before.push_back(OpTime{row.op, static_cast<double>(row.calls) / spec.steps, row.ms / spec.steps});
  }
  r.median_ms = median(r.step_ms);
  r.model_tflop = model_flops(spec.model, spec.shape).training() * spec.micro_batches / 1e12;
  r.tflops = r.median_ms > 0 ? r.model_tflop / (r.median_ms / 1e3) : 0;
  const MemoryUse mu = be.memory_use();
  r.peak_allocated_gib = static_cast<double>(mu.peak_allocated) / 1073741824.0;
  r.device_used_gib = static_cast<double>(mu.device_used) / 1073741824.0;
  // The estimate in the storage type the step ran with (flux8 info's "today" column).
  const ActivationEstimate est = FluxModel::estimate_activations(spec.model, spec.shape, spec.recompute, 1,
                                                                 spec.fp8.enabled ? &spec.fp8 : nullptr);
  const bool bf16_storage = be.activation_dtype(DType::f32) == DType::bf16;
  r.activation_gib = (bf16_storage ? est.gpu_bytes(spec.fp8.enabled, spec.fp8.dot_product_attention)
                                   : est.f32_bytes(spec.fp8.enabled)) /
                     1073741824.0;
}

}  // namespace

StepBenchResult run_step_bench(Backend& device, const StepBenchSpec& spec) {
  const auto t0 = Clock::now();
  const double launch_to_backend = seconds_since_process_start();
  std::unique_ptr<OpProfiler> profiler = spec.profile ? std::make_unique<OpProfiler>(device) : nullptr;
  std::unique_ptr<ProcessGroups> groups;
  std::unique_ptr<DataParallel> dp, tp;
  if (job_placement().launched) {
    groups = std::make_unique<ProcessGroups>(job_world(), ParallelSizes{.tp = spec.tensor_parallel}, device);
    dp = std::make_unique<DataParallel>(groups->dp(), device);
    tp = std::make_unique<DataParallel>(groups->tp(), device);
  }
  // With --profile the groups' blocking collectives are rows of the profile too.
  std::unique_ptr<ProfiledGroup> tp_group, dp_group;
  if (groups && profiler) {
    tp_group = std::make_unique<ProfiledGroup>(groups->tp(), *profiler, "tensor-parallel");
    dp_group = std::make_unique<ProfiledGroup>(groups->dp(), *profiler, "data-parallel");
    dp = std::make_unique<DataParallel>(*dp_group, device);
    tp = std::make_unique<DataParallel>(*tp_group, device);
  }
  Communicator* tp_comm = tp_group ? tp_group.get() : groups ? &groups->tp() : nullptr;
  const int tp_size = groups ? groups->tp_size() : 1;
  const bool data_parallel = dp && dp->size() > 1;
  const bool overlap = data_parallel && spec.overlap_grad_reduce;
  MasterShards shards =
      AdamWOptimizer::master_shards(dp.get(), spec.distributed_optimizer,
                                    ParamLayout::build(spec.model, groups ? groups->tp_rank() : 0, tp_size).total());
  std::unique_ptr<StepGraph> graph;
  // (As the trainer: no graphs around the uploads of offloaded master weights, the gathers of
  // sharded ones, or gradient buckets started inside the backward.)
  if (spec.cuda_graph && !profiler && device.can_capture() && tp_size == 1 && !spec.adam.offload_masters &&
      !shards.group && !overlap)
    graph = std::make_unique<StepGraph>(device, StepGraph::Options::from_environment());
  const std::unique_ptr<Backend> host_memory = spec.adam.offload_masters ? make_backend("cpu") : nullptr;
  Backend& be = device;  // the profiler or the graph recorder, when made, intercept its ops
  StepBenchResult r;
  r.workload = spec.workload;
  r.precision = spec.fp8.enabled ? "FP8 " + spec.fp8.describe() : "BF16";
  if (groups) r.parallel = groups->describe();
  FluxModel model(spec.model, be, DType::f32, spec.fp8.enabled ? &spec.fp8 : nullptr, spec.recompute,
                  TensorParallel{tp_comm}, host_memory.get(), std::move(shards));
  model.params().init(spec.seed);
  model.plan(spec.shape);
  AdamWOptimizer opt(model.params(), spec.adam);
  opt.set_data_parallel(dp.get(), spec.distributed_optimizer);
  opt.set_tensor_parallel(tp.get());
  std::unique_ptr<GradientBuckets> buckets;
  if (data_parallel) {
    std::optional<FlatSharding> sharding;
    if (spec.distributed_optimizer) sharding = FlatSharding::of(model.params().layout().total(), dp->size());
    buckets = std::make_unique<GradientBuckets>(model.params(), *dp, sharding, overlap);
    opt.set_gradients_reduced_by_caller(true);
  }
  // As the trainer: W2's 2 samples keep them (one data-parallel rank).
  model.params().keep_low_rank_grads(data_parallel ? 0 : spec.shape.batch * spec.micro_batches);
  be.synchronize();
  // What a training launch does before its first step (the synthetic data below is the
  // benchmark's own and is not counted).
  r.setup_s = seconds_since(t0);
  SyntheticBatches data(be, spec);
  DeviceLoss loss_buf{be};

  // The synthetic data above is the benchmark's own (W1's 64 prototypes are seconds of host
  // random numbers): a training launch waits for its first batch instead, so it is left out of
  // the launch-to-first-step time.
  const double data_s = seconds_since(t0) - r.setup_s;
  const int total = spec.warmup + spec.steps;
  // The device's energy over the timed steps (the batches' loads between them included: a few
  // ms of a mostly idle device each), and its clock while the last one runs.
  PowerReading energy_start, energy_busy;
  Clock::time_point window_start{};
  std::vector<double> transfer_ms, update_ms, host_update_ms;  // optimizer_offload, per timed step
  for (int s = 0; s < total; ++s) {
    if (profiler) profiler->pause(true);
    data.load(s);
    be.synchronize();
    if (profiler) profiler->pause(false);
    if (s == spec.warmup) {  // the first timed step
      energy_start = be.power_reading();
      window_start = Clock::now();
    }
    // FP8 telemetry counts on the steps a training run would report them (fp8_stats_interval),
    // as the trainer does.
    if (model.fp8())
      model.fp8()->set_collect_stats(spec.fp8.stats_interval > 0 && (s + 1) % spec.fp8.stats_interval == 0);
    const auto ts = Clock::now();
    be.flow_match_inputs(data.in.img, data.target, data.x0, data.in.timesteps, spec.seed, data.streams);
    model.params().zero_grads();
    if (buckets) buckets->begin_step();
    for (int m = 0; m < spec.micro_batches; ++m) {  // (one batch for every micro-batch: its cost, not its data)
      StepGraph::Region region(graph.get());
      const Tensor pred = model.forward(data.in);
      be.mse_loss_into(loss_buf.t, data.dpred, pred, data.target, 1.0 / spec.micro_batches);
      model.backward(data.dpred, m + 1 == spec.micro_batches ? buckets.get() : nullptr);
      region.end();
    }
    if (buckets) buckets->finish_step();
    if (s + 1 == total) energy_busy = be.power_reading();  // the step still running on the device
    double loss = 0;
    be.download(&loss, loss_buf.t.data, sizeof loss);
    const StepStats st = apply_optimizer_step(model, opt, s + 1, spec.lr);  // as the trainer
    be.synchronize();
    if (opt.offloaded() && s >= spec.warmup) {
      transfer_ms.push_back(1e3 * st.transfer_s);
      update_ms.push_back(1e3 * st.update_s);
      host_update_ms.push_back(1e3 * st.host_update_s);
      r.offload_overlapped = st.overlapped;
    }
    const double ms = 1e3 * seconds_since(ts);
    if (s == 0) {
      r.first_step_s = r.setup_s + ms / 1e3;
      static bool process_first_run = true;
      if (process_first_run) {
        r.launch_to_first_step_s = seconds_since_process_start() - data_s;
        r.launch_to_backend_s = launch_to_backend;
      }
      process_first_run = false;
      r.first_loss = loss;
    }
    r.last_loss = loss;
    r.losses.push_back(loss);
    if (!std::isfinite(loss)) ++r.non_finite_steps;
    if (s >= spec.warmup) r.step_ms.push_back(ms);
    if (buckets) {
      r.gradient_buckets = buckets->buckets().size();
      r.buckets_started_in_backward = buckets->started_in_backward();
    }
    if (profiler && s + 1 == spec.warmup) profiler->reset();  // count the timed steps only
    if (graph && s + 1 == spec.warmup) graph->reset_stats();
  }
  r.energy = summarize_energy(energy_start, be.power_reading(), energy_busy, static_cast<int>(r.step_ms.size()),
                              seconds_since(window_start));
  summarize_run(be, spec, graph.get(), profiler.get(), r);
  if (!transfer_ms.empty()) {
    r.offload_transfer_ms = median(transfer_ms);
    r.offload_update_ms = median(update_ms);
    r.offload_host_update_ms = median(host_update_ms);
  }
  if (spec.data_path) time_data_path(device, spec, r);  // after the memory peak: its buffers are extra
  return r;
}

std::vector<GemmBenchRow> run_gemm_bench(Backend& be, int repeats) {
  // Flux's Linear shapes at H = 3072: the joint sequence of W1 (16384 tokens) and W2 (9216) by
  // (K, N) of qkv, proj, MLP in/out and the single block's fused linear1/linear2; then a double
  // block's streams: the image stream of both (8192 tokens) and W2's text stream (1024).
  const std::vector<std::array<int64_t, 3>> shapes = {
      {16384, 9216, 3072},  {16384, 3072, 3072}, {16384, 12288, 3072}, {16384, 3072, 12288}, {16384, 21504, 3072},
      {16384, 3072, 15360}, {9216, 21504, 3072}, {9216, 3072, 15360},  {8192, 9216, 3072},   {8192, 12288, 3072},
      {8192, 3072, 12288},  {1024, 9216, 3072},  {1024, 3072, 3072},   {1024, 12288, 3072},  {1024, 3072, 12288}};
  std::vector<GemmBenchRow> rows;
  // x and y are activations, stored as the model stores them (bf16 with activation_precision
  // bf16); w is an f32 parameter.
  const DType act = be.activation_dtype(DType::f32);
  const double act_bytes = static_cast<double>(dtype_size(act));
  for (const auto& [m, n, k] : shapes) {
    auto alloc = [&](Shape s, DType t) {
      Tensor x(be.allocate(static_cast<size_t>(s.numel()) * dtype_size(t)), t, s);
      from_host(be, x, randn(7, static_cast<uint64_t>(s.numel()), s.numel(), 1.0));
      return x;
    };
    const Tensor x = alloc(Shape{m, k}, act), w = alloc(Shape{n, k}, DType::f32);
    Tensor y(be.allocate(static_cast<size_t>(m * n) * dtype_size(act)), act, Shape{m, n});
    auto qt = [&](int64_t r, int64_t c) {
      QTensor q;
      q.rows = r, q.cols = c;
      q.codes = static_cast<uint8_t*>(be.allocate(static_cast<size_t>(r * c)));
      q.scale_inv = static_cast<float*>(be.allocate(4));
      return q;
    };
    QTensor xq = qt(m, k), wq = qt(n, k), xt = qt(k, m);
    Backend::Quantize q;  // tensorwise: scale from this tensor's amax
    // The cast alone as the delayed recipe runs it: the scale already in device memory, both
    // copies (rowwise and transposed), statistics on; then with the bias-gradient column sums
    // of an output-gradient cast.
    const float one = 1.0f;
    auto* scale = static_cast<float*>(be.allocate(4));
    be.upload(scale, &one, 4);
    Tensor sums(be.allocate(static_cast<size_t>(k) * 4), DType::f32, Shape{k});
    const Tensor bias = alloc(Shape{n}, DType::f32);
    CastStats cast_stats;
    Backend::Quantize delayed;
    delayed.delayed_scale = scale;
    delayed.stats = &cast_stats;
    auto time_ms = [&](auto&& f) { return median_ms_per_call(be, repeats, 10, f); };
    GemmBenchRow row{m, n, k, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    row.fp8_linear_ms = time_ms([&] {
      be.quantize(xq, QTensor{}, x, q);
      be.quantize(wq, QTensor{}, w, q);
      be.gemm_fp8_tn(y, xq, wq, Tensor{}, false, Fp8Accumulation::fp32);
    });
    row.fp8_gemm_ms = time_ms([&] { be.gemm_fp8_tn(y, xq, wq, Tensor{}, false, Fp8Accumulation::fp32); });
    row.fp8_gemm_fast_ms = time_ms([&] { be.gemm_fp8_tn(y, xq, wq, Tensor{}, false, Fp8Accumulation::fast); });
    row.fp8_gemm_fast_bias_ms = time_ms([&] { be.gemm_fp8_tn(y, xq, wq, bias, false, Fp8Accumulation::fast); });
    row.linear_ms = time_ms([&] { be.linear(y, x, w, Tensor{}); });
    row.cast_ms = time_ms([&] { be.quantize(xq, xt, x, delayed); });
    Backend::Quantize with_sums = delayed;
    with_sums.column_sums = sums;
    row.cast_sums_ms = time_ms([&] { be.quantize(xq, xt, x, with_sums); });
    // bytes moved by the cast: the activation in, two 1-byte copies out
    row.cast_gbps = (act_bytes + 2.0) * static_cast<double>(m) * static_cast<double>(k) / (row.cast_ms / 1e3) / 1e9;
    const double tflop = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) / 1e12;
    row.fp8_linear_tflops = tflop / (row.fp8_linear_ms / 1e3);
    row.fp8_gemm_tflops = tflop / (row.fp8_gemm_ms / 1e3);
    row.linear_tflops = tflop / (row.linear_ms / 1e3);
    rows.push_back(row);
    for (void* p : {x.data, w.data, y.data, static_cast<void*>(xq.codes), static_cast<void*>(xq.scale_inv),
                    static_cast<void*>(wq.codes), static_cast<void*>(wq.scale_inv), static_cast<void*>(xt.codes),
                    static_cast<void*>(xt.scale_inv), static_cast<void*>(scale), sums.data, bias.data})
      be.release(p);
  }
  return rows;
}

std::vector<AttentionBenchRow> run_attention_bench(Backend& be, int repeats) {
  struct Case {
    const char* workload;
    int64_t B, n, L, D;
  };
  const Case cases[] = {{"W1", 32, 24, 512, 128}, {"W2", 2, 24, 4608, 128}};
  std::vector<AttentionBenchRow> rows;
  std::vector<void*> owned;
  auto bytes = [&](size_t n) {
    owned.push_back(be.allocate(n));
    return owned.back();
  };
  auto scalar = [&](float v) {
    auto* p = static_cast<float*>(bytes(4));
    be.upload(p, &v, 4);
    return p;
  };
  for (const Case& c : cases) {
    const Shape heads{c.B, c.n, c.L, c.D};
    const DType ht = be.attention_heads_dtype(be.activation_dtype(DType::f32), c.D);
    auto tensor = [&](DType t, Shape s, uint64_t seed) {
      Tensor x(bytes(static_cast<size_t>(s.numel()) * dtype_size(t)), t, s);
      if (seed) from_host(be, x, randn(seed, 0, s.numel(), 1.0));
      return x;
    };
    Tensor q = tensor(ht, heads, 11), k = tensor(ht, heads, 12), v = tensor(ht, heads, 13), d_o = tensor(ht, heads, 14);
    Tensor o = tensor(ht, heads, 0), dq = tensor(ht, heads, 0), dk = tensor(ht, heads, 0), dv = tensor(ht, heads, 0);
    Tensor lse = tensor(DType::f32, Shape{c.B * c.n * c.L}, 0);
    auto qt = [&](Fp8Format f) {
      QTensor t;
      t.rows = c.B * c.n * c.L, t.cols = c.D, t.format = f;
      t.codes = static_cast<uint8_t*>(bytes(static_cast<size_t>(t.numel())));
      t.scale_inv = static_cast<float*>(bytes(4));
      return t;
    };
    const Fp8Format e4 = Fp8Format::e4m3, e5 = Fp8Format::e5m2;
    QTensor q8 = qt(e4), k8 = qt(e4), v8 = qt(e4), o8 = qt(e4), do8 = qt(e5), dq8 = qt(e5), dk8 = qt(e5), dv8 = qt(e5);
    // Scales as a delayed recipe would hold them after a few steps: P ≤ 1, dS small.
    Backend::Fp8AttentionScales sc;
    sc.o = scalar(128.0f);
    sc.ds = scalar(4096.0f), sc.ds_inv = scalar(1.0f / 4096.0f);
    sc.dq = scalar(1024.0f), sc.dk = scalar(1024.0f), sc.dv = scalar(1024.0f);
    float* amax = static_cast<float*>(bytes(6 * 4));
    sc.amax_s = amax, sc.amax_o = amax + 1, sc.amax_ds = amax + 2, sc.amax_dq = amax + 3, sc.amax_dk = amax + 4,
    sc.amax_dv = amax + 5;
    Backend::Quantize e4_cast, e5_cast;  // current scaling
    e5_cast.format = e5;
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.D));
    auto time_ms = [&](auto&& f) { return median_ms(be, repeats, f); };
    AttentionBenchRow r{c.workload, c.B, c.n, c.L, c.D, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    r.bf16_fwd_ms = time_ms([&] { be.attention(o, lse, q, k, v, scale); });
    r.bf16_bwd_ms = time_ms([&] { be.attention_backward(dq, dk, dv, d_o, q, k, v, o, lse, scale); });
    be.quantize(q8, QTensor{}, q, e4_cast);
    be.quantize(k8, QTensor{}, k, e4_cast);
    be.quantize(v8, QTensor{}, v, e4_cast);
    be.quantize(do8, QTensor{}, d_o, e5_cast);
    r.fp8_fwd_ms = time_ms([&] { be.attention_fp8(o8, lse, q8, k8, v8, heads, scale, sc); });
    r.fp8_bwd_ms =
        time_ms([&] { be.attention_fp8_backward(dq8, dk8, dv8, do8, q8, k8, v8, o8, lse, heads, scale, sc); });
    r.fp8_fwd_casts_ms = time_ms([&] {
      be.quantize(q8, QTensor{}, q, e4_cast);
      be.quantize(k8, QTensor{}, k, e4_cast);
      be.quantize(v8, QTensor{}, v, e4_cast);
      be.dequantize(o, o8);
    });
    r.fp8_bwd_casts_ms = time_ms([&] {
      be.quantize(do8, QTensor{}, d_o, e5_cast);
      be.dequantize(dq, dq8);
      be.dequantize(dk, dk8);
      be.dequantize(dv, dv8);
    });
    const double fwd_tflop = 4.0 * double(c.B * c.n) * double(c.L) * double(c.L) * double(c.D) / 1e12;
    r.bf16_fwd_tflops = fwd_tflop / (r.bf16_fwd_ms / 1e3);
    r.bf16_bwd_tflops = 2.5 * fwd_tflop / (r.bf16_bwd_ms / 1e3);
    r.fp8_fwd_tflops = fwd_tflop / (r.fp8_fwd_ms / 1e3);
    r.fp8_bwd_tflops = 2.5 * fwd_tflop / (r.fp8_bwd_ms / 1e3);
    rows.push_back(r);
    be.synchronize();
    for (void* p : owned) be.release(p);
    owned.clear();
  }
  return rows;
}

std::vector<EpilogueBenchRow> run_epilogue_bench(Backend& be, int repeats) {
  // The MLP of H = 3072 (width 12288) over W1's 16384 and W2's 9216 tokens.
  const std::vector<std::array<int64_t, 3>> shapes = {{16384, 12288, 3072}, {9216, 12288, 3072}};
  std::vector<EpilogueBenchRow> rows;
  const DType act = be.activation_dtype(DType::f32), wt = be.weight_operand_dtype(DType::f32);
  for (const auto& [m, n, k] : shapes) {
    std::vector<void*> owned;
    auto alloc = [&](Shape s, DType t, uint64_t stream) {
      Tensor x(be.allocate(static_cast<size_t>(s.numel()) * dtype_size(t)), t, s);
      from_host(be, x, randn(11, stream, s.numel(), t == DType::f32 ? 0.02 : 1.0));
      owned.push_back(x.data);
      return x;
    };
    // Forward: x [m, k] -> h, g [m, n] (w_in [n, k], b [n]); backward: dy [m, k] through
    // w_out [k, n] -> dh [m, n]; the weight gradient of w_in from dh and x.
    const Tensor x = alloc(Shape{m, k}, act, 1), w_in = alloc(Shape{n, k}, wt, 2), b = alloc(Shape{n}, DType::f32, 3);
    const Tensor h = alloc(Shape{m, n}, act, 4), g = alloc(Shape{m, n}, act, 5), dy = alloc(Shape{m, k}, act, 6);
    const Tensor w_out = alloc(Shape{k, n}, wt, 7), dh = alloc(Shape{m, n}, act, 8);
    const Tensor dw = alloc(Shape{n, k}, DType::f32, 9), db = alloc(Shape{n}, DType::f32, 10);
    auto time_ms = [&](auto&& f) { return median_ms(be, repeats, f); };
    EpilogueBenchRow r{m, n, k, 0, 0, 0, 0, 0, 0, 0, 0};
    r.linear_gelu_unfused_ms = time_ms([&] {
      be.linear(h, x, w_in, b);
      be.gelu_tanh(g, h);
    });
    r.linear_gelu_ms = time_ms([&] { be.linear_gelu(g, h, x, w_in, b); });
    r.dgrad_gelu_unfused_ms = time_ms([&] {
      be.linear_backward(dh, Tensor{}, Tensor{}, dy, Tensor{}, w_out, false, false);
      be.gelu_tanh_backward(dh, dh, h);
    });
    r.dgrad_gelu_ms = time_ms([&] { be.linear_dgrad_gelu(Tensor{}, dh, dy, w_out, h); });
    r.wgrad_ms = time_ms([&] { be.linear_backward(Tensor{}, dw, Tensor{}, dh, x, w_in, false, false); });
    r.wgrad_bias_ms = time_ms([&] { be.linear_backward(Tensor{}, dw, db, dh, x, w_in, false, false); });
    r.wgrad_acc_ms = time_ms([&] { be.linear_backward(Tensor{}, dw, Tensor{}, dh, x, w_in, false, true); });
    r.wgrad_acc_bias_ms = time_ms([&] { be.linear_backward(Tensor{}, dw, db, dh, x, w_in, false, true); });
    rows.push_back(r);
    for (void* p : owned) be.release(p);
  }
  return rows;
}

std::vector<SmallLinearBenchRow> run_small_linear_bench(Backend& be, int repeats) {
  struct Shape3 {
    const char* name;
    int64_t rows, out, in;
  };
  std::vector<Shape3> shapes;
  for (const int64_t rows : {int64_t{32}, int64_t{2}})  // W1's samples, W2's
    for (const Shape3& s :
         {Shape3{"double block modulation", 0, 18432, 3072}, Shape3{"single block modulation", 0, 9216, 3072},
          Shape3{"final adaLN", 0, 6144, 3072}, Shape3{"time_in / guidance_in first", 0, 3072, 256},
          Shape3{"vector_in first", 0, 3072, 768}, Shape3{"embedder MLP second", 0, 3072, 3072}})
      shapes.push_back({s.name, rows, s.out, s.in});
  shapes.push_back({"img_in", 8192, 3072, 64});
  shapes.push_back({"final linear", 8192, 64, 3072});
  shapes.push_back({"txt_in (W1)", 8192, 3072, 4096});
  shapes.push_back({"txt_in (W2)", 1024, 3072, 4096});
  const DType act = be.activation_dtype(DType::f32), wt = be.weight_operand_dtype(DType::f32);
  std::vector<SmallLinearBenchRow> rows;
  for (const Shape3& s : shapes) {
    std::vector<void*> owned;
    auto alloc = [&](Shape sh, DType t, uint64_t stream) {
      Tensor x(be.allocate(static_cast<size_t>(sh.numel()) * dtype_size(t)), t, sh);
      from_host(be, x, randn(13, stream, sh.numel(), t == act ? 1.0 : 0.02));
      owned.push_back(x.data);
      return x;
    };
    const Tensor x = alloc(Shape{s.rows, s.in}, act, 1), w = alloc(Shape{s.out, s.in}, wt, 2);
    const Tensor b = alloc(Shape{s.out}, DType::f32, 3), y = alloc(Shape{s.rows, s.out}, act, 4);
    const Tensor dy = alloc(Shape{s.rows, s.out}, act, 5), dx = alloc(Shape{s.rows, s.in}, act, 6);
    const Tensor dw = alloc(Shape{s.out, s.in}, DType::f32, 7), db = alloc(Shape{s.out}, DType::f32, 8);
    constexpr int kBatch = 20;
    auto time_ms = [&](auto&& f) { return median_ms_per_call(be, repeats, kBatch, f); };
    // The host's share: the batch's calls issued, timed before the synchronisation that waits for them.
    auto host_us = [&](auto&& f) {
      std::vector<double> t;
      for (int i = 0; i < repeats; ++i) {
        be.synchronize();
        const auto t0 = Clock::now();
        for (int j = 0; j < kBatch; ++j) f();
        t.push_back(1e6 * seconds_since(t0) / kBatch);
      }
      be.synchronize();
      return median(t);
    };
    const auto forward = [&] { be.linear(y, x, w, b); };
    const auto dgrad = [&] { be.linear_backward(dx, Tensor{}, Tensor{}, dy, Tensor{}, w, false, false); };
    SmallLinearBenchRow r{s.name, s.rows, s.out, s.in, 0, 0, 0, 0, 0, 0};
    r.fwd_ms = time_ms(forward);
    r.dgrad_ms = time_ms(dgrad);
    r.wgrad_ms = time_ms([&] { be.linear_backward(Tensor{}, dw, db, dy, x, w, false, false); });
    r.fwd_weight_gbps = static_cast<double>(w.bytes()) / (r.fwd_ms * 1e6);
    r.fwd_host_us = host_us(forward);
    r.dgrad_host_us = host_us(dgrad);
    rows.push_back(r);
    for (void* p : owned) be.release(p);
  }
  return rows;
}

}  // namespace flux8

#include "train/trainer.h"

#include <fmt/core.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>

#include "backend/backend.h"
#include "backend/energy.h"
#include "backend/step_graph.h"
#include "backend/transfer.h"
#include "config/config.h"
#include "core/error.h"
#include "core/process_clock.h"
#include "core/sha256.h"
#include "data/loader.h"
#include "dist/mpi_runtime.h"
#include "dist/process_groups.h"
#include "dist/watchdog.h"
#include "model/flux_model.h"
#include "model/weights_io.h"
#include "train/async_checkpoint.h"
#include "train/batch_pipeline.h"
#include "train/checkpoint.h"
#include "train/checkpoint_shards.h"
#include "train/data_parallel.h"
#include "train/fp8_report.h"
#include "train/gradient_buckets.h"
#include "train/mlperf_log.h"
#include "train/objective.h"
#include "train/optimizer.h"
#include "train/progress.h"
#include "train/run_data.h"
#include "train/run_samples.h"
#include "train/signals.h"
#include "train/tensorboard_log.h"
#include "train/train_config.h"
#include "train/train_step.h"

namespace flux8 {

namespace fs = std::filesystem;

namespace {

// The device's energy over the steps since the last logged one (backend/energy.h): read on
// logged steps only, and read again after validation and checkpoints, which it leaves out.
struct EnergyWindow {
  PowerReading start;
  std::chrono::steady_clock::time_point t;
  int steps = 0;
};

// What a resume restored, for the log.
struct Resume {
  std::string from;  // the checkpoint, "" when the run starts fresh
  std::string fp8_note;
  std::vector<std::string> changed;  // settings other than the checkpoint's run (changed_settings)
  double verify_seconds = 0, load_seconds = 0;
};

// One run's state, shared by its parts. Members are destroyed in reverse order: the pipeline
// and the saver before the buffers, the loader and the model, the graph before the backend.
struct Run {
  TrainConfig cfg;
  // mlperf_logging on rank 0; kept to the last, so that a run ending in an error logs run_stop
  // aborted.
  std::unique_ptr<MlperfLog> mlperf;
  std::unique_ptr<Backend> be;
  // optimizer_offload: cpu — the host memory holding the f32 master weights and the moments.
  std::unique_ptr<Backend> host_memory;
  // The job's ranks (one-rank groups for a process started alone) and the data-parallel
  // reductions over them; `world` reduces what every rank must agree on (FP8 amaxes, the stop).
  std::unique_ptr<ProcessGroups> groups;
  std::unique_ptr<DataParallel> dp, tp, world;
  // cuda_graph: the graph recorder intercepting `be`'s ops.
  std::unique_ptr<StepGraph> graph;
  std::unique_ptr<FluxModel> model;
  std::unique_ptr<AdamWOptimizer> opt;
  // Data parallelism: the gradients' reduction, bucket by bucket (overlap_grad_reduce); null on
  // one data-parallel rank.
  std::unique_ptr<GradientBuckets> buckets;
  TrainerState state;
  EmptyPrompt empty;
  std::vector<Sample> val;
  Resume resume;
  std::unique_ptr<DataLoader> loader;
  std::unique_ptr<Progress> progress;
  std::unique_ptr<StepBuffers> buf;
  // Checkpoints written behind training where the host copy fits (async_save), else null.
  std::unique_ptr<AsyncCheckpointer> saver;
  std::unique_ptr<BatchPipeline> pipeline;
  std::unique_ptr<RunSamples> samples;  // rank 0's previews and end-of-run grid
  EnergyWindow energy;
  int64_t start_step = 0;
  int consecutive_skips = 0;
  bool fp8_ranks_checked = false;  // check_fp8_ranks_agree has said so once
  TrainResult result;
  int64_t resume_step() const { return resume.from.empty() ? -1 : start_step; }
};

// ---- setup ----------------------------------------------------------------------------------

// Config and data first: a bad key or path fails before the device and the model are set up.
// What fails here is a config error, then a data error (the exit status says which).
void prepare_config_and_data(Run& r, const TrainOptions& opt) {
  r.cfg = with_error_kind(ErrorKind::config,
                          [&] { return TrainConfig::from_config(Config::load(opt.config_path, opt.overrides)); });
  fs::create_directories(r.cfg.save_dir);
  if (r.cfg.mlperf.on && job_placement().rank == 0) {
    r.mlperf = std::make_unique<MlperfLog>((fs::path(r.cfg.save_dir) / "mlperf.log").string());
    r.mlperf->init_start(r.cfg, opt.config_path);
  }
  // One rank writes the demo dataset; the others read it once it is there.
  with_error_kind(ErrorKind::data, [&] {
    if (job_placement().rank == 0) prepare_demo_data(r.cfg);
  });
  job_barrier();
  with_error_kind(ErrorKind::data, [&] {
    r.empty = load_empty_prompt(r.cfg);
    r.val = load_validation_set(r.cfg);
  });
}

// Rank 0 speaks for the job: it alone prints, writes metrics.jsonl and checkpoints.
bool lead_rank(const Run& r) { return !r.groups || r.groups->world_rank() == 0; }

// The rank's device (its index among the job's ranks on its node), the process groups, and the
// checks that every rank runs the same config.
void join_job(Run& r) {
  const JobPlacement& job = job_placement();
  BackendOptions options = r.cfg.backend_options;
  place_on_node(options);
  r.be = make_backend(r.cfg.backend, options);
  if (job.launched) collective_watchdog().set_timeout(collective_timeout(r.cfg.distributed_timeout_s / 60.0));
  const ParallelSizes sizes{r.cfg.tensor_parallel, r.cfg.pipeline_parallel, r.cfg.context_parallel};
  r.groups = std::make_unique<ProcessGroups>(job.launched ? job_world() : MPI_COMM_NULL, sizes, *r.be);
  r.dp = std::make_unique<DataParallel>(r.groups->dp(), *r.be);
  r.tp = std::make_unique<DataParallel>(r.groups->tp(), *r.be);
  r.world = std::make_unique<DataParallel>(r.groups->world(), *r.be);
  if (!r.groups->distributed()) return;
  // The resolved config's hash against rank 0's: ranks that read different files (or got other
  // --set values) would train different models and deadlock on the first mismatched collective.
  const std::string digest = sha256_hex(r.cfg.config_yaml).substr(0, 12);
  const std::vector<int> apart = r.world->ranks_differing_from_lead(digest);
  if (std::find(apart.begin(), apart.end(), r.groups->world_rank()) != apart.end())
    fail(
        "the resolved config differs between ranks (hash {} here; rank 0 has another): every rank must read the same "
        "config files with the same --set values (`flux8 config -c FILE` prints the resolved config)",
        digest);
}

bool overlaps_grad_reduce(const Run& r) { return r.cfg.overlap_grad_reduce && r.dp->size() > 1; }

// The data-parallel gradient reduction in buckets, started during the last micro-batch's backward
// or after it; the optimizer then reduces nothing itself. The distributed optimizer's buckets go
// to the ranks that own them, on its sharding of the flat buffer.
void add_gradient_buckets(Run& r) {
  if (r.dp->size() == 1) return;
  std::optional<FlatSharding> sharding;
  if (r.opt->sharded()) {
    sharding = FlatSharding::of(r.model->params().layout().total(), r.dp->size());
    const FlatRange own = sharding->owned(r.dp->rank()), updated = r.opt->owned();
    FLUX8_CHECK(own.begin == updated.begin && own.count == updated.count,
                "gradient buckets: this rank owns [{}, {}) of the buffer, the optimizer updates [{}, {})", own.begin,
                own.end(), updated.begin, updated.end());
  }
  r.buckets = std::make_unique<GradientBuckets>(r.model->params(), *r.dp, sharding, overlaps_grad_reduce(r));
  r.opt->set_gradients_reduced_by_caller(true);
}

void build_model(Run& r) {
  join_job(r);
  // cuda_graph: each micro-batch's forward and backward recorded and launched as CUDA graphs
  // (backend/step_graph.h); a backend without graphs runs op by op, as it says at the start.
  // A graph cannot hold the tensor-parallel collectives inside the blocks, nor the uploads of
  // offloaded master weights for FP8 casts, nor the gathers of sharded ones: op by op there.
  // overlap_grad_reduce starts the data-parallel collectives inside the last micro-batch's backward.
  // The distributed optimizer: each data-parallel rank holds the f32 masters of its shard only
  // (ParamStore MasterShards); the update gathers them over the group to write every device form,
  // the FP8 weights' casts included.
  MasterShards shards =
      AdamWOptimizer::master_shards(r.dp.get(), r.cfg.distributed_optimizer,
                                    ParamLayout::build(r.cfg.model, r.groups->tp_rank(), r.groups->tp_size()).total());
  if (r.cfg.cuda_graph && r.be->can_capture() && r.groups->tp_size() == 1 && !r.cfg.offload_masters && !shards.group &&
      !overlaps_grad_reduce(r))
    r.graph = std::make_unique<StepGraph>(*r.be, StepGraph::Options::from_environment());
  if (r.cfg.offload_masters) r.host_memory = make_backend("cpu");
  r.model = std::make_unique<FluxModel>(r.cfg.model, *r.be, DType::f32, &r.cfg.fp8, r.cfg.recompute,
                                        TensorParallel{&r.groups->tp()}, r.host_memory.get(), std::move(shards));
  r.opt = std::make_unique<AdamWOptimizer>(r.model->params(), r.cfg.adam);
  r.opt->set_data_parallel(r.dp.get(), r.cfg.distributed_optimizer);
  r.opt->set_tensor_parallel(r.tp.get());
  // A step's samples are the rows every per-sample Linear sees: few enough, and their gradients
  // stay as factors (ParamStore::keep_low_rank_grads) — on one data-parallel rank, where the
  // gradient buffer need not be reduced.
  r.model->params().keep_low_rank_grads(r.dp->size() > 1 ? 0 : r.cfg.global_batch);
  add_gradient_buckets(r);
  // FP8: every rank's amaxes max-reduced before the delayed-scaling update, so every rank holds
  // the scales one process would.
  if (r.model->fp8() && r.groups->distributed())
    r.model->fp8()->registry().set_allreduce_hook([&world = *r.world](float* row, int n) {
      std::vector<double> v(row, row + n);
      world.max(v);
      for (int i = 0; i < n; ++i) row[i] = static_cast<float>(v[static_cast<size_t>(i)]);
    });
  r.state.seed = r.cfg.seed;
  r.state.config_yaml = r.cfg.config_yaml;
}

// The settings of this run that differ from those of the run that wrote the checkpoint (its
// resolved config): a resume may change any of them, and a default that moved between versions
// changes one unasked. A config this version cannot read (a key it lacks) is said so instead.
std::vector<std::string> changed_settings(const std::string& checkpoint_yaml, const std::string& run_yaml,
                                          const std::string& dir) {
  if (checkpoint_yaml.empty()) return {};
  try {
    return changed_keys(Config::load_text(checkpoint_yaml, dir + "/trainer_state.json:config_yaml"),
                        Config::load_text(run_yaml, "this run's config"));
  } catch (const Error& e) {
    return {fmt::format("(not compared: {})", e.what())};
  }
}

// --resume: the newest checkpoint that verifies (--resume PATH: that one), if any; otherwise
// fresh weights (or --init-from's). Checkpoints of which none verifies stop the run here, before metrics.jsonl or
// any checkpoint is touched.
void restore_or_init(Run& r, const TrainOptions& opt) {
  if (opt.resume) {
    const auto t0 = std::chrono::steady_clock::now();
    std::optional<std::string> dir = opt.resume_from.empty() ? checkpoint_to_resume(r.cfg.save_dir)
                                                             : std::optional(chosen_checkpoint(opt.resume_from));
    if (dir) {  // every file's digest verified
      r.resume.verify_seconds = seconds_since(t0);
      const auto t1 = std::chrono::steady_clock::now();
      Fp8MetaRegistry* registry = r.model->fp8() ? &r.model->fp8()->registry() : nullptr;
      // Each rank reads the moments of its range (a distributed optimizer's shard) and the master
      // weights it holds.
      load_checkpoint(*dir, r.state, r.cfg.model, r.model->params(), r.opt->exp_avg(), r.opt->exp_avg_sq(), registry,
                      &r.resume.fp8_note, CheckpointVerify::sizes,  // its digests were just verified
                      &r.opt->moments_backend(), r.opt->owned());
      r.resume.changed = changed_settings(r.state.config_yaml, r.cfg.config_yaml, *dir);
      r.state.config_yaml = r.cfg.config_yaml;  // the config of this run goes into its checkpoints
      r.resume.from = *dir;
      r.resume.load_seconds = seconds_since(t1);
    } else if (lead_rank(r)) {
      fmt::print("--resume: no checkpoint in {}; starting from step 0\n", r.cfg.save_dir);
    }
  }
  if (r.resume.from.empty()) {
    r.model->params().init(r.state.seed);
    if (!opt.init_from.empty()) load_weights(r.model->params(), r.cfg.model, resolve_weights_path(opt.init_from));
  } else if (!opt.init_from.empty()) {
    fmt::print("note: --init-from {} ignored: resuming from {}\n", opt.init_from, r.resume.from);
  }
}

void open_loader(Run& r) {
  LoaderOptions lo;
  lo.source = r.cfg.train_data;
  lo.seed = r.state.seed;
  lo.shuffle_buffer = r.cfg.data_shuffle_buffer;
  lo.prefetch = r.cfg.data_prefetch;
  lo.skip_corrupt = r.cfg.data_skip_corrupt;
  lo.check = [&model = r.cfg.model](const Sample& s) { check_sample_fits(s, model); };
  r.loader = with_error_kind(ErrorKind::data, [&] {
    return std::make_unique<DataLoader>(
        lo, LoaderState{static_cast<uint64_t>(r.state.data_epoch), static_cast<uint64_t>(r.state.data_position)});
  });
}

void open_metrics(Run& r) {
  r.start_step = r.state.step;
  const bool lead = lead_rank(r);
  r.progress = std::make_unique<Progress>(lead ? (fs::path(r.cfg.save_dir) / "metrics.jsonl").string() : "",
                                          r.resume_step(), r.start_step, r.cfg.train_iters, lead);
  r.progress->set_device(r.be.get());
  if (lead && !r.cfg.tensorboard_dir.empty())
    r.progress->set_tensorboard(
        std::make_unique<TensorBoardLog>(r.cfg.tensorboard_dir, r.cfg.log_timers_to_tensorboard, r.resume_step()));
  r.buf = std::make_unique<StepBuffers>(*r.be, DType::f32);
}

// ---- logging --------------------------------------------------------------------------------

void note(Run& r, const std::string& line) { r.progress->note(line); }

// "gradients: summed over the data-parallel group in 711 buckets of up to 16.8M elements, each
// all-reduced, started during the last micro-batch's backward as each bucket's gradients are final
// (overlap_grad_reduce); 711 collectives a step"
std::string gradient_reduction_line(const Run& r) {
  const GradientBuckets& b = *r.buckets;
  const size_t n = b.buckets().size(), collectives = b.collectives_per_step();
  return fmt::format(
      "gradients: summed over the data-parallel group in {} bucket{} of up to {:.1f}M elements, {}, {}; {} "
      "collective{} a step",
      n, n == 1 ? "" : "s", static_cast<double>(DataParallel::kBucketElements) / 1e6,
      r.opt->sharded() ? "each reduced to the ranks whose shards it meets (use_distributed_optimizer)"
                       : "each all-reduced",
      overlaps_grad_reduce(r) ? "started during the last micro-batch's backward as each bucket's gradients are final "
                                "(overlap_grad_reduce)"
                              : "started after the last micro-batch's backward (overlap_grad_reduce: false)",
      collectives, collectives == 1 ? "" : "s");
}

// What the run is and how it computes, at its start.
void announce_run(Run& r) {
  const ParamStore& params = r.model->params();
  note(r, fmt::format("flux8 train: model {} ({:.2f}M parameters), {} backend, batch {} = {} x {} micro, "
                      "{} steps, {} validation samples, saving to {}",
                      r.cfg.model.name, static_cast<double>(params.layout().total()) / 1e6, r.be->name(),
                      r.cfg.global_batch, r.cfg.accumulation, r.cfg.micro_batch, r.cfg.train_iters, r.val.size(),
                      r.cfg.save_dir));
  note(r, fmt::format("precision: {}", r.cfg.fp8.describe()));
  for (const std::string& w : r.cfg.warnings) note(r, "warning: " + w);
  if (const RecomputePolicy& rc = r.cfg.recompute; rc.blocks < r.cfg.model.num_blocks())
    note(r, fmt::format("recompute: {} in the first {} of {} blocks (recompute_method block)",
                        rc.granularity == Recompute::full ? "full" : "selective", rc.blocks, r.cfg.model.num_blocks()));
  if (r.groups->distributed())
    note(r, fmt::format("parallel: {}: {} samples a rank a step{}; gradients over {}", r.groups->describe(),
                        r.cfg.global_batch / r.dp->size(),
                        r.opt->sharded() ? ", AdamW moments sharded over the data-parallel ranks "
                                           "(use_distributed_optimizer)"
                                         : "",
                        r.groups->dp().describe()));
  if (r.buckets) note(r, gradient_reduction_line(r));
  if (r.cfg.overlap_param_gather && r.opt->sharded())
    note(r,
         "overlap_param_gather: accepted, but the updated weights are all-gathered right after the update, before "
         "the next forward (no overlap with compute)");
  if (params.grad_dtype() != params.dtype())
    note(r, fmt::format("gradients: stored in {} (grad_precision); master weights in {}",
                        dtype_name(params.grad_dtype()), dtype_name(params.dtype())));
  if (params.masters_offloaded())
    note(r,
         fmt::format("optimizer_offload: the f32 master weights ({:.2f} GB) and the AdamW moments ({:.2f} GB) live in "
                     "host memory and {}; the device keeps the weights only as the model reads them (bf16 copies, "
                     "FP8 casts, small f32 tensors); CUDA graphs off",
                     static_cast<double>(params.layout().total()) * dtype_size(params.dtype()) / 1e9,
                     2.0 * static_cast<double>(r.opt->owned().count) * dtype_size(r.opt->moment_dtype()) / 1e9,
                     r.cfg.adam.host_update ? "are updated there by the host's cores, the gradients coming down and "
                                              "the new weights going up (optimizer_offload_update: host)"
                                            : "stream through the device for each update"));
  else if (r.opt->offloaded())
    note(r, fmt::format("optimizer_offload: the AdamW moments ({:.2f} GB) live in host memory and stream through the "
                        "device for each update",
                        2.0 * static_cast<double>(r.opt->owned().count) * dtype_size(r.opt->moment_dtype()) / 1e9));
  if (r.opt->moment_dtype() != params.dtype())
    note(r, fmt::format("AdamW moments: stored in {} (adam_moment_precision), rounded stochastically; computed in {}",
                        dtype_name(r.opt->moment_dtype()), dtype_name(params.dtype())));
  // (On, the default, a backend without graphs runs op by op without a word; set, it says so.)
  if (r.graph)
    note(r,
         "cuda_graph: each micro-batch's forward and backward run as CUDA graphs, captured from the first "
         "steps (segments of " +
             std::to_string(r.graph->graph_options().segment_ops) + " ops)");
  else if (r.cfg.cuda_graph && r.be->can_capture() && r.groups->tp_size() > 1)
    note(r, "cuda_graph: off under tensor parallelism (a graph cannot hold the collectives inside the blocks)");
  else if (r.cfg.cuda_graph && r.be->can_capture() && overlaps_grad_reduce(r))
    note(r,
         "cuda_graph: off with overlap_grad_reduce (a graph cannot hold the gradient buckets' collectives started "
         "inside the backward); set overlap_grad_reduce: false to keep the graphs");
  else if (r.cfg.cuda_graph && r.cfg.cuda_graph_set)
    note(r, "cuda_graph: the " + r.be->name() + " backend has no graphs; running op by op");
  if (!r.be->repeats_bit_for_bit())
    note(r, "attention: the " + r.be->name() +
                " backend's faster backward (deterministic_attention: false, or FLUX8_ATTENTION_DETERMINISTIC=0): "
                "its dq sums with atomics in a varying order, so runs and resumes no longer repeat bit for bit");
  if (const int64_t rows = params.low_rank_rows())
    note(r, fmt::format("gradients: the modulation and embedder Linears' weight gradients kept as rank-{} factors "
                        "(a step of at most {} samples; not written as tensors)",
                        rows, ParamStore::kLowRankMaxRows));
  if (!r.resume.from.empty()) {
    const Resume& res = r.resume;
    r.progress->event(fmt::format("resumed from {} at step {} (last loss {:.4f}; verified in {:.1f} s, loaded in "
                                  "{:.1f} s)",
                                  res.from, r.state.step, r.state.last_loss, res.verify_seconds, res.load_seconds),
                      RecordKind::run,
                      {{"event", "resume"},
                       {"step", r.state.step},
                       {"checkpoint", res.from},
                       {"verify_seconds", res.verify_seconds},
                       {"load_seconds", res.load_seconds},
                       {"changed_settings", res.changed}});
    if (!res.changed.empty())
      note(r, fmt::format("resumed with settings other than the checkpoint's run: {}", fmt::join(res.changed, "; ")));
    if (!res.fp8_note.empty()) note(r, res.fp8_note);
  }
}

// The first parameter whose gradient has a non-finite value (for the skip message).
std::string first_nonfinite_gradient(ParamStore& store) {
  store.materialize_low_rank_grads();  // grad() reads the flat buffer
  for (const ParamInfo& p : store.layout().params()) {
    const double s = store.backend().sum_squares(store.grad(p.name));
    if (!std::isfinite(s)) return p.name;
  }
  return "(none: the loss itself was non-finite)";
}

// NanGradientFault (tests): a NaN in the named parameter's gradient on the listed steps. The
// low-rank factors are written out first, so that the parameter's gradient is the flat one.
void inject_nan_gradient(Run& r, const NanGradientFault& fault, int64_t step) {
  if (std::find(fault.steps.begin(), fault.steps.end(), step + 1) == fault.steps.end()) return;
  ParamStore& store = r.model->params();
  store.materialize_low_rank_grads();
  const Tensor g = store.grad(fault.param);
  std::vector<double> values = to_host(*r.be, g);
  values.at(0) = std::numeric_limits<double>::quiet_NaN();
  from_host(*r.be, g, values);
}

// A step the optimizer skipped for a non-finite loss or gradient: logged, and the run stops
// under nan_policy halt or after too many in a row.
void handle_skipped_step(Run& r, int64_t step, double loss) {
  ++r.state.skipped_steps;
  const std::string first = first_nonfinite_gradient(r.model->params());
  const char* what = std::isfinite(loss) ? "gradient" : "loss";
  r.progress->event(fmt::format("step {}: non-finite {} (first non-finite gradient: {}); step skipped, weights kept",
                                step + 1, what, first),
                    RecordKind::run, {{"event", "skipped_step"}, {"step", step + 1}, {"first_nonfinite", first}});
  if (r.cfg.nan_policy == TrainConfig::NanPolicy::halt)
    fail(ErrorKind::nonfinite,
         "step {}: non-finite {} (first non-finite gradient: {}) and nan_policy is halt; the last checkpoint "
         "is intact",
         step + 1, what, first);
  if (++r.consecutive_skips >= r.cfg.nan_max_consecutive_skips)
    fail(ErrorKind::nonfinite,
         "{} consecutive steps had a non-finite loss or gradient (last at step {}); stopping. Lower lr "
         "or check the data; the last checkpoint is intact.",
         r.consecutive_skips, step + 1);
}

void restart_energy(Run& r) { r.energy = EnergyWindow{r.be->power_reading(), std::chrono::steady_clock::now(), 0}; }

// The step's metrics line (every log_interval steps and the last), with the energy a step
// since the last one where the device counts it.
void log_step(Run& r, const StepLoss& sl, const StepStats& st, double lr, double secs) {
  StepReport report{r.state.step,
                    r.cfg.train_iters,
                    sl.loss,
                    lr,
                    st.grad_norm,
                    secs,
                    static_cast<double>(r.cfg.global_batch) / secs,
                    static_cast<double>(sl.tokens) / secs,
                    sl.model_flops / secs / 1e12,
                    sl.data,
                    !st.applied};
  const bool log_line = r.state.step % r.cfg.log_interval == 0 || r.state.step == r.cfg.train_iters;
  ++r.energy.steps;
  if (log_line && r.energy.start.available) {
    const PowerReading now = r.be->power_reading();  // (its clock is not reported here)
    const EnergySummary e = summarize_energy(r.energy.start, now, now, r.energy.steps, seconds_since(r.energy.t));
    if (e.available) {
      report.energy_j_per_step = e.joules_per_step;
      report.power_w = e.mean_power_w;
    }
    r.energy = EnergyWindow{now, std::chrono::steady_clock::now(), 0};
  }
  r.progress->step(report, log_line);
  if (r.state.step == r.start_step + 1) {
    const double since_launch = seconds_since_process_start();
    r.progress->event(fmt::format("first step done {:.2f} s after launch (libraries, device, model, data, validation "
                                  "and the step itself)",
                                  since_launch),
                      RecordKind::run,
                      {{"event", "first_step"}, {"step", r.state.step}, {"seconds_since_launch", since_launch}});
  }
}

// ---- validation -----------------------------------------------------------------------------

// MLPerf validation score: mean over the 8 timestep buckets of the mean per-sample loss.
struct Validation {
  double score = std::numeric_limits<double>::quiet_NaN();
  double by_t[8] = {0};
};

// Sample i of the n samples of a batch at `data` (the prediction or the target, both of the
// prediction's type), flattened.
Tensor sample_of(void* data, DType t, int64_t n, int64_t i, int64_t per) {
  return Tensor(data, t, Shape{n, per}).rows_slice(i, 1).reshaped(Shape{per});
}

Validation validate(Run& r) {
  Validation v;
  if (r.val.empty()) return v;
  const size_t micro = static_cast<size_t>(r.cfg.micro_batch);
  double sum[8] = {0};
  int64_t count[8] = {0};
  // Data-parallel ranks take turns by micro-batch; the sums and counts are added up over them.
  const size_t ranks = static_cast<size_t>(r.dp->size()), rank = static_cast<size_t>(r.dp->rank());
  for (size_t first = micro * rank; first < r.val.size(); first += micro * ranks) {
    const size_t n = std::min(r.val.size() - first, micro);
    const std::vector<Sample> part(r.val.begin() + static_cast<std::ptrdiff_t>(first),
                                   r.val.begin() + static_cast<std::ptrdiff_t>(first + n));
    const HostBatch hb =
        make_validation_batch(part, r.cfg.model, r.cfg.objective, r.state.seed, static_cast<int64_t>(first));
    const FluxInputs& in = r.buf->upload(hb, r.cfg.model, r.state.seed);
    const Tensor pred = r.model->forward(in);
    const int64_t per = pred.numel() / static_cast<int64_t>(n);
    const int64_t samples = static_cast<int64_t>(n);
    for (size_t i = 0; i < n; ++i) {
      const int64_t s = static_cast<int64_t>(i);
      const Tensor p = sample_of(pred.data, pred.dtype, samples, s, per);
      const Tensor t = sample_of(r.buf->target.data, pred.dtype, samples, s, per);
      const size_t bucket = static_cast<size_t>(std::lround(hb.t[i] * 8.0)) % 8;
      sum[bucket] += r.be->mse_loss(Tensor{}, p, t, 0.0);
      ++count[bucket];
    }
  }
  std::vector<double> reduced(16);
  for (int k = 0; k < 8; ++k) reduced[static_cast<size_t>(k)] = sum[k], reduced[8 + static_cast<size_t>(k)] = count[k];
  r.dp->sum(reduced);
  for (int k = 0; k < 8; ++k)
    sum[k] = reduced[static_cast<size_t>(k)], count[k] = static_cast<int64_t>(reduced[8 + static_cast<size_t>(k)]);
  double total = 0;
  int buckets = 0;
  for (int k = 0; k < 8; ++k) {
    if (!count[k]) continue;
    v.by_t[k] = sum[k] / static_cast<double>(count[k]);
    total += v.by_t[k];
    ++buckets;
  }
  v.score = total / buckets;
  return v;
}

// Validates and logs the score (NaN without a validation set); in the MLPerf log, it ends the
// block of training before it.
double run_validation(Run& r, const char* when) {
  const auto t0 = std::chrono::steady_clock::now();
  // Validation casts must not enter the delayed-scaling amax history.
  if (r.model->fp8()) r.model->fp8()->set_recording(false);
  const Validation v = validate(r);
  if (r.model->fp8()) r.model->fp8()->set_recording(true);
  if (r.val.empty()) return v.score;
  nlohmann::json rec{{"step", r.state.step},
                     {"val_loss", v.score},
                     {"val_loss_by_t", std::vector<double>(v.by_t, v.by_t + 8)},
                     {"when", when},
                     {"seconds", seconds_since(t0)}};
  r.progress->event(fmt::format("validation ({}) at step {}: {:.4f}", when, r.state.step, v.score), RecordKind::eval,
                    rec);
  if (r.mlperf) {
    r.mlperf->block_stop(r.state.consumed_samples);
    r.mlperf->eval(r.state.consumed_samples, v.score);
  }
  return v.score;
}

// target_eval_loss set and reached by this validation score.
bool reached_target(const Run& r, double val_loss) {
  return r.cfg.target_eval_loss > 0 && std::isfinite(val_loss) && val_loss <= r.cfg.target_eval_loss;
}

// ---- samples --------------------------------------------------------------------------------

// Previews and the end-of-run grid: rank 0 draws them, on one process's forward (a
// tensor-parallel forward needs every rank of its group, so none are drawn there).
void prepare_samples(Run& r, const TrainOptions& opt) {
  const bool wanted = !r.cfg.sample_prompts.empty() || !r.cfg.sample_text_embeddings.empty();
  if (!wanted) return;
  if (r.groups->tp_size() > 1) {
    note(r, "samples: none drawn under tensor parallelism; `flux8 sample --checkpoint` a checkpoint on one GPU");
    return;
  }
  if (lead_rank(r)) r.samples = std::make_unique<RunSamples>(r.cfg, opt.decode_script, *r.progress);
}

// Samples of the model as it is, with FP8 casts kept out of the delayed-scaling history (as
// validation does).
void draw_samples(Run& r, bool end_of_run) {
  if (r.model->fp8()) r.model->fp8()->set_recording(false);
  if (end_of_run)
    r.samples->write_end_of_run(*r.model, r.state.step);
  else
    r.samples->write_preview(*r.model, r.state.step);
  if (r.model->fp8()) r.model->fp8()->set_recording(true);
}

// ---- checkpoints ----------------------------------------------------------------------------

// async_save: a saver writing behind training where a checkpoint's host copy fits in memory.
void prepare_checkpoints(Run& r) {
  const bool behind = r.cfg.async_save == TrainConfig::AsyncSave::on ||
                      (r.cfg.async_save == TrainConfig::AsyncSave::automatic && r.be->computes_beside_host());
  if (!behind || !lead_rank(r)) return;
  if (r.opt->offloaded()) {  // the moments are in host memory already: the save reads them there
    note(r, "async_save: with optimizer_offload the checkpoints are written in line from the host moments");
    return;
  }
  if (r.groups->tp_size() > 1) {  // the host copy would hold rank 0's shards only
    note(r, "async_save: a tensor-parallel job's checkpoints are written in line (rank 0 assembles the shards)");
    return;
  }
  ParamStore& params = r.model->params();
  // (Whole-buffer moments, as a checkpoint holds them, counted from their type.)
  const uint64_t need = CheckpointSnapshot::bytes_for(params, r.opt->moment_dtype());
  const std::optional<uint64_t> available = host_memory_available();
  if (!AsyncCheckpointer::fits(need, available)) {
    note(r, fmt::format("async_save: a checkpoint's host copy ({:.2f} GB) is more than half the host memory "
                        "available ({:.2f} GB): checkpoints are written in line, training waits for them",
                        need / 1e9, *available / 1e9));
    return;
  }
  r.saver = std::make_unique<AsyncCheckpointer>(r.cfg.save_dir, static_cast<int>(r.cfg.keep_last_checkpoints));
  r.saver->prepare(params, r.opt->moment_dtype());
  note(r, fmt::format("checkpoints: written behind training (async_save) from a host copy of {:.2f} GB", need / 1e9));
}

// The FP8 state as of now (its host mirror brought up to date, the device copy left current).
const Fp8MetaRegistry* fp8_state(Run& r) { return r.model->fp8() ? &r.model->fp8()->current_registry() : nullptr; }

void report_saved(Run& r, const AsyncCheckpointer::Finished& f) {
  r.progress->event(fmt::format("saved checkpoint {} ({:.2f} GB in {:.1f} s, written behind training)", f.dir,
                                f.bytes / 1e9, f.write_seconds),
                    RecordKind::checkpoint,
                    {{"event", "checkpoint"},
                     {"step", f.step},
                     {"path", f.dir},
                     {"bytes", f.bytes},
                     {"seconds", f.write_seconds},
                     {"async", true}});
}

// The whole-buffer state the checkpoint writes (on a sharded optimizer's rank 0, as gathered).
CheckpointFlats checkpoint_flats(Run& r) {
  return {r.opt->full_masters(), r.opt->full_exp_avg(), r.opt->full_exp_avg_sq(), &r.opt->full_masters_backend(),
          &r.opt->full_state_backend()};
}

void save_behind(Run& r) {
  const AsyncCheckpointer::Started s = r.saver->start(r.state, r.model->params(), checkpoint_flats(r), fp8_state(r));
  if (s.previous) report_saved(r, *s.previous);
  r.result.last_checkpoint = s.dir;
  std::string waited;  // for the previous save, or (the first save) for the copy's memory to be mapped
  if (s.wait_seconds >= 0.01)
    waited = fmt::format(", after {:.2f} s {}", s.wait_seconds,
                         s.previous ? "waiting for the previous save" : "mapping its memory");
  r.progress->event(fmt::format("saving checkpoint {} behind training (host copy of {:.2f} GB in {:.2f} s{})", s.dir,
                                s.snapshot_bytes / 1e9, s.snapshot_seconds, waited),
                    RecordKind::checkpoint,
                    {{"event", "checkpoint_snapshot"},
                     {"step", r.state.step},
                     {"path", s.dir},
                     {"snapshot_bytes", s.snapshot_bytes},
                     {"snapshot_seconds", s.snapshot_seconds},
                     {"wait_seconds", s.wait_seconds}});
}

// The log line and metrics event of the checkpoint rank 0 just wrote in line.
void report_saved_in_line(Run& r, double secs) {
  const uint64_t bytes = checkpoint_bytes(r.result.last_checkpoint);
  r.progress->event(
      fmt::format("saved checkpoint {} ({:.2f} GB in {:.1f} s)", r.result.last_checkpoint, bytes / 1e9, secs),
      RecordKind::checkpoint,
      {{"event", "checkpoint"},
       {"step", r.state.step},
       {"path", r.result.last_checkpoint},
       {"bytes", bytes},
       {"seconds", secs}});
}

// Tensor parallelism: the ranks of tensor-parallel group 0 bring their shards to rank 0, which
// writes the checkpoint of the whole model (train/checkpoint_shards.h); no host copy behind
// training.
void save_tensor_parallel(Run& r) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string dir =
      save_checkpoint_shards(*r.groups, r.cfg.save_dir, r.state, r.cfg.model, r.model->params(),
                             r.groups->dp_rank() == 0 ? checkpoint_flats(r) : CheckpointFlats{},
                             static_cast<int>(r.cfg.keep_last_checkpoints), lead_rank(r) ? fp8_state(r) : nullptr);
  r.opt->release_full_moments();
  if (!lead_rank(r)) return;
  r.result.last_checkpoint = dir;
  report_saved_in_line(r, seconds_since(t0));
}

// FP8 in a job of several ranks: every rank's delayed-scaling state (scales, amax histories)
// against rank 0's, compared by digest at each checkpoint — the checkpoint keeps rank 0's copy,
// which stands for every rank's only while they agree (the amax reductions keep them identical).
// A disagreement is logged naming the ranks; the metrics record the check either way.
void check_fp8_ranks_agree(Run& r) {
  Fp8Runtime* fp8 = r.model->fp8();
  if (!fp8 || !r.groups->distributed() || fp8->config().recipe != Fp8Recipe::delayed) return;
  const Fp8MetaRegistry& reg = fp8->current_registry();
  std::string bytes;
  for (const std::vector<float>* v : {&reg.scales(), &reg.scale_invs()})
    bytes.append(reinterpret_cast<const char*>(v->data()), v->size() * sizeof(float));
  // The history past its staging row (row 0): that row holds this rank's amaxes of the casts made
  // since the last update (a tensor-parallel rank's of its shards), reduced over the job before use.
  const std::vector<float>& history = reg.amax_history();
  const size_t staging = std::min(history.size(), static_cast<size_t>(reg.size()));
  bytes.append(reinterpret_cast<const char*>(history.data() + staging), (history.size() - staging) * sizeof(float));
  const std::vector<int> apart = r.world->ranks_differing_from_lead(sha256_hex(bytes));
  const int ranks = r.groups->world_size();
  if (!lead_rank(r)) return;
  const std::string line =
      apart.empty() ? fmt::format("FP8 state ({} scales and amax histories) identical on all {} ranks at step {}",
                                  reg.size(), ranks, r.state.step)
                    : fmt::format(
                          "FP8 state of rank(s) {} differs from rank 0's at step {}: the ranks cast with "
                          "different scales, and the checkpoint keeps rank 0's; report this with the config",
                          fmt::join(apart, ", "), r.state.step);
  // Agreement is said once; the metrics keep every check.
  r.progress->event(apart.empty() && r.fp8_ranks_checked ? "" : line, RecordKind::run,
                    {{"event", apart.empty() ? "fp8_ranks_agree" : "fp8_ranks_differ"},
                     {"step", r.state.step},
                     {"ranks", ranks},
                     {"differing_ranks", apart}});
  r.fp8_ranks_checked = true;
}

// The checkpoint of the whole job: every rank takes part in gathering the state (a sharded
// optimizer's moments), rank 0 writes it. A rank that fails here ends the job (src/cli/main.cpp),
// so no rank goes on past a checkpoint that was not written; the atomic rename keeps the previous
// one the newest.
void save(Run& r) {
  check_fp8_ranks_agree(r);
  r.opt->gather_moments();
  if (r.groups->tp_size() > 1) {
    save_tensor_parallel(r);
    return;
  }
  if (!lead_rank(r)) {
    r.opt->release_full_moments();
    return;
  }
  if (r.saver) {
    save_behind(r);  // the host copy is taken before start() returns
    r.opt->release_full_moments();
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  r.result.last_checkpoint = save_checkpoint(r.cfg.save_dir, r.state, r.model->params(), checkpoint_flats(r),
                                             static_cast<int>(r.cfg.keep_last_checkpoints), fp8_state(r));
  r.opt->release_full_moments();
  report_saved_in_line(r, seconds_since(t0));
}

// A background save that has finished (or failed: the error stops the run here).
void poll_saver(Run& r) {
  if (r.saver)
    if (auto f = r.saver->poll()) report_saved(r, *f);
}

// ---- the step loop --------------------------------------------------------------------------

void start_pipeline(Run& r) {
  BatchPipelineSpec spec{r.cfg.model,        r.cfg.objective,   r.empty,      r.state.seed,
                         r.cfg.global_batch, r.cfg.micro_batch, r.start_step, r.cfg.train_iters};
  spec.mode = r.cfg.data_overlap;
  spec.dp_rank = r.dp->rank();
  spec.dp_size = r.dp->size();
  r.pipeline = std::make_unique<BatchPipeline>(*r.be, *r.loader, spec);
  note(r, r.pipeline->background()
              ? "data: each micro-batch built and uploaded on a thread of its own while the device computes the one "
                "before (data_overlap)"
              : "data: each micro-batch built and uploaded before it computes (data_overlap)");
}

// One optimizer step: gradients over the step's micro-batches, the update, the state and the
// metrics line.
void take_step(Run& r, const StepContext& ctx, const TrainOptions& opt) {
  if (r.mlperf) r.mlperf->block_start(r.state.consumed_samples);  // after a validation (or at the start)
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t step = r.state.step;  // 0-based index of the step being taken
  Fp8Runtime* fp8 = r.model->fp8();
  // FP8 telemetry counts only on the steps that report them (report_fp8_stats below).
  const auto reports_fp8 = [&](int64_t index) {
    return fp8 && r.cfg.fp8.stats_interval > 0 && (index + 1) % r.cfg.fp8.stats_interval == 0;
  };
  const bool report_fp8 = reports_fp8(step);
  if (fp8) fp8->set_collect_stats(report_fp8);
  LoaderState ls;  // the loader's position after this step's samples (the pipeline reads ahead)
  if (r.buckets) r.buckets->begin_step();
  const StepLoss sl = accumulate_step_gradients(ctx, *r.pipeline, step, &ls);
  if (r.buckets) r.buckets->finish_step();
  if (!opt.nan_gradient.param.empty()) inject_nan_gradient(r, opt.nan_gradient, step);
  const double lr = r.cfg.schedule.at(step + 1);
  // FP8: one delayed-scaling update for all tensors (an inf/NaN amax keeps the old scale),
  // then the update, which also writes the new weights' casts (delayed recipe; with sharded
  // masters every recipe's, counted as the next step counts its casts).
  if (fp8) fp8->set_collect_stats(reports_fp8(step + 1));
  const StepStats st = apply_optimizer_step(*r.model, *r.opt, step + 1, lr, std::isfinite(sl.loss));
  if (!st.applied)
    handle_skipped_step(r, step, sl.loss);
  else
    r.consecutive_skips = 0;
  if (report_fp8) report_fp8_stats(*fp8, step + 1, *r.progress);
  r.state.step = step + 1;
  r.state.consumed_samples += r.cfg.global_batch;
  r.state.data_epoch = static_cast<int64_t>(ls.epoch);
  r.state.data_position = static_cast<int64_t>(ls.consumed);
  r.state.last_loss = sl.loss;
  log_step(r, sl, st, lr, seconds_since(t0));
}

// After a step: validation and checkpoints when due; false when the run stops here.
bool after_step(Run& r, const TrainOptions& opt) {
  poll_saver(r);
  const bool last = r.state.step == r.cfg.train_iters;
  bool outside_steps = false;  // validation or a checkpoint: left out of the energy a step
  if (r.cfg.eval_interval > 0 && r.state.step % r.cfg.eval_interval == 0 && !last) {
    const double score = run_validation(r, "interval");
    // (Every rank holds the same reduced score: they stop together.)
    if (reached_target(r, score)) {
      r.result.reached_target = true;
      r.result.last_val_loss = score;
      r.progress->event(fmt::format("validation loss {:.4f} reached target_eval_loss {} at step {}: stopping", score,
                                    r.cfg.target_eval_loss, r.state.step),
                        RecordKind::run, {{"event", "target_reached"}, {"step", r.state.step}, {"val_loss", score}});
    }
    outside_steps = true;
  }
  if (r.result.reached_target) {
    save(r);
    return false;
  }
  if (r.samples && r.samples->preview_due(r.state.step) && !last) {  // (the last step: the end-of-run grid)
    draw_samples(r, false);
    outside_steps = true;
  }
  bool stop = stop_requested() || (opt.stop_after > 0 && r.state.step - r.start_step >= opt.stop_after);
  if (r.groups->distributed()) {  // a signal reaches the ranks at different steps: stop together
    std::vector<double> any{stop ? 1.0 : 0.0};
    r.world->max(any);
    stop = any[0] > 0;
  }
  if ((r.cfg.save_interval > 0 && r.state.step % r.cfg.save_interval == 0) || last || stop) {
    save(r);
    outside_steps = true;
  }
  if (outside_steps && r.energy.start.available) restart_energy(r);
  if (!stop || last) return true;
  r.progress->event(fmt::format("stopping at step {} ({}); resume with --resume", r.state.step,
                                stop_requested() ? stop_signal_name() : "--stop-after"),
                    RecordKind::run, {{"event", "stopped"}, {"step", r.state.step}});
  r.result.stopped_early = true;
  return false;
}

void step_loop(Run& r, const TrainOptions& opt) {
  const StepContext ctx{*r.model,       r.cfg.model,  r.cfg.objective, r.empty,
                        *r.buf,         r.state.seed, r.graph.get(),   r.dp->size() > 1 ? &r.dp->group() : nullptr,
                        r.buckets.get()};
  restart_energy(r);
  while (r.state.step < r.cfg.train_iters) {
    take_step(r, ctx, opt);
    if (!after_step(r, opt)) break;
  }
}

// ---- shutdown -------------------------------------------------------------------------------

void finish(Run& r) {
  if (!r.result.stopped_early) {  // while the last checkpoint is written
    if (!r.result.reached_target) {
      r.result.last_val_loss = run_validation(r, "end");
      r.result.reached_target = reached_target(r, r.result.last_val_loss);
    }
    if (r.samples) draw_samples(r, true);
  }
  if (r.saver)
    if (auto f = r.saver->wait()) report_saved(r, *f);
  restore_stop_signals();
  // MLPerf: success when the run reached its target, or finished without one.
  if (r.mlperf)
    r.mlperf->run_stop(r.state.consumed_samples,
                       r.cfg.target_eval_loss > 0 ? r.result.reached_target : !r.result.stopped_early);
  r.progress->finish();
  r.result.steps_done = r.state.step;
  r.result.last_loss = r.state.last_loss;
}

}  // namespace

TrainResult run_training(const TrainOptions& opt) {
  Run r;
  prepare_config_and_data(r, opt);
  build_model(r);
  restore_or_init(r, opt);
  open_loader(r);
  install_stop_signals();
  open_metrics(r);
  announce_run(r);
  prepare_samples(r, opt);
  prepare_checkpoints(r);
  if (r.mlperf) {
    r.mlperf->hyperparameters(r.cfg, static_cast<int64_t>(r.val.size()), r.be->name());
    r.mlperf->run_start(r.state.consumed_samples);
  }
  r.result.first_val_loss = run_validation(r, r.start_step == 0 ? "start" : "resume");
  start_pipeline(r);
  step_loop(r, opt);
  finish(r);
  return r.result;
}

}  // namespace flux8

#include "train/trainer.h"

#include <fmt/core.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <utility>

#include "backend/backend.h"
#include "backend/energy.h"
#include "backend/step_graph.h"
#include "backend/transfer.h"
#include "config/config.h"
#include "core/error.h"
#include "core/process_clock.h"
#include "data/loader.h"
#include "model/flux_model.h"
#include "model/weights_io.h"
#include "train/async_checkpoint.h"
#include "train/batch_pipeline.h"
#include "train/checkpoint.h"
#include "train/end_samples.h"
#include "train/objective.h"
#include "train/optimizer.h"
#include "train/progress.h"
#include "train/run_data.h"
#include "train/signals.h"
#include "train/train_step.h"
#include "train/fp8_report.h"
#include "fp8/fp8_config.h"

namespace flux8 {

namespace fs = std::filesystem;

namespace {

// The first parameter whose gradient has a non-finite value (for the skip message).
std::string first_nonfinite_gradient(ParamStore& store) {
  store.materialize_low_rank_grads();  // grad() reads the flat buffer
  for (const ParamInfo& p : store.layout().params()) {
    const double s = store.backend().sum_squares(store.grad(p.name));
    if (!std::isfinite(s)) return p.name;
  }
  return "(none: the loss itself was non-finite)";
}

struct Run {
  Config cfg;
  FluxConfig model_cfg;
  ObjectiveConfig obj;
  std::unique_ptr<Backend> be;
  // cuda_graph: the graph recorder intercepting `be`'s ops (destroyed before be).
  std::unique_ptr<StepGraph> graph;
  std::unique_ptr<FluxModel> model;
  std::unique_ptr<AdamWOptimizer> opt;
  LrSchedule schedule;
  TrainerState state;
  Fp8Config fp8;
  int64_t micro = 1, accumulation = 1, global = 1;
  std::string save_dir;
};

// MLPerf validation score: mean over the 8 timestep buckets of the mean per-sample loss.
struct Validation {
  double score = std::numeric_limits<double>::quiet_NaN();
  double by_t[8] = {0};
};

Validation validate(Run& r, const std::vector<Sample>& val, StepBuffers& buf) {
  Validation v;
  if (val.empty()) return v;
  double sum[8] = {0};
  int64_t count[8] = {0};
  for (size_t first = 0; first < val.size(); first += static_cast<size_t>(r.micro)) {
    const size_t n = std::min(val.size() - first, static_cast<size_t>(r.micro));
    const std::vector<Sample> part(val.begin() + static_cast<std::ptrdiff_t>(first),
                                   val.begin() + static_cast<std::ptrdiff_t>(first + n));
    const HostBatch hb = make_validation_batch(part, r.model_cfg, r.obj, r.state.seed, static_cast<int64_t>(first));
    const FluxInputs& in = buf.upload(hb, r.model_cfg, r.state.seed);
    const Tensor pred = r.model->forward(in);
    const int64_t per = pred.numel() / static_cast<int64_t>(n);
    for (size_t i = 0; i < n; ++i) {
      const Shape one{per};
      const Tensor p(static_cast<char*>(pred.data) + i * static_cast<size_t>(per) * dtype_size(pred.dtype), pred.dtype, one);
      const Tensor t(static_cast<char*>(buf.target.data) + i * static_cast<size_t>(per) * dtype_size(pred.dtype), pred.dtype, one);
      const size_t bucket = static_cast<size_t>(std::lround(hb.t[i] * 8.0)) % 8;
      sum[bucket] += r.be->mse_loss(Tensor{}, p, t, 0.0);
      ++count[bucket];
    }
  }
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

}  // namespace

TrainResult run_training(const TrainOptions& opt) {
  Run r;
  r.cfg = Config::load(opt.config_path, opt.overrides);
  r.model_cfg = FluxConfig::from_config(r.cfg);
  r.obj = ObjectiveConfig::from_config(r.cfg);
  const BackendOptions bo = BackendOptions::from_config(r.cfg);
  r.be = make_backend(r.cfg.get_string("backend"), bo);
  r.micro = r.cfg.get_int("micro_batch_size");
  r.global = r.cfg.get_int("global_batch_size") ? r.cfg.get_int("global_batch_size") : r.micro;
  if (r.global % r.micro)
    fail("global_batch_size {} ({}) is not a multiple of micro_batch_size {} ({})", r.global,
         r.cfg.source("global_batch_size"), r.micro, r.cfg.source("micro_batch_size"));
  r.accumulation = r.global / r.micro;
  const int64_t train_iters = r.cfg.get_int("train_iters");
  r.schedule = LrSchedule{r.cfg.get_float("lr"), r.cfg.get_float("min_lr"), r.cfg.get_int("lr_warmup_iters"),
                          r.cfg.get_int("lr_decay_iters") ? r.cfg.get_int("lr_decay_iters") : train_iters,
                          r.cfg.get_string("lr_decay_style")};
  r.save_dir = r.cfg.get_string("save_dir");
  fs::create_directories(r.save_dir);

  // Config and data first: a bad key or path should fail before any work is done.
  r.fp8 = Fp8Config::from_config(r.cfg);
  prepare_demo_data(r.cfg, r.model_cfg);
  if (r.cfg.get_string("train_data").empty())
    fail("train_data is empty in {}: set it to your shards (a glob, a list file or a directory)", opt.config_path);
  const EmptyPrompt empty = load_empty_prompt(r.cfg, r.model_cfg);
  const std::vector<Sample> val = load_validation_set(r.cfg);

  // cuda_graph: each micro-batch's forward and backward recorded and launched as CUDA graphs
  // (backend/step_graph.h); a backend without graphs runs op by op, as it says at the start.
  if (r.cfg.get_bool("cuda_graph") && r.be->can_capture())
    r.graph = std::make_unique<StepGraph>(*r.be, StepGraph::Options::from_environment());
  r.model = std::make_unique<FluxModel>(r.model_cfg, *r.be, DType::f32, &r.fp8,
                                        recompute_from_name(r.cfg.get_string("recompute_granularity")));
  r.opt = std::make_unique<AdamWOptimizer>(r.model->params(), AdamWConfig::from_config(r.cfg));
  // A step's samples are the rows every per-sample Linear sees: few enough, and their gradients
  // stay as factors (ParamStore::keep_low_rank_grads).
  r.model->params().keep_low_rank_grads(r.global);
  r.state.seed = static_cast<uint64_t>(r.cfg.get_int("seed"));
  r.state.config_yaml = r.cfg.dump();

  std::string resumed_from, fp8_note;
  double verify_seconds = 0.0, load_seconds = 0.0;
  if (opt.resume) {
    const auto t0 = std::chrono::steady_clock::now();
    if (auto dir = find_latest_checkpoint(r.save_dir)) {  // verifies every file's digest
      verify_seconds = seconds_since(t0);
      const auto t1 = std::chrono::steady_clock::now();
      Fp8MetaRegistry* registry = r.model->fp8() ? &r.model->fp8()->registry() : nullptr;
      load_checkpoint(*dir, r.state, r.model_cfg, r.model->params(), r.opt->exp_avg(), r.opt->exp_avg_sq(),
                      registry, &fp8_note, CheckpointVerify::sizes);  // its digests were just verified
      r.state.config_yaml = r.cfg.dump();  // the config of this run goes into its checkpoints
      resumed_from = *dir;
      load_seconds = seconds_since(t1);
    }
  }
  if (resumed_from.empty()) {
    r.model->params().init(r.state.seed);
    if (!opt.init_from.empty()) load_weights(r.model->params(), r.model_cfg, resolve_weights_path(opt.init_from));
  } else if (!opt.init_from.empty()) {
    fmt::print("note: --init-from {} ignored: resuming from {}\n", opt.init_from, resumed_from);
  }

  LoaderOptions lo;
  lo.source = r.cfg.get_string("train_data");
  lo.seed = r.state.seed;
  lo.shuffle_buffer = static_cast<size_t>(r.cfg.get_int("data_shuffle_buffer"));
  lo.prefetch = static_cast<size_t>(r.cfg.get_int("data_prefetch"));
  lo.skip_corrupt = r.cfg.get_bool("data_skip_corrupt");
  DataLoader loader(lo, LoaderState{static_cast<uint64_t>(r.state.data_epoch), static_cast<uint64_t>(r.state.data_position)});

  install_stop_signals();
  const int64_t start_step = r.state.step;
  Progress progress((fs::path(r.save_dir) / "metrics.jsonl").string(), !resumed_from.empty(), start_step, train_iters);
  StepBuffers buf(*r.be, DType::f32);
  TrainResult result;

  const int64_t params = r.model->params().layout().total();
  progress.event(fmt::format("flux8 train: model {} ({:.2f}M parameters), {} backend, batch {} = {} x {} micro, "
                             "{} steps, {} validation samples, saving to {}",
                             r.model_cfg.name, static_cast<double>(params) / 1e6, r.be->name(), r.global,
                             r.accumulation, r.micro, train_iters, val.size(), r.save_dir),
                 nullptr);
  progress.event(fmt::format("precision: {}", r.fp8.describe()), nullptr);
  if (r.model->params().grad_dtype() != r.model->params().dtype())
    progress.event(fmt::format("gradients: stored in {} (grad_precision); master weights in {}",
                               dtype_name(r.model->params().grad_dtype()), dtype_name(r.model->params().dtype())),
                   nullptr);
  if (r.opt->moment_dtype() != r.model->params().dtype())
    progress.event(fmt::format("AdamW moments: stored in {} (adam_moment_precision), rounded stochastically; "
                               "computed in {}",
                               dtype_name(r.opt->moment_dtype()), dtype_name(r.model->params().dtype())),
                   nullptr);
  // (On, the default, a backend without graphs runs op by op without a word; set, it says so.)
  if (r.graph)
    progress.event("cuda_graph: each micro-batch's forward and backward run as CUDA graphs, captured from the first "
                   "steps (segments of " +
                       std::to_string(r.graph->graph_options().segment_ops) + " ops)",
                   nullptr);
  else if (r.cfg.get_bool("cuda_graph") && r.cfg.source("cuda_graph") != "default")
    progress.event("cuda_graph: the " + r.be->name() + " backend has no graphs; running op by op", nullptr);
  if (r.be->name() == "cuda" && !r.be->options().deterministic_attention)
    progress.event("attention: cuDNN's faster backward (deterministic_attention: false, or "
                   "FLUX8_ATTENTION_DETERMINISTIC=0): its dq sums with atomics in a varying order, so runs and "
                   "resumes no longer repeat bit for bit",
                   nullptr);
  if (const int64_t rows = r.model->params().low_rank_rows())
    progress.event(fmt::format("gradients: the modulation and embedder Linears' weight gradients kept as "
                               "rank-{} factors (a step of at most {} samples; not written as tensors)",
                               rows, ParamStore::kLowRankMaxRows),
                   nullptr);
  if (!resumed_from.empty()) {
    progress.event(fmt::format("resumed from {} at step {} (last loss {:.4f}; verified in {:.1f} s, loaded in {:.1f} s)",
                               resumed_from, r.state.step, r.state.last_loss, verify_seconds, load_seconds),
                   {{"event", "resume"}, {"step", r.state.step}, {"checkpoint", resumed_from},
                    {"verify_seconds", verify_seconds}, {"load_seconds", load_seconds}});
    if (!fp8_note.empty()) progress.event(fp8_note, nullptr);
  }

  auto run_validation = [&](const char* when) {
    // Validation casts must not enter the delayed-scaling amax history.
    if (r.model->fp8()) r.model->fp8()->set_recording(false);
    const Validation v = validate(r, val, buf);
    if (r.model->fp8()) r.model->fp8()->set_recording(true);
    if (val.empty()) return v.score;
    nlohmann::json rec{{"step", r.state.step}, {"val_loss", v.score}, {"val_loss_by_t", std::vector<double>(v.by_t, v.by_t + 8)}};
    progress.event(fmt::format("validation ({}) at step {}: {:.4f}", when, r.state.step, v.score), rec);
    return v.score;
  };
  // Checkpoints: written behind training where the host copy fits (async_save), else in line.
  const int keep_last = static_cast<int>(r.cfg.get_int("keep_last_checkpoints"));
  // The FP8 state as of now (its host mirror brought up to date); const: reading the mirror must
  // not mark the device copy stale.
  auto fp8_state = [&]() -> const Fp8MetaRegistry* {
    return r.model->fp8() ? &std::as_const(*r.model->fp8()).registry() : nullptr;
  };
  std::unique_ptr<AsyncCheckpointer> saver;
  const std::string async_save = r.cfg.get_string("async_save");
  if (async_save == "on" || (async_save == "auto" && r.be->computes_beside_host())) {
    const uint64_t need = CheckpointSnapshot::bytes_for(r.model->params(), r.opt->exp_avg(), r.opt->exp_avg_sq());
    const std::optional<uint64_t> available = host_memory_available();
    if (AsyncCheckpointer::fits(need, available)) {
      saver = std::make_unique<AsyncCheckpointer>(r.save_dir, keep_last);
      saver->prepare(r.model->params(), r.opt->exp_avg(), r.opt->exp_avg_sq());
      progress.event(fmt::format("checkpoints: written behind training (async_save) from a host copy of {:.2f} GB",
                                 need / 1e9),
                     nullptr);
    } else
      progress.event(fmt::format("async_save: a checkpoint's host copy ({:.2f} GB) is more than half the host memory "
                                 "available ({:.2f} GB): checkpoints are written in line, training waits for them",
                                 need / 1e9, *available / 1e9),
                     nullptr);
  }
  auto report_saved = [&](const AsyncCheckpointer::Finished& f) {
    progress.event(fmt::format("saved checkpoint {} ({:.2f} GB in {:.1f} s, written behind training)", f.dir,
                               f.bytes / 1e9, f.write_seconds),
                   {{"event", "checkpoint"}, {"step", f.step}, {"path", f.dir}, {"bytes", f.bytes},
                    {"seconds", f.write_seconds}, {"async", true}});
  };
  auto save = [&]() {
    if (saver) {
      const AsyncCheckpointer::Started s =
          saver->start(r.state, r.model->params(), r.opt->exp_avg(), r.opt->exp_avg_sq(), fp8_state());
      if (s.previous) report_saved(*s.previous);
      result.last_checkpoint = s.dir;
      std::string waited;  // for the previous save, or (the first save) for the copy's memory to be mapped
      if (s.wait_seconds >= 0.01)
        waited = fmt::format(", after {:.2f} s {}", s.wait_seconds,
                             s.previous ? "waiting for the previous save" : "mapping its memory");
      progress.event(fmt::format("saving checkpoint {} behind training (host copy of {:.2f} GB in {:.2f} s{})", s.dir,
                                 s.snapshot_bytes / 1e9, s.snapshot_seconds, waited),
                     {{"event", "checkpoint_snapshot"}, {"step", r.state.step}, {"path", s.dir},
                      {"snapshot_bytes", s.snapshot_bytes}, {"snapshot_seconds", s.snapshot_seconds},
                      {"wait_seconds", s.wait_seconds}});
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    result.last_checkpoint = save_checkpoint(r.save_dir, r.state, r.model_cfg, r.model->params(), r.opt->exp_avg(),
                                             r.opt->exp_avg_sq(), keep_last, fp8_state());
    const double secs = seconds_since(t0);
    const uint64_t bytes = checkpoint_bytes(result.last_checkpoint);
    progress.event(fmt::format("saved checkpoint {} ({:.2f} GB in {:.1f} s)", result.last_checkpoint, bytes / 1e9, secs),
                   {{"event", "checkpoint"}, {"step", r.state.step}, {"path", result.last_checkpoint},
                    {"bytes", bytes}, {"seconds", secs}});
  };
  // A background save that has finished (or failed: the error stops the run here).
  auto poll_saver = [&] {
    if (saver)
      if (auto f = saver->poll()) report_saved(*f);
  };
  auto wait_saver = [&] {
    if (saver)
      if (auto f = saver->wait()) report_saved(*f);
  };

  result.first_val_loss = run_validation(start_step == 0 ? "start" : "resume");
  const int64_t eval_interval = r.cfg.get_int("eval_interval"), save_interval = r.cfg.get_int("save_interval");
  const int64_t log_interval = r.cfg.get_int("log_interval");
  int consecutive_skips = 0;
  const bool nan_halt = r.cfg.get_string("nan_policy") == "halt";
  const int64_t max_skips = r.cfg.get_int("nan_max_consecutive_skips");
  const StepContext ctx{*r.model, r.model_cfg, r.obj, empty, buf, r.state.seed, r.graph.get()};
  BatchPipelineSpec pipeline_spec{r.model_cfg, r.obj, empty, r.state.seed, r.global, r.micro, start_step, train_iters};
  const std::string overlap = r.cfg.get_string("data_overlap");
  pipeline_spec.mode = overlap == "on"    ? BatchPipelineSpec::Mode::thread
                       : overlap == "off" ? BatchPipelineSpec::Mode::caller
                                          : BatchPipelineSpec::Mode::automatic;
  BatchPipeline pipeline(*r.be, loader, pipeline_spec);
  progress.event(pipeline.background()
                     ? "data: each micro-batch built and uploaded on a thread of its own while the device computes "
                       "the one before (data_overlap)"
                     : "data: each micro-batch built and uploaded before it computes (data_overlap)",
                 nullptr);
  // The device's energy over the steps since the last logged one (backend/energy.h): read on
  // logged steps only, and read again after validation and checkpoints, which it leaves out.
  struct EnergyWindow {
    PowerReading start;
    std::chrono::steady_clock::time_point t;
    int steps = 0;
  } energy;
  auto restart_energy = [&](PowerReading now) { energy = EnergyWindow{now, std::chrono::steady_clock::now(), 0}; };
  restart_energy(r.be->power_reading());
  while (r.state.step < train_iters) {
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t step = r.state.step;  // 0-based index of the step being taken
    // FP8 telemetry counts only on the steps that report them (report_fp8_stats below).
    const bool report_fp8 = r.model->fp8() && r.fp8.stats_interval > 0 && (step + 1) % r.fp8.stats_interval == 0;
    if (r.model->fp8()) r.model->fp8()->set_collect_stats(report_fp8);
    LoaderState ls;  // the loader's position after this step's samples (the pipeline reads ahead)
    const StepLoss sl = accumulate_step_gradients(ctx, pipeline, step, &ls);
    const double loss = sl.loss;
    const int64_t tokens = sl.tokens;
    const double lr = r.schedule.at(step + 1);
    // FP8: one delayed-scaling update for all tensors (an inf/NaN amax keeps the old scale),
    // then the update, which also writes the new weights' casts (delayed recipe).
    StepStats st = apply_optimizer_step(*r.model, *r.opt, step + 1, lr, std::isfinite(loss));
    if (!st.applied) {
      ++r.state.skipped_steps;
      const std::string first = first_nonfinite_gradient(r.model->params());
      progress.event(fmt::format("step {}: non-finite {} (first non-finite gradient: {}); step skipped, weights kept",
                                 step + 1, std::isfinite(loss) ? "gradient" : "loss", first),
                     {{"event", "skipped_step"}, {"step", step + 1}, {"first_nonfinite", first}});
      if (nan_halt)
        fail("step {}: non-finite {} (first non-finite gradient: {}) and nan_policy is halt; the last checkpoint "
             "is intact", step + 1, std::isfinite(loss) ? "gradient" : "loss", first);
      if (++consecutive_skips >= max_skips)
        fail("{} consecutive steps had a non-finite loss or gradient (last at step {}); stopping. Lower lr "
             "or check the data; the last checkpoint is intact.", consecutive_skips, step + 1);
    } else {
      consecutive_skips = 0;
    }
    if (report_fp8) report_fp8_stats(*r.model->fp8(), step + 1, progress);
    r.state.step = step + 1;
    r.state.consumed_samples += r.global;
    r.state.data_epoch = static_cast<int64_t>(ls.epoch);
    r.state.data_position = static_cast<int64_t>(ls.consumed);
    r.state.last_loss = loss;
    const double secs = seconds_since(t0);
    StepReport report{r.state.step, train_iters, loss, lr, st.grad_norm, secs,
                      static_cast<double>(r.global) / secs, static_cast<double>(tokens) / secs,
                      sl.model_flops / secs / 1e12, sl.data, !st.applied};
    const bool log_line = r.state.step % log_interval == 0 || r.state.step == train_iters;
    ++energy.steps;
    if (log_line && energy.start.available) {
      const PowerReading now = r.be->power_reading();  // (its clock is not reported here)
      const EnergySummary e = summarize_energy(energy.start, now, now, energy.steps, seconds_since(energy.t));
      if (e.available) {
        report.energy_j_per_step = e.joules_per_step;
        report.power_w = e.mean_power_w;
      }
      restart_energy(now);
    }
    progress.step(report, log_line);
    if (r.state.step == start_step + 1) {
      const double since_launch = seconds_since_process_start();
      progress.event(fmt::format("first step done {:.2f} s after launch (libraries, device, model, data, validation "
                                 "and the step itself)",
                                 since_launch),
                     {{"event", "first_step"}, {"step", r.state.step}, {"seconds_since_launch", since_launch}});
    }

    poll_saver();
    const bool last = r.state.step == train_iters;
    bool outside_steps = false;  // validation or a checkpoint: left out of the energy a step
    if (eval_interval > 0 && r.state.step % eval_interval == 0 && !last) {
      run_validation("interval");
      outside_steps = true;
    }
    const bool stop = stop_requested() || (opt.stop_after > 0 && r.state.step - start_step >= opt.stop_after);
    if ((save_interval > 0 && r.state.step % save_interval == 0) || last || stop) {
      save();
      outside_steps = true;
    }
    if (outside_steps && energy.start.available) restart_energy(r.be->power_reading());
    if (stop && !last) {
      progress.event(fmt::format("stopping at step {} ({}); resume with --resume",
                                 r.state.step, stop_requested() ? stop_signal_name() : "--stop-after"),
                     {{"event", "stopped"}, {"step", r.state.step}});
      result.stopped_early = true;
      break;
    }
  }
  if (!result.stopped_early) {  // while the last checkpoint is written
    result.last_val_loss = run_validation("end");
    write_end_of_run_samples(r.cfg, r.model_cfg, *r.model, r.save_dir, progress);
  }
  wait_saver();
  restore_stop_signals();
  progress.finish();
  result.steps_done = r.state.step;
  result.last_loss = r.state.last_loss;
  return result;
}

}  // namespace flux8

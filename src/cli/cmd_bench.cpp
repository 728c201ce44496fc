// `flux8 bench`: the training-step benchmark (the workloads W1 and W2, or the model and shape of
// a config) in BF16 and each FP8 recipe, and a GEMM micro-benchmark at Flux shapes. Prints a
// table and writes JSON (--json); with --peer, each run's ratios to a PyTorch peer timed by
// tools/peer_bench.py on the same GPU.
#include <fmt/core.h>
#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "backend/backend.h"
#include "bench/peer.h"
#include "bench/roofline.h"
#include "bench/step_bench.h"
#include "bench/targets.h"
#include "cli/commands.h"
#include "config/config.h"
#include "core/error.h"
#include "dist/mpi_runtime.h"
#include "dist/process_groups.h"
#include "model/flops.h"
#if FLUX8_HAVE_CUDA
#include "backend/cuda/factory.h"
#endif

namespace flux8::cli {

namespace {

using nlohmann::json;

struct BenchOptions {
  std::vector<std::string> workloads{"W1", "W2"};
  std::vector<std::string> precisions{"bf16", "delayed", "tensorwise", "blockwise"};
  std::string format = "hybrid", backend = "cuda", json_file, config, data = "prototypes", peer;
  std::vector<std::string> overrides;
  int steps = 10, warmup = 3, micro_batches = 1;
  double lr = 1e-4;
  bool gemm = false, profile = false, data_path = false;
};

void add_bench_options(CLI::App* cmd, BenchOptions& o) {
  cmd->add_option("--workload", o.workloads, "W1 and/or W2 (default both); ignored with -c")->delimiter(',');
  cmd->add_option("-c,--config", o.config,
                  "benchmark this config's model at its micro_batch_size, image_size and text_seq_len instead")
      ->check(CLI::ExistingFile);
  cmd->add_option("--set", o.overrides,
                  "override a config key: fp8_* keys, recompute_granularity (none, selective, full), "
                  "recompute_elementwise (false: the blocks keep their element-wise results), "
                  "activation_precision (bf16, f32), grad_precision (f32, bf16) and the AdamW keys (adam_*, "
                  "weight_decay, clip_grad; adam_moment_precision f32 or bf16), cuda_graph (true: the forward and "
                  "backward as CUDA graphs; not with --profile), deterministic_attention (false: cuDNN's faster "
                  "attention backward, with atomics), deterministic_attention_workspace_mib (the most MiB the "
                  "deterministic backward's dP takes) for the runs, or any key with -c");
  cmd->add_option("--precision", o.precisions, "bf16, delayed, tensorwise, blockwise, mxfp8 (comma-separated)")
      ->delimiter(',');
  cmd->add_option("--fp8-format", o.format, "FP8 format of the FP8 runs")->check(CLI::IsMember({"e4m3", "hybrid"}));
  cmd->add_option("--steps", o.steps, "timed steps (median reported)")->check(CLI::Range(1, 100000));
  cmd->add_option("--warmup", o.warmup, "untimed steps first")->check(CLI::Range(0, 100000));
  cmd->add_option("--micro-batches", o.micro_batches,
                  "gradient accumulation: forward and backward passes a step, each rank (default 1)")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--lr", o.lr, "constant learning rate of the AdamW steps")->check(CLI::PositiveNumber);
  cmd->add_option("--backend", o.backend, "cuda or cpu")->check(CLI::IsMember({"cuda", "cpu"}));
  cmd->add_option("--data", o.data,
                  "synthetic data: prototypes (64 fixed latents and texts, memorised: loss falls towards 0) or "
                  "structured (fresh latents tied to the text by fixed random maps, plus noise: a loss floor)")
      ->check(CLI::IsMember({"prototypes", "structured"}));
  cmd->add_option("--json", o.json_file, "write the results as JSON to this file");
  cmd->add_option("--peer", o.peer,
                  "after each workload's runs, print each run's step time and peak memory as ratios to the PyTorch "
                  "peer in this file (written by tools/peer_bench.py: diffusers' Flux in eager, torch.compile and "
                  "torchao FP8 modes) — only where the peer ran on this bench's device (named in the output) and "
                  "at the run's shape; otherwise it says why there is no ratio. Without --peer no ratio is printed");
  cmd->add_flag("--gemm", o.gemm, "run the GEMM and attention micro-benchmarks instead of training steps");
  cmd->add_flag("--profile", o.profile,
                "also time every op of the step from device timing marks around it (nothing waits), with the device's "
                "idle time between ops as a row of its own and split by the op it waited for (\"idle before\"), "
                "then the rows grouped as the roofline's parts (GEMMs and attention with their model FLOPs and "
                "rate, AdamW, FP8 casts, everything else)");
  cmd->add_flag("--data-path", o.data_path,
                "also time what flux8 train does on the host before each step at the workload's shape, outside the "
                "step's clock: a batch of MLPerf-like samples (VAE mean and logvar, T5 and CLIP features) assembled "
                "and uploaded");
}

// The FP8 settings of one run: the recipe and format of --precision / --fp8-format over the
// other fp8_* keys of the config and --set (history, algorithm, margin, wgrad, first/last blocks
// in BF16, ...; the schema's defaults without -c), checked like a training config.
Fp8Config fp8_for(const std::string& precision, const std::string& format, Config cfg) {
  if (precision == "bf16") {
    cfg.set("fp8", "none", "flux8 bench --precision");
    return Fp8Config::from_config(cfg);  // fails if --set asked for FP8 knobs: they would be ignored
  }
  if (precision != "delayed" && precision != "tensorwise" && precision != "blockwise" && precision != "mxfp8")
    fail("bench: unknown precision '{}': choose bf16, delayed, tensorwise, blockwise or mxfp8", precision);
  cfg.set("fp8", format, "flux8 bench --fp8-format");
  cfg.set("fp8_recipe", precision, "flux8 bench --precision");
  return Fp8Config::from_config(cfg);
}

// A run's energy (backend/energy.h) for --json: "measured" false, with the reason, where it was not.
json energy_json(const EnergySummary& e) {
  if (!e.available) return {{"measured", false}, {"why", e.why}};
  return {{"measured", true},
          {"joules_per_step", e.joules_per_step},
          {"mean_power_w", e.mean_power_w},
          {"window_s", e.window_s},
          {"power_limit_w", e.power_limit_w},
          {"ms_per_step_at_power_limit", e.ms_at_power_limit},
          {"sm_clock_mhz_last_step", e.sm_clock_mhz},
          {"clock_limiters", e.clock_limiters}};
}

// A measurement that may be absent (< 0) as a JSON number or null; likewise an empty text.
json number_or_null(double v) { return v >= 0 ? json(v) : json(nullptr); }
json text_or_null(const std::string& v) { return v.empty() ? json(nullptr) : json(v); }

// --gemm: the FP8 linear against cuBLASLt alone, then BF16 against FP8 attention.
void run_gemm_and_attention(Backend& be, int repeats, json& out) {
  fmt::print("{:>6} {:>6} {:>6} | {:>20} | {:>20} | {:>20} | {:>20} | {:>20} | {:>25}\n", "M", "N", "K",
             "FP8 linear (+casts)", "FP8 GEMM (cuBLASLt)", "fast accumulation", "fast + bias", "BF16 linear",
             "FP8 cast of x (+col sums)");
  for (const GemmBenchRow& r : run_gemm_bench(be, repeats)) {
    const double gflop = 2.0 * static_cast<double>(r.m) * static_cast<double>(r.n) * static_cast<double>(r.k) / 1e9;
    fmt::print(
        "{:>6} {:>6} {:>6} | {:>7.3f} ms {:>6.0f} TF | {:>7.3f} ms {:>6.0f} TF | {:>7.3f} ms {:>6.0f} TF | "
        "{:>7.3f} ms {:>6.0f} TF | {:>7.3f} ms {:>6.0f} TF | {:>6.3f} ms {:>5.0f} GB/s ({:.3f})\n",
        r.m, r.n, r.k, r.fp8_linear_ms, r.fp8_linear_tflops, r.fp8_gemm_ms, r.fp8_gemm_tflops, r.fp8_gemm_fast_ms,
        gflop / r.fp8_gemm_fast_ms, r.fp8_gemm_fast_bias_ms, gflop / r.fp8_gemm_fast_bias_ms, r.linear_ms,
        r.linear_tflops, r.cast_ms, r.cast_gbps, r.cast_sums_ms);
    out["gemm"].push_back({{"m", r.m},
                           {"n", r.n},
                           {"k", r.k},
                           {"fp8_linear_ms", r.fp8_linear_ms},
                           {"fp8_gemm_ms", r.fp8_gemm_ms},
                           {"fp8_gemm_fast_ms", r.fp8_gemm_fast_ms},
                           {"fp8_gemm_fast_bias_ms", r.fp8_gemm_fast_bias_ms},
                           {"bf16_linear_ms", r.linear_ms},
                           {"fp8_linear_tflops", r.fp8_linear_tflops},
                           {"fp8_gemm_tflops", r.fp8_gemm_tflops},
                           {"bf16_linear_tflops", r.linear_tflops},
                           {"cast_ms", r.cast_ms},
                           {"cast_gbps", r.cast_gbps},
                           {"cast_column_sums_ms", r.cast_sums_ms}});
  }
  fmt::print("\nAttention, BF16 vs FP8 (cuDNN; E4M3 q, k, v, o, E5M2 dO and gradients), median ms (TFLOP/s)\n");
  fmt::print("{:>4} {:>18} | {:>17} | {:>17} | {:>17} | {:>17} | {:>9} | {:>9}\n", "", "[B, n, L, D]", "BF16 forward",
             "BF16 backward", "FP8 forward", "FP8 backward", "fwd casts", "bwd casts");
  for (const AttentionBenchRow& r : run_attention_bench(be, repeats)) {
    fmt::print(
        "{:>4} {:>18} | {:>7.3f} ({:>6.0f}) | {:>7.3f} ({:>6.0f}) | {:>7.3f} ({:>6.0f}) | {:>7.3f} ({:>6.0f}) | "
        "{:>9.3f} | {:>9.3f}\n",
        r.workload, fmt::format("[{}, {}, {}, {}]", r.batch, r.heads, r.seq, r.head_dim), r.bf16_fwd_ms,
        r.bf16_fwd_tflops, r.bf16_bwd_ms, r.bf16_bwd_tflops, r.fp8_fwd_ms, r.fp8_fwd_tflops, r.fp8_bwd_ms,
        r.fp8_bwd_tflops, r.fp8_fwd_casts_ms, r.fp8_bwd_casts_ms);
    out["attention"].push_back({{"workload", r.workload},
                                {"batch", r.batch},
                                {"heads", r.heads},
                                {"seq", r.seq},
                                {"head_dim", r.head_dim},
                                {"bf16_fwd_ms", r.bf16_fwd_ms},
                                {"bf16_bwd_ms", r.bf16_bwd_ms},
                                {"fp8_fwd_ms", r.fp8_fwd_ms},
                                {"fp8_bwd_ms", r.fp8_bwd_ms},
                                {"fp8_fwd_casts_ms", r.fp8_fwd_casts_ms},
                                {"fp8_bwd_casts_ms", r.fp8_bwd_casts_ms}});
  }
}

// --gemm: the BF16 MLP's fused epilogues, then the BF16 Linears of few rows an FP8 step keeps.
void run_epilogues_and_small_linears(Backend& be, int repeats, json& out) {
  fmt::print("\nBF16 MLP epilogues (ms, unfused -> fused): tokens M, width N, hidden K\n");
  fmt::print("{:>6} {:>6} {:>6} | {:>21} | {:>21} | {:>25} | {:>25}\n", "M", "N", "K", "linear + GELU",
             "dgrad + GELU backward", "wgrad first: no db -> db", "wgrad +=: no db -> db");
  for (const EpilogueBenchRow& r : run_epilogue_bench(be, repeats)) {
    fmt::print(
        "{:>6} {:>6} {:>6} | {:>8.3f} -> {:>8.3f} | {:>8.3f} -> {:>8.3f} | {:>10.3f} -> {:>10.3f} | "
        "{:>10.3f} -> {:>10.3f}\n",
        r.m, r.n, r.k, r.linear_gelu_unfused_ms, r.linear_gelu_ms, r.dgrad_gelu_unfused_ms, r.dgrad_gelu_ms, r.wgrad_ms,
        r.wgrad_bias_ms, r.wgrad_acc_ms, r.wgrad_acc_bias_ms);
    out["epilogues"].push_back({{"m", r.m},
                                {"n", r.n},
                                {"k", r.k},
                                {"linear_gelu_unfused_ms", r.linear_gelu_unfused_ms},
                                {"linear_gelu_ms", r.linear_gelu_ms},
                                {"dgrad_gelu_unfused_ms", r.dgrad_gelu_unfused_ms},
                                {"dgrad_gelu_ms", r.dgrad_gelu_ms},
                                {"wgrad_ms", r.wgrad_ms},
                                {"wgrad_bias_ms", r.wgrad_bias_ms},
                                {"wgrad_accumulate_ms", r.wgrad_acc_ms},
                                {"wgrad_accumulate_bias_ms", r.wgrad_acc_bias_ms}});
  }
  fmt::print("\nBF16 Linears of few rows or a narrow side (the FP8 step's `linear`, `linear_backward`), median ms\n");
  fmt::print("{:>30} {:>5} {:>6} {:>5} | {:>8} {:>9} | {:>8} | {:>8} | {:>18}\n", "", "rows", "out", "in", "forward",
             "(w GB/s)", "dgrad", "wgrad+db", "host µs fwd, dgrad");
  for (const SmallLinearBenchRow& r : run_small_linear_bench(be, repeats)) {
    fmt::print("{:>30} {:>5} {:>6} {:>5} | {:>8.4f} {:>9.0f} | {:>8.4f} | {:>8.4f} | {:>8.1f} {:>9.1f}\n", r.name,
               r.rows, r.out, r.in, r.fwd_ms, r.fwd_weight_gbps, r.dgrad_ms, r.wgrad_ms, r.fwd_host_us,
               r.dgrad_host_us);
    out["small_linears"].push_back({{"name", r.name},
                                    {"rows", r.rows},
                                    {"out", r.out},
                                    {"in", r.in},
                                    {"fwd_ms", r.fwd_ms},
                                    {"dgrad_ms", r.dgrad_ms},
                                    {"wgrad_ms", r.wgrad_ms},
                                    {"fwd_weight_gbps", r.fwd_weight_gbps},
                                    {"fwd_host_us", r.fwd_host_us},
                                    {"dgrad_host_us", r.dgrad_host_us}});
  }
}

// The runs' settings: the keys of --set over the schema's defaults, or with -c that config's
// (fp8_*, recompute_granularity, activation_precision, grad_precision, AdamW, cuda_graph).
struct RunPlan {
  std::vector<StepBenchSpec> specs;
  Config keys;
  BackendOptions backend;
};

BackendOptions backend_options(const Config& keys) {
  BackendOptions bo;
  bo.bf16_gemm = true;
  const BackendOptions keyed = BackendOptions::from_config(keys);
  bo.bf16_activations = keyed.bf16_activations;
  bo.bf16_grads = keyed.bf16_grads;
  bo.deterministic_attention = keyed.deterministic_attention;
  bo.attention_workspace_limit = keyed.attention_workspace_limit;
  return bo;
}

RunPlan plan_runs(const BenchOptions& o) {
  RunPlan plan;
  for (const std::string& kv : o.overrides) plan.keys.apply_override(kv);
  if (!o.config.empty()) {
    plan.keys = Config::load(o.config, o.overrides);
    StepBenchSpec s;
    s.model = FluxConfig::from_config(plan.keys);
    s.workload = s.model.name;
    s.shape = StepShape{plan.keys.get_int("micro_batch_size"), plan.keys.get_int("text_seq_len"),
                        s.model.image_tokens(plan.keys.get_int("image_size"))};
    plan.specs.push_back(s);
  } else {
    for (const std::string& w : o.workloads) plan.specs.push_back(workload_spec(w, FLUX8_SOURCE_DIR));
  }
  plan.backend = backend_options(plan.keys);
  place_on_node(plan.backend);  // under a launcher: this rank's GPU
  const RecomputePolicy recompute{recompute_from_name(plan.keys.get_string("recompute_granularity")),
                                  std::numeric_limits<int64_t>::max(), plan.keys.get_bool("recompute_elementwise")};
  for (StepBenchSpec& s : plan.specs) {
    s.recompute = recompute;
    s.adam = AdamWConfig::from_config(plan.keys);
    s.lr = o.lr;
    s.profile = o.profile;
    s.cuda_graph = plan.keys.get_bool("cuda_graph");
    s.data_path = o.data_path;
    s.data = o.data == "structured" ? BenchData::structured : BenchData::prototypes;
    s.steps = o.steps;
    s.micro_batches = o.micro_batches;
    s.warmup = o.warmup;
    s.seed = static_cast<uint64_t>(plan.keys.get_int("seed"));  // init, data and noise (tools/convergence.py)
    s.tensor_parallel = static_cast<int>(plan.keys.get_int("tensor_model_parallel_size"));
    s.distributed_optimizer = plan.keys.get_bool("use_distributed_optimizer");
    s.overlap_grad_reduce = plan.keys.get_bool("overlap_grad_reduce");
  }
  if (plan.keys.get_bool("cuda_graph") && o.profile && plan.keys.source("cuda_graph") != "default")
    fmt::print("note: cuda_graph is off under --profile (its per-op timing marks need every op issued on its own)\n");
  return plan;
}

// One run of a workload: its result, what the verdicts read of it, and its entry in --json's "steps".
struct WorkloadRun {
  StepBenchResult result;
  BenchRunSummary summary;
  size_t json_index = 0;
};

// The run's own lines under its table row: launch, data path, CUDA graphs, energy.
void print_run_notes(const StepBenchResult& r, const std::string& backend) {
  if (r.launch_to_first_step_s >= 0)
    fmt::print(
        "  launch to first step: {:.2f} s (this process's start to the end of its first step, the "
        "benchmark's synthetic data left out), of which {:.2f} s until the backend was up (libraries, "
        "device, cuBLASLt and cuDNN handles)\n",
        r.launch_to_first_step_s, r.launch_to_backend_s);
  if (r.data_assemble_ms >= 0)
    fmt::print(
        "  trainer data path (host, before each step; not in the step time): {:.1f} ms to assemble the "
        "batch, {:.1f} ms to upload it\n",
        r.data_assemble_ms, r.data_upload_ms);
  if (r.offload_transfer_ms >= 0 && r.offload_host_update_ms > 0)
    fmt::print(
        "  optimizer_offload: of the step, {:.1f} ms moving gradients and master weights over PCIe, {:.1f} ms "
        "of AdamW on the host and {:.1f} ms writing the weights' device forms\n",
        r.offload_transfer_ms, r.offload_host_update_ms, r.offload_update_ms);
  else if (r.offload_overlapped)
    fmt::print(
        "  optimizer_offload (overlapped): of the step, {:.1f} ms moving optimizer state over PCIe and updating its "
        "chunks on the device, at once\n",
        r.offload_update_ms);
  else if (r.offload_transfer_ms >= 0)
    fmt::print(
        "  optimizer_offload: of the step, {:.1f} ms moving optimizer state over PCIe and {:.1f} ms updating "
        "its chunks on the device\n",
        r.offload_transfer_ms, r.offload_update_ms);
  if (r.cuda_graph)
    fmt::print(
        "  cuda_graph: {:.1f} graphs a step holding {:.0f} ops, {:.0f} ops issued one by one{}\n",
        r.graph_segments_per_step, r.graph_ops_per_step, r.eager_ops_per_step,
        r.graph_capture_failures ? fmt::format(" ({} segments could not be captured)", r.graph_capture_failures) : "");
  if (r.energy.available) {
    std::string limiters;
    for (const std::string& l : r.energy.clock_limiters) limiters += (limiters.empty() ? "" : ", ") + l;
    fmt::print(
        "  energy: {:.1f} J a step, {:.0f} W on average over the timed steps' {:.2f} s{} (at the {:.0f} W "
        "limit, sustained, this energy takes {:.2f} ms a step); SM clock {:.0f} MHz in the last step{}\n",
        r.energy.joules_per_step, r.energy.mean_power_w, r.energy.window_s,
        r.energy.window_s < 3 ? ", too short to be exact: use more --steps" : "", r.energy.power_limit_w,
        r.energy.ms_at_power_limit, r.energy.sm_clock_mhz, limiters.empty() ? "" : ", held back by: " + limiters);
  } else if (backend == "cuda") {
    fmt::print("  energy: not measured ({})\n", r.energy.why);
  }
}

// --profile: every op's share of the step, the idle time by the op waited for, and the
// roofline's parts (docs/PERFORMANCE.md, Roofline).
void print_profile(const StepBenchResult& r, const std::vector<RooflinePart>& parts) {
  double total = 0;
  for (const OpTime& t : r.ops) total += t.ms_per_step;
  fmt::print("  {:<30} {:>8} {:>10} {:>7}   (profiled step: {:.2f} ms of ops and idle)\n", "op", "calls", "ms/step",
             "share", total);
  for (const OpTime& t : r.ops)
    fmt::print("  {:<30} {:>8.0f} {:>10.3f} {:>6.1f}%\n", t.op, t.calls_per_step, t.ms_per_step,
               100.0 * t.ms_per_step / total);
  // Where the idle time is: the ops the device waited to start, the largest five.
  std::string waits;
  for (size_t i = 0; i < r.idle_before.size() && i < 5; ++i)
    waits += fmt::format("{}{} {:.3f}", i ? ", " : "", r.idle_before[i].op, r.idle_before[i].ms_per_step);
  if (!waits.empty()) fmt::print("  idle before (ms/step): {}\n", waits);
  fmt::print("  roofline parts                   ms/step   share   (GEMMs and attention: model FLOPs, rate)\n");
  for (const RooflinePart& part : parts)
    fmt::print(
        "  {:<30} {:>10.3f} {:>6.1f}%{}\n", part.name, part.ms_per_step, 100.0 * part.ms_per_step / total,
        part.model_tflop > 0 ? fmt::format("   {:.4g} TFLOP at {:.4g} TFLOP/s", part.model_tflop, part.tflops()) : "");
}

// A long run is a loss curve (FP8 vs BF16): its mean per 50 steps, to compare by eye.
void print_loss_curve(const StepBenchResult& r) {
  if (r.losses.size() < 100) return;
  std::string means;
  for (size_t b = 0; b + 50 <= r.losses.size(); b += 50) {
    double sum = 0;
    for (size_t i = b; i < b + 50; ++i) sum += r.losses[i];
    means += fmt::format(" {:.4f}", sum / 50);
  }
  fmt::print("  loss per 50 steps:{}{}\n", means,
             r.non_finite_steps ? fmt::format(" ({} non-finite steps)", r.non_finite_steps) : "");
}

// A run's entry in --json's "steps".
json run_json(const StepBenchResult& r, const StepBenchSpec& s, const std::string& precision, const BenchOptions& o,
              const BackendOptions& bo, const std::vector<RooflinePart>& parts) {
  json ops = json::array(), roofline = json::array(), idle_before = json::array();
  for (const OpTime& t : r.ops)
    ops.push_back({{"op", t.op}, {"calls_per_step", t.calls_per_step}, {"ms_per_step", t.ms_per_step}});
  for (const RooflinePart& part : parts)
    roofline.push_back({{"part", part.name},
                        {"ms_per_step", part.ms_per_step},
                        {"model_tflop", part.model_tflop},
                        {"model_tflops", part.tflops()}});
  for (const OpTime& t : r.idle_before)
    idle_before.push_back({{"op", t.op}, {"waits_per_step", t.calls_per_step}, {"ms_per_step", t.ms_per_step}});
  const bool cuda = o.backend == "cuda";
  return {{"workload", r.workload},
          {"model", s.model.name},
          {"precision", precision},
          {"fp8_format", precision == "bf16" ? "" : o.format},
          {"describe", r.precision},
          {"parallel", r.parallel},
          {"gradient_buckets", r.gradient_buckets},
          {"buckets_started_in_backward", r.buckets_started_in_backward},
          {"batch", s.shape.batch},
          {"micro_batches", s.micro_batches},
          {"txt_tokens", s.shape.txt_tokens},
          {"img_tokens", s.shape.img_tokens},
          {"median_step_ms", r.median_ms},
          {"step_ms", r.step_ms},
          {"model_tflop_per_step", r.model_tflop},
          {"model_tflops", r.tflops},
          {"first_step_s", r.first_step_s},
          {"setup_s", r.setup_s},
          {"launch_to_first_step_s", number_or_null(r.launch_to_first_step_s)},
          {"peak_allocated_gib", r.peak_allocated_gib},
          {"device_used_gib", r.device_used_gib},
          {"activation_estimate_gib", r.activation_gib},
          {"first_loss", r.first_loss},
          {"last_loss", r.last_loss},
          {"losses", r.losses},
          {"non_finite_steps", r.non_finite_steps},
          {"backend", o.backend},
          {"data", o.data},
          {"activation_precision", bo.bf16_activations && cuda ? "bf16" : "f32"},
          {"grad_precision", bo.bf16_grads && cuda ? "bf16" : "f32"},
          {"deterministic_attention", bo.deterministic_attention || !cuda},
          {"deterministic_attention_workspace_mib", bo.attention_workspace_limit >> 20},
          {"adam_moment_precision", dtype_name(s.adam.moment_dtype)},
          {"cuda_graph", r.cuda_graph},
          {"graph_segments_per_step", r.graph_segments_per_step},
          {"graph_ops_per_step", r.graph_ops_per_step},
          {"eager_ops_per_step", r.eager_ops_per_step},
          {"graph_capture_failures", r.graph_capture_failures},
          {"data_assemble_ms", number_or_null(r.data_assemble_ms)},
          {"data_upload_ms", number_or_null(r.data_upload_ms)},
          {"offload_transfer_ms", number_or_null(r.offload_transfer_ms)},
          {"offload_update_ms", number_or_null(r.offload_update_ms)},
          {"offload_host_update_ms", number_or_null(r.offload_host_update_ms)},
          {"offload_overlapped", r.offload_overlapped},
          {"ops", ops},
          {"idle_before", idle_before},
          {"roofline", roofline},
          {"energy", energy_json(r.energy)}};
}

// Every precision of one workload, each on a fresh backend (its memory peak and plan caches are
// this run's alone), printed and added to --json as it finishes.
std::vector<WorkloadRun> run_workload(StepBenchSpec s, const RunPlan& plan, const BenchOptions& o, json& out) {
  std::vector<WorkloadRun> runs;
  for (const std::string& p : o.precisions) {
    s.fp8 = fp8_for(p, o.format, plan.keys);
    WorkloadRun run;
    StepBenchResult& r = run.result;
    r = run_step_bench(*make_backend(o.backend, plan.backend), s);
    run.summary = {p,
                   p == "bf16" ? "" : o.format,
                   r.median_ms,
                   r.peak_allocated_gib,
                   r.launch_to_first_step_s,
                   r.energy.available ? r.energy.joules_per_step : -1,
                   r.energy.available ? r.energy.power_limit_w : -1};
    fmt::print("{:<22} {:<28} {:>9.2f} {:>8.1f} {:>8.2f} {:>8.2f} {:>10.2f} {:>10.2f} {:>9.2f}\n",
               r.workload == s.model.name ? r.workload : r.workload + " (" + s.model.name + ")", run.summary.label(),
               r.median_ms, r.tflops, r.setup_s, r.first_step_s, r.peak_allocated_gib, r.device_used_gib,
               r.activation_gib);
    if (!r.parallel.empty())
      fmt::print(
          "  {}: each rank's step on its own micro-batch (a tensor-parallel group shares one); memory per rank{}\n",
          r.parallel,
          r.gradient_buckets == 0 ? ""
                                  : fmt::format("; gradients summed in {} buckets, {} started during the backward",
                                                r.gradient_buckets, r.buckets_started_in_backward));
    print_run_notes(r, o.backend);
    const std::vector<RooflinePart> parts =
        r.ops.empty() ? std::vector<RooflinePart>{} : roofline_parts(r.ops, model_flops(s.model, s.shape));
    if (!r.ops.empty()) print_profile(r, parts);
    print_loss_curve(r);
    std::fflush(stdout);
    run.json_index = out["steps"].size();
    out["steps"].push_back(run_json(r, s, p, o, plan.backend, parts));
    runs.push_back(std::move(run));
  }
  return runs;
}

// The workload's verdicts on flux8's targets (bench/targets.h), set for one H200: judged on
// the GPU backend only.
void print_verdicts(const std::string& workload, const std::vector<WorkloadRun>& runs,
                    const std::vector<std::string>& overrides, json& out) {
  std::vector<BenchRunSummary> summaries;
  for (const WorkloadRun& r : runs) summaries.push_back(r.summary);
  std::string sets;  // what the runs were asked to change (FP8 attention, recompute, ...)
  for (const std::string& kv : overrides) sets += " --set " + kv;
  fmt::print("  {} against flux8's targets (set for one H200){}:\n", workload,
             sets.empty() ? "" : ", runs with" + sets);
  for (const TargetVerdict& v : judge_targets(workload, summaries)) {
    fmt::print("    {}\n", describe(v));
    out["targets"].push_back({{"workload", workload},
                              {"target", v.target},
                              {"run", v.run},
                              {"value", v.value},
                              {"limit", v.limit},
                              {"unit", v.unit},
                              {"met", v.met},
                              {"joules_per_step", number_or_null(v.joules)},
                              {"joules_allowed", number_or_null(v.joules_allowed)}});
  }
  std::fflush(stdout);
}

// The name of the device the runs ran on, as tools/peer_bench.py writes it: the GPU's name as
// `flux8 check` reports it, or the CPU's (bench/peer.h).
std::string bench_device_name(const std::string& backend) {
  if (backend == "cpu") return cpu_device_name();
#if FLUX8_HAVE_CUDA
  const CudaReport report = cuda_report();
  for (const CudaReport::Line& line : report.lines)
    if (line.key == "GPU 0") return gpu_name_of_check_line(line.value);
#endif
  return "";
}

// --peer: the file, read before the runs (a malformed one fails at once), and the bench's device
// name, read after the first workload's runs: on the GPU it comes from `flux8 check`'s report,
// whose cuBLASLt and cuDNN probes must stay out of the timings and of launch to first step.
class PeerRatios {
 public:
  PeerRatios(const std::string& path, const std::string& backend) : peer_(load_peer_file(path)), backend_(backend) {}

  void print(const StepBenchSpec& s, const std::vector<WorkloadRun>& runs, json& out) {
    if (!device_) {
      device_ = bench_device_name(backend_);
      out["device"] = *device_;
      out["peer"] = {{"file", peer_.path},
                     {"device", peer_.device},
                     {"versions",
                      {{"torch", peer_.torch_version},
                       {"diffusers", text_or_null(peer_.diffusers_version)},
                       {"torchao", text_or_null(peer_.torchao_version)}}}};
    }
    const auto version = [](const std::string& v) { return v.empty() ? std::string("missing") : v; };
    fmt::print("  {} against PyTorch ({}: torch {}, diffusers {}, torchao {}; peer on {}, this bench on {}):\n",
               s.workload, peer_.path, peer_.torch_version, version(peer_.diffusers_version),
               version(peer_.torchao_version), peer_.device, device_->empty() ? "an unnamed device" : *device_);
    for (const WorkloadRun& run : runs) {
      const PeerComparison c =
          compare_to_peer(peer_, *device_, s.workload, s.shape, run.result.median_ms, run.result.peak_allocated_gib);
      fmt::print("    {}: {}\n", run.summary.label(), describe(c));
      json ratios = json::array();
      for (const PeerRatio& r : c.ratios)
        ratios.push_back({{"mode", r.mode}, {"speedup", r.speedup}, {"memory_ratio", number_or_null(r.memory_ratio)}});
      json vs = {{"ratios", ratios}, {"skipped", c.skipped}};
      if (!c.why.empty()) vs["why"] = c.why;
      out["steps"][run.json_index]["vs_peer"] = vs;
    }
    std::fflush(stdout);
  }

 private:
  PeerFile peer_;
  std::string backend_;
  std::optional<std::string> device_;
};

void run_step_benchmarks(const BenchOptions& o, json& out) {
  const RunPlan plan = plan_runs(o);
  std::optional<PeerRatios> peer;
  if (!o.peer.empty()) peer.emplace(o.peer, o.backend);
  fmt::print("{:<22} {:<28} {:>9} {:>8} {:>8} {:>8} {:>10} {:>10} {:>9}\n", "workload", "precision", "step ms",
             "TFLOP/s", "setup s", "first s", "alloc GiB", "device GiB", "act GiB");
  for (const StepBenchSpec& s : plan.specs) {
    const std::vector<WorkloadRun> runs = run_workload(s, plan, o, out);
    if (o.backend == "cuda" && !runs.empty() && workload_targets(s.workload))
      print_verdicts(s.workload, runs, o.overrides, out);
    if (peer) peer->print(s, runs, out);
  }
}

}  // namespace

Command add_bench_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "bench",
      "time whole training steps on synthetic data (the workloads W1 and W2, or a config) in BF16 and FP8 — "
      "on the GPU a workload's runs end with a verdict on each of flux8's targets, and with an energy "
      "counter (NVML) each run's joules a step, mean power and the step time that energy takes at the power "
      "limit; --peer: each run's ratios to PyTorch timed by tools/peer_bench.py on the same GPU; "
      "--gemm: FP8 linear vs raw cuBLASLt at Flux shapes, the FP8 cast alone, BF16 vs FP8 attention, and the BF16 "
      "MLP's GEMM epilogues against the ops they replace, and the BF16 Linears of few rows an FP8 step keeps");
  auto o = std::make_shared<BenchOptions>();
  add_bench_options(cmd, *o);
  return {cmd, [o]() {
            // Under a launcher every rank runs the steps (their collectives need all of them) and
            // rank 0 reports: the others' stdout goes nowhere and they write no --json.
            const bool lead = job_placement().rank == 0;
            if (!lead && !std::freopen("/dev/null", "w", stdout))
              fail("bench: cannot silence rank {}", job_placement().rank);
            json out;
            if (o->gemm) {
              Config keys;
              for (const std::string& kv : o->overrides) keys.apply_override(kv);
              const std::unique_ptr<Backend> be = make_backend(o->backend, backend_options(keys));
              run_gemm_and_attention(*be, o->steps, out);
              run_epilogues_and_small_linears(*be, o->steps, out);
            } else {
              run_step_benchmarks(*o, out);
            }
            if (!o->json_file.empty() && lead) {
              std::ofstream f(o->json_file);
              if (!f) fail("bench: cannot write {}", o->json_file);
              f << out.dump(2) << "\n";
            }
            return 0;
          }};
}

}  // namespace flux8::cli

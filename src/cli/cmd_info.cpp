// `flux8 info`: parameter counts, model FLOPs and the memory of a training step; with --tp/--dp the
// memory plan of one GPU of a parallel job (bench/memory_plan.h).
#include <fmt/core.h>

#include <algorithm>
#include <charconv>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <type_traits>

#include "backend/attention_workspace.h"
#include "bench/memory_plan.h"
#include "cli/commands.h"
#include "cli/memory_plan_report.h"
#include "cli/text_format.h"
#include "config/config.h"
#include "core/error.h"
#include "fp8/fp8_config.h"
#include "model/flops.h"
#include "model/flux_model.h"
#include "model/params.h"
#include "train/async_checkpoint.h"

namespace flux8::cli {

namespace {

// What `flux8 info` prints, computed once for both the text and the JSON output.
struct Memory {
  struct Row {
    const char* name;
    double bf16, fp8, today_bf16, today_fp8;
  };
  std::vector<Row> rows;
  Row total{"total", 0, 0, 0, 0};
  double attention_workspace = 0, checkpoint_bytes = 0, host_copy_bytes = 0;
  AttentionBackwardSplit attention_split;
  Row block_scratch{"block scratch", 0, 0, 0, 0};  // of the activations: FluxModel's scratch arena
  std::optional<uint64_t> host_available;
  bool copy_fits = false;
};

struct InfoReport {
  FluxConfig cfg;
  std::string config_path;
  int64_t pixels = 0, batch = 0, total_params = 0;
  StepShape shape;
  std::vector<std::pair<std::string, int64_t>> components;
  ModelFlops per_sample, per_step;
  std::string recompute;
  bool recompute_elementwise = true;
  bool bf16_storage = false, fp8_attention = false;
  Memory memory;
};

Memory step_memory(const Config& config, const InfoReport& r, const ActivationEstimate& act, double P,
                   int64_t block_linear_params, int64_t largest_block_linear, int64_t linear_weight_params) {
  Memory m;
  // grad_precision: bf16 stores the parameter gradients in 2 bytes (CUDA).
  const bool bf16_grads = config.get_string("grad_precision") == "bf16";
  const double grad_bytes = bf16_grads ? 2.0 : 4.0;
  // adam_moment_precision: bf16 stores the two AdamW moments in 2 bytes each.
  const bool bf16_moments = config.get_string("adam_moment_precision") == "bf16";
  const double moment_bytes = bf16_moments ? 4.0 : 8.0;
  const bool fp8_attention = r.fp8_attention, bf16_storage = r.bf16_storage;

  // Training state per parameter: bf16 weights 2 B, fp32 master 4 B, fp32 gradient 4 B (bf16: 2 B),
  // AdamW moments 8 B (bf16: 4 B). FP8 adds the E4M3 weight and its transpose (2 B) per block-Linear weight.
  // Two accounts: the design (bf16 activation storage and a bf16 weight copy), and what the
  // CUDA backend allocates today (activations in activation_precision — bf16 by default, as
  // the design; bf16 copies of the Linear weights its BF16 GEMMs read, ParamStore::operand:
  // every Linear in BF16, those outside the FP8 block Linears in FP8).
  const double fp8_copies = 2.0 * static_cast<double>(block_linear_params);
  const double bf16_linears = 2.0 * static_cast<double>(linear_weight_params);
  const double fp8_casts_today = fp8_weight_cast_bytes(config, block_linear_params, largest_block_linear);
  m.rows = {
      {"weights (bf16)", 2 * P, 2 * P, bf16_linears, bf16_linears - fp8_copies},
      {"fp8 weight copies", 0, fp8_copies, 0, fp8_casts_today},
      {"fp32 master weights", 4 * P, 4 * P, 4 * P, 4 * P},
      {bf16_grads ? "gradients (bf16)" : "fp32 gradients", grad_bytes * P, grad_bytes * P, grad_bytes * P,
       grad_bytes * P},
      {bf16_moments ? "AdamW moments (bf16)" : "AdamW moments (fp32)", moment_bytes * P, moment_bytes * P,
       moment_bytes * P, moment_bytes * P},
      {"activations", act.gpu_bytes(false), act.gpu_bytes(true, fp8_attention),
       bf16_storage ? act.gpu_bytes(false) : act.f32_bytes(false),
       bf16_storage ? act.gpu_bytes(true, fp8_attention) : act.f32_bytes(true)},
  };
  const auto scratch = [&](bool fp8, bool today) {
    const ActivationEstimate::Scratch& s = act.scratch(fp8, fp8 && fp8_attention);
    return !today || bf16_storage ? s.bf16 : s.f32;
  };
  m.block_scratch = {"block scratch", scratch(false, false), scratch(true, false), scratch(false, true),
                     scratch(true, true)};
  // Outside the table: cuDNN's deterministic BF16 attention backward keeps dP, B·heads·L² bf16
  // values or one call's share of them, in its workspace (one, reused by every block; the atomic
  // backward has none, docs/PERFORMANCE.md). FP8 attention has no such workspace.
  m.attention_split = split_attention_backward(r.batch, r.cfg.num_heads, r.shape.txt_tokens + r.shape.img_tokens,
                                               attention_workspace_limit(config));
  m.attention_workspace = config.get_bool("deterministic_attention") ? m.attention_split.dp_bytes : 0.0;
  // Checkpoints: the files hold f32 weights and f32 moments (12 B a parameter); async_save's
  // host copy holds the f32 master weights and the moments as stored, and is made only where
  // it fits in half the host memory available (train/async_checkpoint.h).
  m.checkpoint_bytes = 12.0 * P;
  m.host_copy_bytes = (4.0 + moment_bytes) * P;
  m.host_available = host_memory_available();
  m.copy_fits = AsyncCheckpointer::fits(static_cast<uint64_t>(m.host_copy_bytes), m.host_available);
  for (const Memory::Row& row : m.rows) {
    m.total.bf16 += row.bf16, m.total.fp8 += row.fp8;
    m.total.today_bf16 += row.today_bf16, m.total.today_fp8 += row.today_fp8;
  }
  return m;
}

// Every size below is bounded: from_config checks each key against the schema's range and the
// step against kMaxStepElements, so parameter counts and the activation plan fit int64, and the
// memory and FLOP totals are doubles.
InfoReport compute_info(const Config& config) {
  InfoReport r;
  r.cfg = FluxConfig::from_config(config);
  const FluxConfig& cfg = r.cfg;
  r.pixels = config.get_int("image_size");
  r.batch = config.get_int("micro_batch_size");
  r.shape = StepShape{r.batch, cfg.text_seq_len, cfg.image_tokens(r.pixels)};

  const ParamLayout layout = ParamLayout::build(cfg);
  int64_t block_linear_params = 0, largest_block_linear = 0, linear_weight_params = 0;
  for (const ParamInfo& p : layout.params()) {
    if (r.components.empty() || r.components.back().first != p.component) r.components.push_back({p.component, 0});
    r.components.back().second += p.shape.numel();
    if (p.block_linear) block_linear_params += p.shape.numel();
    if (p.block_linear) largest_block_linear = std::max(largest_block_linear, p.shape.numel());
    if (p.linear_weight) linear_weight_params += p.shape.numel();
  }
  r.total_params = layout.total();
  r.per_sample = model_flops(cfg, StepShape{1, r.shape.txt_tokens, r.shape.img_tokens});
  r.per_step = model_flops(cfg, r.shape);
  r.recompute = config.get_string("recompute_granularity");
  r.recompute_elementwise = config.get_bool("recompute_elementwise");
  const RecomputePolicy policy{recompute_from_name(r.recompute), std::numeric_limits<int64_t>::max(),
                               r.recompute_elementwise};
  // The FP8 columns' scratch plans the casts of the config's recipe (delayed E4M3 without fp8).
  const Fp8Config fp8 = Fp8Config::from_config(config);
  const ActivationEstimate act = FluxModel::estimate_activations(cfg, r.shape, policy, 1, fp8.enabled ? &fp8 : nullptr);
  r.bf16_storage = config.get_string("activation_precision") == "bf16";
  // The FP8 columns with the config's fp8_dot_product_attention (FP8 q, k, v, o kept).
  r.fp8_attention = config.get_bool("fp8_dot_product_attention");
  r.memory = step_memory(config, r, act, static_cast<double>(layout.total()), block_linear_params, largest_block_linear,
                         linear_weight_params);
  return r;
}

nlohmann::json info_json(const InfoReport& r) {
  const Memory& m = r.memory;
  nlohmann::json j;
  j["model"] = r.cfg.name;
  j["parameters"] = r.total_params;
  for (auto& [name, n] : r.components) j["parameters_by_component"][name] = n;
  j["image_size"] = r.pixels;
  j["batch"] = r.batch;
  j["text_tokens"] = r.shape.txt_tokens;
  j["image_tokens"] = r.shape.img_tokens;
  j["recompute_granularity"] = r.recompute;
  j["recompute_elementwise"] = r.recompute_elementwise;
  j["fp8_dot_product_attention"] = r.fp8_attention;
  j["flops_per_sample"] = {{"forward", r.per_sample.forward()}, {"training", r.per_sample.training()}};
  j["flops_per_step"] = {{"forward", r.per_step.forward()}, {"training", r.per_step.training()}};
  for (const Memory::Row& row : m.rows) {
    j["memory_bytes"][row.name] = {{"bf16", row.bf16}, {"fp8", row.fp8}};
    j["memory_bytes_cuda_today"][row.name] = {{"bf16", row.today_bf16}, {"fp8", row.today_fp8}};
  }
  j["deterministic_attention_workspace_bytes"] = m.attention_workspace;
  j["block_scratch_bytes"] = {{"bf16", m.block_scratch.bf16},
                              {"fp8", m.block_scratch.fp8},
                              {"today_bf16", m.block_scratch.today_bf16},
                              {"today_fp8", m.block_scratch.today_fp8}};
  j["checkpoint_bytes"] = m.checkpoint_bytes;
  j["async_save_host_copy_bytes"] = m.host_copy_bytes;
  j["async_save_copy_fits_this_host"] = m.copy_fits;
  j["memory_bytes"]["total"] = {{"bf16", m.total.bf16}, {"fp8", m.total.fp8}};
  j["memory_bytes_cuda_today"]["total"] = {{"bf16", m.total.today_bf16}, {"fp8", m.total.today_fp8}};
  return j;
}

void print_memory_text(const InfoReport& r) {
  const Memory& m = r.memory;
  fmt::print("\nmemory of a training step on the GPU     {:>12} {:>12}   {:>12} {:>12}\n", "BF16", "FP8", "today BF16",
             "today FP8");
  for (const Memory::Row& row : m.rows)
    fmt::print("  {:<38}{:>12} {:>12}   {:>12} {:>12}\n", row.name, gib(row.bf16), gib(row.fp8), gib(row.today_bf16),
               gib(row.today_fp8));
  fmt::print("  {:<38}{:>12} {:>12}   {:>12} {:>12}\n", "total", gib(m.total.bf16), gib(m.total.fp8),
             gib(m.total.today_bf16), gib(m.total.today_fp8));
  fmt::print(
      "  (BF16/FP8: the design, activations in bf16; today: what the CUDA backend allocates now,\n"
      "   activations and block scratch in {} (activation_precision), in FP8 with the casts' scratch,\n"
      "   bf16 copies of the Linear weights its BF16 GEMMs read (in FP8 those outside the block\n"
      "   Linears); not counted: cuBLASLt/cuDNN workspaces, the CUDA context; statistics fp32; FP8\n"
      "   saves Linear inputs in 1 byte (none where recomputed); recompute_granularity {} (none,\n"
      "   selective, full), recompute_elementwise {}; no optimizer sharding; see docs/MEMORY.md)\n",
      r.bf16_storage ? "bf16" : "f32", r.recompute, r.recompute_elementwise);
  fmt::print(
      "  (of the activations, the block scratch: one block's backward at a time and the model's\n"
      "   backward buffers, {} / {} / {} / {})\n",
      gib(m.block_scratch.bf16), gib(m.block_scratch.fp8), gib(m.block_scratch.today_bf16),
      gib(m.block_scratch.today_fp8));
  if (r.fp8_attention)
    fmt::print(
        "  (fp8_dot_product_attention: the FP8 columns keep every block's attention q, k, v, o as FP8\n"
        "   codes, 1 byte per element)\n");
  if (m.attention_workspace > 0)
    fmt::print(
        "  (not in the table: cuDNN's deterministic attention backward (deterministic_attention: true)\n"
        "   keeps dP in a workspace of {}, {}; false: none; FP8 attention: none)\n",
        gib(m.attention_workspace),
        m.attention_split.calls > 1
            ? fmt::format(
                  "{} (sample, head) pairs x L^2 bf16 a call, {} calls\n   (deterministic_attention_workspace_mib)",
                  m.attention_split.pairs_per_call, m.attention_split.calls)
            : std::string("batch x heads x L^2 bf16"));
  fmt::print(
      "\ncheckpoints: {:.2f} GB of files (f32 weights and AdamW moments); with a GPU written behind\n"
      "  training (async_save) from a host copy of {:.2f} GB, {}\n",
      m.checkpoint_bytes / 1e9, m.host_copy_bytes / 1e9,
      !m.host_available ? "made where it fits in half the host memory available"
      : m.copy_fits     ? fmt::format("which fits this machine ({:.1f} GB available)", *m.host_available / 1e9)
                        : fmt::format("more than half this machine's {:.1f} GB available: saves here would "
                                          "run in line",
                                      *m.host_available / 1e9));
}

// The model, its parameters and FLOPs.
void print_header_text(const InfoReport& r) {
  const FluxConfig& cfg = r.cfg;
  fmt::print("model {} ({})\n", cfg.name, r.config_path);
  fmt::print("  hidden {}, heads {} (head dim {}), mlp {}, double blocks {}, single blocks {}, guidance {}\n",
             cfg.hidden_size, cfg.num_heads, cfg.head_dim(), cfg.mlp_hidden(), cfg.num_double_blocks,
             cfg.num_single_blocks, cfg.guidance_embed ? "yes" : "no");
  fmt::print("\nparameters\n");
  for (auto& [name, n] : r.components) fmt::print("  {:<16}{:>18}\n", name, with_commas(n));
  fmt::print("  {:<16}{:>18}\n", "total", with_commas(r.total_params));
  fmt::print("\nstep: batch {} x ({} text + {} image tokens) at {} px\n", r.batch, r.shape.txt_tokens,
             r.shape.img_tokens, r.pixels);
  fmt::print("model FLOPs per sample: forward {:.2f} GFLOP, training step (fwd+bwd) {:.2f} GFLOP\n",
             r.per_sample.forward() / 1e9, r.per_sample.training() / 1e9);
  fmt::print("model FLOPs per step:   training {:.3f} TFLOP\n", r.per_step.training() / 1e12);
}

void print_info_text(const InfoReport& r) {
  print_header_text(r);
  print_memory_text(r);
}

// The value of --dp or --gpu-memory: a number in [low, high], else an error naming the option.
template <typename T>
T parse_option(const std::string& text, const char* option, T low, T high, const char* what) {
  T v{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || !(v >= low && v <= high))
    fail("{} '{}': {} must be {} from {} to {}", option, text, what,
         std::is_integral_v<T> ? "a whole number" : "a number", low, high);
  return v;
}

struct PlanOptions {
  std::string tp, dp, gpu_memory;  // as text: checked here and by the config schema
  bool distributed_optimizer = false;
  bool requested() const { return !tp.empty() || !dp.empty() || !gpu_memory.empty() || distributed_optimizer; }
};

// The plan of one GPU for --tp/--dp (tensor_model_parallel_size and use_distributed_optimizer
// from the config unless the options say otherwise).
void print_plan(Config& config, const PlanOptions& o, const InfoReport& report, bool json) {
  if (!o.tp.empty()) config.set("tensor_model_parallel_size", o.tp, "--tp");
  if (o.distributed_optimizer) config.set("use_distributed_optimizer", "true", "--distributed-optimizer");
  ParallelShape shape;
  shape.tp = static_cast<int>(config.get_int("tensor_model_parallel_size"));
  shape.dp = o.dp.empty() ? 1 : parse_option<int>(o.dp, "--dp", 1, 65536, "the data-parallel size");
  shape.distributed_optimizer = config.get_bool("use_distributed_optimizer");
  const double gpu_gib = o.gpu_memory.empty()
                             ? 80.0
                             : parse_option<double>(o.gpu_memory, "--gpu-memory", 0.001, 1e6, "the GiB of one GPU");
  const MemoryPlan plan = MemoryPlan::of(config, shape);
  const double gpu_bytes = gpu_gib * 1024.0 * 1024.0 * 1024.0;
  if (json) {
    nlohmann::json j = info_json(report);
    j["memory_plan"] = memory_plan_json(plan, gpu_bytes);
    fmt::print("{}\n", j.dump(2));
    return;
  }
  print_header_text(report);
  print_memory_plan(plan, gpu_bytes);
}

}  // namespace

Command add_info_command(CLI::App& app) {
  auto* cmd =
      app.add_subcommand("info",
                         "parameter count, model FLOPs per sample and training-step memory of a config; with --tp/--dp "
                         "the memory plan of one GPU of a parallel job");
  struct Opts {
    ConfigOptions cfg;
    std::string image_size, batch;  // as text: checked like the config keys they override
    PlanOptions plan;
    bool json = false;
  };
  auto o = std::make_shared<Opts>();
  o->cfg.add_to(*cmd);
  cmd->add_option("--image-size", o->image_size, "image side in pixels (default: config image_size)");
  cmd->add_option("--batch", o->batch, "samples per step (default: config micro_batch_size)");
  cmd->add_option("--tp", o->plan.tp,
                  "tensor-parallel size: print the memory plan of one GPU of a --tp x --dp job instead of the "
                  "single-GPU breakdown (default: config tensor_model_parallel_size)");
  cmd->add_option("--dp", o->plan.dp, "data-parallel size of the memory plan (default 1)");
  cmd->add_flag("--distributed-optimizer", o->plan.distributed_optimizer,
                "memory plan with the AdamW moments sharded over the data-parallel ranks (default: config "
                "use_distributed_optimizer)");
  cmd->add_option("--gpu-memory", o->plan.gpu_memory,
                  "GiB of one GPU, to say which recompute settings of the memory plan fit (default 80)");
  cmd->add_flag("--json", o->json, "print JSON instead of text");
  return {cmd, [o]() {
            Config config = Config::load(o->cfg.config, o->cfg.overrides);
            if (!o->image_size.empty()) config.set("image_size", o->image_size, "--image-size");
            if (!o->batch.empty()) config.set("micro_batch_size", o->batch, "--batch");
            InfoReport report = compute_info(config);
            report.config_path = o->cfg.config;
            if (o->plan.requested() || config.get_int("tensor_model_parallel_size") > 1)
              print_plan(config, o->plan, report, o->json);
            else if (o->json)
              fmt::print("{}\n", info_json(report).dump(2));
            else
              print_info_text(report);
            return 0;
          }};
}

}  // namespace flux8::cli

#include "train/train_config.h"

#include <fmt/core.h>

#include <filesystem>
#include <sstream>

#include "config/config.h"
#include "core/error.h"

namespace flux8 {

namespace {

std::vector<std::string> split_prompts(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string p;
  while (std::getline(ss, p, ';')) {
    const size_t a = p.find_first_not_of(" \t"), b = p.find_last_not_of(" \t");
    if (a != std::string::npos) out.push_back(p.substr(a, b - a + 1));
  }
  return out;
}

BatchPipelineSpec::Mode pipeline_mode(const std::string& data_overlap) {
  if (data_overlap == "on") return BatchPipelineSpec::Mode::thread;
  if (data_overlap == "off") return BatchPipelineSpec::Mode::caller;
  return BatchPipelineSpec::Mode::automatic;
}

TrainConfig::AsyncSave async_save_mode(const std::string& async_save) {
  if (async_save == "on") return TrainConfig::AsyncSave::on;
  if (async_save == "off") return TrainConfig::AsyncSave::off;
  return TrainConfig::AsyncSave::automatic;
}

void read_batches_and_schedule(const Config& cfg, TrainConfig& t) {
  t.micro_batch = cfg.get_int("micro_batch_size");
  t.global_batch = cfg.get_int("global_batch_size") ? cfg.get_int("global_batch_size") : t.micro_batch;
  if (t.global_batch % t.micro_batch)
    fail("global_batch_size {} ({}) is not a multiple of micro_batch_size {} ({})", t.global_batch,
         cfg.source("global_batch_size"), t.micro_batch, cfg.source("micro_batch_size"));
  t.accumulation = t.global_batch / t.micro_batch;
  t.train_iters = cfg.get_int("train_iters");
  t.schedule = LrSchedule{cfg.get_float("lr"), cfg.get_float("min_lr"), cfg.get_int("lr_warmup_iters"),
                          cfg.get_int("lr_decay_iters") ? cfg.get_int("lr_decay_iters") : t.train_iters,
                          cfg.get_string("lr_decay_style")};
}

void read_data(const Config& cfg, TrainConfig& t) {
  t.train_data = cfg.get_string("train_data");
  t.valid_data = cfg.get_string("valid_data");
  t.empty_prompt_file = cfg.get_string("empty_prompt_file");
  t.data_shuffle_buffer = static_cast<size_t>(cfg.get_int("data_shuffle_buffer"));
  t.data_prefetch = static_cast<size_t>(cfg.get_int("data_prefetch"));
  t.data_skip_corrupt = cfg.get_bool("data_skip_corrupt");
  t.data_overlap = pipeline_mode(cfg.get_string("data_overlap"));
  t.eval_samples = cfg.get_int("eval_samples");
  t.demo_data = cfg.get_bool("demo_data");
  t.demo_train_samples = cfg.get_int("demo_train_samples");
  t.demo_val_samples = cfg.get_int("demo_val_samples");
  t.image_size = cfg.get_int("image_size");
  if (t.demo_data) {
    if (t.model.vae_downsample != 1 || t.model.latent_channels != 3)
      fail(
          "demo_data is on ({}), but the model is not a pixel-space RGB model (set vae_downsample: 1 and "
          "latent_channels: 3, as configs/models/flux_tiny_demo.yaml does)",
          cfg.source("demo_data"));
    if (t.train_data.empty()) fail("demo_data is on but train_data is empty: set it to DIR/train-*.tar");
  }
  if (t.train_data.empty())
    fail("train_data is empty in {}: set it to your shards (a glob, a list file or a directory)", cfg.path());
}

void read_run_outputs(const Config& cfg, TrainConfig& t) {
  t.save_dir = cfg.get_string("save_dir");
  t.save_interval = cfg.get_int("save_interval");
  t.keep_last_checkpoints = cfg.get_int("keep_last_checkpoints");
  t.async_save = async_save_mode(cfg.get_string("async_save"));
  t.eval_interval = cfg.get_int("eval_interval");
  t.log_interval = cfg.get_int("log_interval");
  t.sample_prompts = split_prompts(cfg.get_string("sample_prompts"));
  t.sample_steps = cfg.get_int("sample_steps");
  t.samples_per_prompt = cfg.get_int("samples_per_prompt");
  const std::string tb = cfg.get_string("tensorboard_dir");
  t.tensorboard_dir = tb == "none" ? ""
                      : tb.empty() ? (std::filesystem::path(t.save_dir) / "tensorboard").string()
                                   : tb;
  t.log_timers_to_tensorboard = cfg.get_bool("log_timers_to_tensorboard");
  t.mlperf = {cfg.get_bool("mlperf_logging"), cfg.get_string("mlperf_submission_org"),
              cfg.get_string("mlperf_submission_platform"), cfg.get_string("mlperf_submission_division"),
              cfg.get_string("mlperf_submission_status")};
  if (t.mlperf.on && t.mlperf.org.empty())
    fail("mlperf_submission_org is empty ({}): the MLPerf log needs the submitting organisation's name",
         cfg.source("mlperf_submission_org"));
  t.target_eval_loss = cfg.get_float("target_eval_loss");
  t.sample_interval = cfg.get_int("sample_interval");
  t.sample_text_embeddings = cfg.get_string("sample_text_embeddings");
  t.sample_vae = cfg.get_string("sample_vae");
  t.sample_guidance = cfg.get_float("sample_guidance");
  const bool pixel = t.model.vae_downsample == 1;
  // Previews with nothing to draw would be a setting silently doing nothing.
  if (t.sample_interval > 0 && t.sample_text_embeddings.empty() && (!pixel || t.sample_prompts.empty()))
    fail("sample_interval is {} ({}), but there are no sample prompts: {}", t.sample_interval,
         cfg.source("sample_interval"),
         pixel ? "set sample_prompts (text, ';'-separated) or sample_text_embeddings"
               : "a latent model samples from encoded prompts: set sample_text_embeddings to a file written by "
                 "tools/encode_prompts.py");
  if (!t.sample_text_embeddings.empty() && !std::filesystem::is_regular_file(t.sample_text_embeddings))
    fail("sample_text_embeddings {} ({}): no such file; write it with tools/encode_prompts.py",
         t.sample_text_embeddings, cfg.source("sample_text_embeddings"));
}

// recompute_method / recompute_num_layers with Megatron's meaning (docs/CONFIG.md): block = the
// first N blocks recompute, the others keep their activations; uniform = every block, in groups
// of N. flux8 keeps every block's input, so a uniform group of N recomputes as N groups of 1.
RecomputePolicy read_recompute_blocks(const Config& cfg, std::vector<std::string>& warnings, int64_t num_blocks) {
  const Recompute granularity = recompute_from_name(cfg.get_string("recompute_granularity"));
  const std::string method = cfg.get_string("recompute_method");
  const int64_t n = cfg.get_int("recompute_num_layers");
  auto where = [&](const char* key) { return fmt::format("{} ({})", key, cfg.source(key)); };
  if (method == "none") {
    if (cfg.source("recompute_num_layers") != "default")
      warnings.push_back(
          fmt::format("{} has no effect without a recompute_method (block or uniform)", where("recompute_num_layers")));
    return granularity;
  }
  if (granularity == Recompute::none) {
    warnings.push_back(fmt::format("{} has no effect: recompute_granularity is none ({})", where("recompute_method"),
                                   cfg.source("recompute_granularity")));
    return granularity;
  }
  if (n < 1)
    fail("{} is {} but recompute_num_layers is not set: set it to {}", where("recompute_method"), method,
         method == "block" ? "how many blocks recompute, from the first" : "the blocks of a recompute group");
  if (method == "block") return RecomputePolicy{granularity, n};
  if (granularity == Recompute::full && n > 1)
    warnings.push_back(fmt::format(
        "{} with recompute_num_layers {}: flux8 keeps the input of every block, not one per group of {}, and "
        "re-runs each block's forward on its own (the same recomputation; the inputs of the {} blocks take a little "
        "more memory than Megatron's)",
        where("recompute_method"), n, n, num_blocks));
  return granularity;
}

// ... and recompute_elementwise: what the blocks that keep their activations recompute.
RecomputePolicy read_recompute(const Config& cfg, std::vector<std::string>& warnings, int64_t num_blocks) {
  RecomputePolicy policy = read_recompute_blocks(cfg, warnings, num_blocks);
  policy.elementwise = cfg.get_bool("recompute_elementwise");
  return policy;
}

// Megatron's seq_length is the tokens of a sample; a Flux sample's are text_seq_len text tokens
// and the image tokens of image_size, so it is accepted only where it states that sum.
void check_seq_length(const Config& cfg, const FluxConfig& model) {
  const int64_t given = cfg.get_int("seq_length");
  if (given == 0) return;
  const int64_t image = model.image_tokens(cfg.get_int("image_size"));
  if (given == model.text_seq_len + image) return;
  fail(
      "seq_length is {} ({}), but a sample of this model has text_seq_len {} ({}) + {} image tokens (image_size {} "
      "({}) / {} pixels a token, squared) = {} tokens: set text_seq_len and image_size, and remove seq_length",
      given, cfg.source("seq_length"), model.text_seq_len, cfg.source("text_seq_len"), image, cfg.get_int("image_size"),
      cfg.source("image_size"), model.vae_downsample * model.patch_size, model.text_seq_len + image);
}

}  // namespace

TrainConfig TrainConfig::from_config(const Config& cfg) {
  TrainConfig t;
  t.model = FluxConfig::from_config(cfg);
  t.objective = ObjectiveConfig::from_config(cfg);
  t.backend = cfg.get_string("backend");
  t.backend_options = BackendOptions::from_config(cfg);
  read_batches_and_schedule(cfg, t);
  t.fp8 = Fp8Config::from_config(cfg);
  t.adam = AdamWConfig::from_config(cfg);
  t.seed = static_cast<uint64_t>(cfg.get_int("seed"));
  check_seq_length(cfg, t.model);
  t.warnings = cfg.warnings();
  t.warnings.insert(t.warnings.end(), t.fp8.warnings.begin(), t.fp8.warnings.end());
  t.recompute = read_recompute(cfg, t.warnings, t.model.num_blocks());
  t.cuda_graph = cfg.get_bool("cuda_graph");
  t.cuda_graph_set = cfg.source("cuda_graph") != "default";
  t.nan_policy = cfg.get_string("nan_policy") == "halt" ? NanPolicy::halt : NanPolicy::skip;
  t.nan_max_consecutive_skips = cfg.get_int("nan_max_consecutive_skips");
  read_data(cfg, t);
  read_run_outputs(cfg, t);
  t.tensor_parallel = static_cast<int>(cfg.get_int("tensor_model_parallel_size"));
  t.pipeline_parallel = static_cast<int>(cfg.get_int("pipeline_model_parallel_size"));
  t.context_parallel = static_cast<int>(cfg.get_int("context_parallel_size"));
  if (t.pipeline_parallel != 1)
    fail(
        "pipeline_model_parallel_size is {} ({}): flux8 does not split the model into pipeline stages; set it to 1 "
        "and use tensor_model_parallel_size to split the blocks",
        t.pipeline_parallel, cfg.source("pipeline_model_parallel_size"));
  if (t.context_parallel != 1)
    fail("context_parallel_size is {} ({}): flux8 does not split sequences across ranks; set it to 1",
         t.context_parallel, cfg.source("context_parallel_size"));
  t.distributed_optimizer = cfg.get_bool("use_distributed_optimizer");
  const std::string offload = cfg.get_string("optimizer_offload");
  t.offload_masters = offload == "cpu";
  if (t.offload_masters && t.tensor_parallel > 1)
    fail(
        "optimizer_offload: cpu ({}) with tensor_model_parallel_size {}: the master weights of a tensor-parallel "
        "rank stay on its device; set optimizer_offload: moments to offload each rank's moments",
        cfg.source("optimizer_offload"), t.tensor_parallel);
  if (cfg.get_string("optimizer_offload_update") == "host" && !t.offload_masters)
    fail(
        "optimizer_offload_update: host ({}) runs AdamW on the host where the master weights and moments live, but "
        "optimizer_offload is {} ({}): set optimizer_offload: cpu, or optimizer_offload_update: device",
        cfg.source("optimizer_offload_update"), offload, cfg.source("optimizer_offload"));
  if (t.offload_masters && t.distributed_optimizer)
    fail(
        "optimizer_offload: cpu ({}) with use_distributed_optimizer: cpu keeps every rank's whole f32 master "
        "weights in its host memory; set optimizer_offload: moments to offload each rank's shard of the moments, or "
        "turn use_distributed_optimizer off",
        cfg.source("optimizer_offload"));
  t.overlap_grad_reduce = cfg.get_bool("overlap_grad_reduce");
  t.overlap_param_gather = cfg.get_bool("overlap_param_gather");
  t.distributed_timeout_s = cfg.get_float("distributed_timeout_minutes") * 60.0;
  t.config_yaml = cfg.dump();
  return t;
}

}  // namespace flux8

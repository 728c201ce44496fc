#include "config/schema.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

namespace flux8 {
namespace {

// Table helpers: one line per key keeps the table the single place to add a key.
Range at_least(double lo) { return Range{lo}; }
Range above(double lo) { return Range{lo, std::numeric_limits<double>::infinity(), true}; }
Range any() { return Range{}; }
Range between(double lo, double hi) { return Range{lo, hi}; }

// Upper bounds of the integer keys. Every integer key has one, so that sizes derived from them
// (head dim, MLP width, tokens, parameter and activation counts) cannot overflow int64 and no
// loop a key drives runs for ages; each is far beyond a 100B-parameter model trained at
// 4096 px. All are below 2^53, so a double compares them exactly.
constexpr double kMaxWidth = 65536;            // hidden_size, channels, feature dims, heads
constexpr double kMaxBlocks = 1024;            // double or single blocks
constexpr double kMaxImageSide = 16384;        // pixels
constexpr double kMaxPatch = 64;               // patch_size, vae_downsample
constexpr double kMaxTextTokens = 65536;       // text_seq_len
constexpr double kMaxMlpRatio = 64;            // MLP width / H
constexpr double kMaxBatch = 65536;            // samples in a micro-batch
constexpr double kMaxGlobalBatch = 1 << 24;    // samples in an optimizer step
constexpr double kMaxSteps = 1e9;              // step counts and intervals
constexpr double kMaxSamples = 1e9;            // sample counts
constexpr double kMaxSeed = 9007199254740991;  // 2^53 - 1

KeySpec int_key(const char* section, const char* name, int64_t def, Range r, const char* help) {
  return {name, section, KeyType::integer, def, r, {}, help};
}
KeySpec float_key(const char* section, const char* name, double def, Range r, const char* help) {
  return {name, section, KeyType::real, def, r, {}, help};
}
KeySpec bool_key(const char* section, const char* name, bool def, const char* help) {
  return {name, section, KeyType::boolean, def, any(), {}, help};
}
KeySpec string_key(const char* section, const char* name, const char* def, const char* help) {
  return {name, section, KeyType::string, std::string(def), any(), {}, help};
}
KeySpec choice_key(const char* section, const char* name, const char* def, std::vector<std::string> choices,
                   const char* help) {
  return {name, section, KeyType::choice, std::string(def), any(), std::move(choices), help};
}
KeySpec int_list_key(const char* section, const char* name, std::vector<int64_t> def, Range r, const char* help) {
  return {name, section, KeyType::int_list, std::move(def), r, {}, help};
}

// Model architecture (FluxConfig).
std::vector<KeySpec> model_keys() {
  return {
      string_key("model", "model_name", "flux_12b_schnell", "name recorded in logs and checkpoints"),
      int_key("model", "hidden_size", 3072, between(1, kMaxWidth), "hidden width H"),
      int_key("model", "num_attention_heads", 24, between(1, kMaxWidth), "attention heads n; head dim = H / n"),
      int_key("model", "num_double_blocks", 19, between(0, kMaxBlocks), "double-stream (MMDiT) blocks"),
      int_key("model", "num_single_blocks", 38, between(0, kMaxBlocks), "single-stream blocks"),
      int_key("model", "in_channels", 64, between(1, kMaxWidth), "features per image token (channels x patch^2)"),
      int_key("model", "out_channels", 0, between(0, kMaxWidth), "output features per token; 0 = in_channels"),
      int_key("model", "context_dim", 4096, between(1, kMaxWidth), "text-encoder (T5) features per text token"),
      int_key("model", "vec_dim", 768, between(1, kMaxWidth), "pooled text (CLIP) features"),
      float_key("model", "mlp_ratio", 4.0, Range{0, kMaxMlpRatio, true}, "MLP hidden width = mlp_ratio * H"),
      bool_key("model", "guidance_embed", false, "embed the guidance scale (dev models)"),
      bool_key("model", "qkv_bias", true, "qkv projections have a bias"),
      int_list_key("model", "axes_dim", {16, 56, 56}, between(1, kMaxWidth),
                   "RoPE width per position axis; even, sums to head dim"),
      float_key("model", "rope_theta", 10000.0, above(0), "RoPE base"),
      float_key("model", "qk_norm_eps", 1e-6, above(0), "epsilon of the q/k RMSNorm"),
      float_key("model", "layernorm_eps", 1e-6, above(0), "epsilon of the affine-free LayerNorms"),
      int_key("model", "latent_channels", 16, between(1, kMaxWidth),
              "channels of the latent (or pixel) image before patching"),
      int_key("model", "patch_size", 2, between(1, kMaxPatch), "side of the square patch packed into one token"),
      int_key("model", "vae_downsample", 8, between(1, kMaxPatch), "pixels per latent cell; 1 = pixel-space model"),
      int_key("model", "text_seq_len", 256, between(1, kMaxTextTokens), "text tokens per sample"),
      int_key("model", "image_size", 256, between(1, kMaxImageSide), "training image side in pixels"),
  };
}

// Runtime: backend, threads, precisions.
std::vector<KeySpec> runtime_keys() {
  return {
      int_key("runtime", "seed", 1234, between(0, kMaxSeed), "seed of every random stream"),
      int_key("runtime", "micro_batch_size", 1, between(1, kMaxBatch), "samples per forward/backward"),
      choice_key(
          "runtime", "backend", "cpu", {"cpu", "cuda", "auto"},
          "compute backend: cpu, cuda, or auto (cuda when this build has it and a usable GPU is present, else cpu)"),
      bool_key("runtime", "round_activations_to_bf16", false,
               "CPU: round activations to bf16 like the GPU stores them"),
      choice_key("runtime", "gemm_precision", "bf16", {"bf16", "f32"},
                 "CUDA: operands of the non-FP8 GEMMs (bf16 tensor cores, fp32 accumulation; f32: exact, slow, only "
                 "with activation_precision f32: bf16 activations always give bf16 operands); the CPU computes in f32"),
      choice_key("runtime", "activation_precision", "bf16", {"bf16", "f32"},
                 "CUDA: storage type of activations and their gradients (bf16 halves their memory and traffic; the "
                 "GEMMs then take bf16 operands); parameters, gradients and optimizer state stay f32 (but see "
                 "grad_precision). The CPU's twin is round_activations_to_bf16"),
      choice_key(
          "runtime", "grad_precision", "bf16", {"f32", "bf16"},
          "CUDA: storage type of the parameter gradients. bf16: each gradient GEMM and column sum rounds its fp32 sum "
          "to bf16 as it stores it (what PyTorch autocast and torchao give a bf16 weight's gradient; micro-batches add "
          "in fp32 and round once more each), halving the gradients' memory and the gradient norm's and AdamW's reads "
          "of them; master weights stay f32. Trains as f32 does within the noise (docs/FP8.md, defaults). The CPU "
          "keeps f32 gradients"),
      bool_key(
          "runtime", "cuda_graph", true,
          "CUDA: run each micro-batch's forward, loss and backward as CUDA graphs: the op calls are recorded with "
          "every argument, and a segment of them identical to one seen before is launched as the graph captured from "
          "it (one launch instead of ~48), so the GPU stops waiting for the host's launches; anything that differs "
          "runs op by op. Same results bit for bit (false: every op issued on its own). The CPU ignores it"),
      bool_key("runtime", "deterministic_attention", true,
               "CUDA: cuDNN's deterministic attention backward, so that runs repeat bit for bit and a resumed run is "
               "the uninterrupted one exactly (false: its faster backward, which sums dq with atomics in an order that "
               "varies from run to run, as PyTorch's SDPA does: faster, and without the deterministic backward's dP "
               "workspace, docs/PERFORMANCE.md; FP8 attention has only that one). FLUX8_ATTENTION_DETERMINISTIC=0 or 1 "
               "overrides it. The CPU ignores it"),
      int_key("runtime", "deterministic_attention_workspace_mib", 1024, between(0, 1 << 20),
              "CUDA: the most MiB that cuDNN's deterministic attention backward keeps dP in (batch x heads x L^2 "
              "bf16 values): a larger backward runs as several calls over groups of (sample, head) pairs, each "
              "pair's gradients the same bit for bit; 0 = one call, however large (docs/MEMORY.md). The CPU, FP8 "
              "attention and the atomic backward (deterministic_attention: false) keep no dP"),
      int_key("runtime", "threads", 0, between(0, 4096), "CPU threads (OpenMP and OpenBLAS); 0 = all cores"),

  };
}

// Training: optimizer and schedule.
std::vector<KeySpec> training_keys() {
  return {
      int_key("training", "train_iters", 1000, between(1, kMaxSteps), "optimizer steps of the run"),
      choice_key("training", "recompute_granularity", "none", {"none", "selective", "full"},
                 "activation recomputation: none; selective (drop q/k/v and the attention and GELU outputs that feed a "
                 "Linear, recompute them in the backward without GEMMs); or full (keep only block inputs; re-run each "
                 "block's forward in the backward)"),
      bool_key("training", "recompute_elementwise", true,
               "blocks that keep their activations (recompute_granularity none or selective) keep only GEMM and "
               "attention outputs, block inputs and statistics, and recompute the element-wise and layout results "
               "from them in the backward: the LayerNorm + modulation and GELU outputs, the residual between "
               "attention and MLP, QK-norm + RoPE'd q/k/v, o in token layout (in FP8 the Linear inputs' casts), as "
               "torch.compile's partitioner does; the same gradients, less memory, a few element-wise passes more "
               "per block (docs/MEMORY.md). false: none keeps them all, selective recomputes only q/k/v and the "
               "attention and GELU outputs"),
      choice_key("training", "recompute_method", "none", {"none", "block", "uniform"},
                 "Megatron's choice of the blocks recompute_granularity applies to (double blocks counted first, "
                 "then single): block = the first recompute_num_layers blocks, the others keep every activation; "
                 "uniform = every block, in groups of recompute_num_layers (flux8 keeps each block's input, so a "
                 "group of N recomputes as N groups of 1: the same work, a little more memory; docs/CONFIG.md); "
                 "none (or null) = every block"),
      int_key("training", "recompute_num_layers", 0, between(0, 2 * kMaxBlocks),
              "blocks of recompute_method (block: how many, from the first; uniform: the group size); needed "
              "with a recompute_method"),
      int_key("training", "seq_length", 0, between(0, kMaxTextTokens + kMaxImageSide * kMaxImageSide),
              "Megatron's tokens per sample, accepted when it equals text_seq_len + the image tokens of image_size "
              "(a check, nothing else); any other value is an error naming the two keys to set. 0 = not given"),
      int_key("training", "global_batch_size", 0, between(0, kMaxGlobalBatch),
              "samples per optimizer step (a multiple of micro_batch_size); 0 = micro_batch_size"),
      choice_key("training", "optimizer", "adamw", {"adamw", "adam"},
                 "the optimizer: AdamW with decoupled weight decay (Megatron's adam is the same optimizer); flux8 "
                 "has no other"),
      float_key("training", "lr", 1e-4, above(0), "peak learning rate"),
      float_key("training", "min_lr", 0.0, at_least(0), "learning rate at the end of the decay"),
      int_key("training", "lr_warmup_iters", 0, between(0, kMaxSteps), "steps of linear warmup from 0 to lr"),
      choice_key("training", "lr_decay_style", "constant", {"constant", "cosine", "linear"}, "decay after warmup"),
      int_key("training", "lr_decay_iters", 0, between(0, kMaxSteps),
              "step at which the decay reaches min_lr; 0 = train_iters"),
      float_key("training", "adam_beta1", 0.9, Range{0, 1}, "AdamW beta1"),
      float_key("training", "adam_beta2", 0.95, Range{0, 1}, "AdamW beta2"),
      float_key("training", "adam_eps", 1e-8, above(0), "AdamW epsilon"),
      choice_key("training", "adam_moment_precision", "bf16", {"f32", "bf16"},
                 "storage type of the AdamW moments exp_avg and exp_avg_sq (Megatron's --exp-avg-dtype and "
                 "--exp-avg-sq-dtype). bf16: each update reads them widened, computes in fp32 and stores them rounded "
                 "stochastically (unbiased to 1/512 of a bf16 ulp, so a small beta2 step is not lost; the random bits "
                 "are a hash of step and element: reproducible, the same on CPU and GPU) — 4 bytes a parameter less "
                 "memory and 8 less AdamW traffic; trains as f32 does within the noise (docs/FP8.md, defaults); master "
                 "weights stay f32 and checkpoints store the moments as F32"),
      choice_key("training", "optimizer_offload", "none", {"none", "moments", "cpu"},
                 "what of the optimizer's state lives in host memory (after DeepSpeed's ZeRO-Offload), streamed "
                 "through the device a chunk at a time for each update: the same update, bit for bit, at the cost "
                 "of moving it over PCIe twice a step. moments: the AdamW moments (with use_distributed_optimizer "
                 "each rank offloads its shard). cpu: the moments and the f32 master weights; the device keeps the "
                 "weights only as the model reads them (bf16 copies, FP8 casts, the small f32 tensors) — 4 bytes a "
                 "parameter less than moments; not with use_distributed_optimizer nor with "
                 "tensor_model_parallel_size > 1"),
      choice_key("training", "optimizer_offload_update", "device", {"device", "host"},
                 "optimizer_offload: cpu — where AdamW runs: device streams each chunk's masters and moments "
                 "through the device and back; host runs it on the host's cores where they live, the gradients "
                 "coming down and the new masters going up (a third of the PCIe bytes), bit for bit the same"),
      bool_key("training", "optimizer_offload_overlap", true,
               "optimizer_offload with the device update — true: the chunks pass through two device buffers in "
               "turn, one chunk coming up while the one before is updated and the one before that goes down (both "
               "PCIe directions at once); false: one buffer, each chunk's transfers and update one after another, "
               "half the device memory of the chunks. The same bits either way"),
      int_key(
          "training", "optimizer_offload_chunk", int64_t{1} << 26, between(64, int64_t{1} << 34),
          "optimizer_offload: elements of each moment (and of the masters, with cpu) the device holds at a time (whole "
          "parameters: a chunk grows past this to end at a parameter's end); larger chunks mean fewer, longer "
          "copies. With use_distributed_optimizer also the elements of the device buffer a checkpoint gathers the "
          "shards through"),
      choice_key("training", "exp_avg_dtype", "bf16", {"fp32", "bf16"},
                 "Megatron's name for adam_moment_precision (fp32 = f32): setting it sets that key; with "
                 "exp_avg_sq_dtype both must agree (flux8 stores the two moments in one type)"),
      choice_key("training", "exp_avg_sq_dtype", "bf16", {"fp32", "bf16"},
                 "Megatron's name for adam_moment_precision, as exp_avg_dtype"),
      float_key("training", "weight_decay", 0.1, at_least(0), "AdamW decoupled weight decay"),
      float_key("training", "clip_grad", 1.0, at_least(0), "clip the global gradient norm to this; 0 = no clipping"),

  };
}

// The rectified-flow objective.
std::vector<KeySpec> objective_keys() {
  return {
      choice_key("objective", "timestep_sampling", "uniform", {"uniform", "logit_normal"},
                 "distribution of t (MLPerf: uniform)"),
      float_key("objective", "logit_mean", 0.0, any(), "mean of the logit-normal t"),
      float_key("objective", "logit_std", 1.0, above(0), "std of the logit-normal t"),
      bool_key("objective", "timestep_shift", false, "shift t towards noise for large images (as in sampling)"),
      float_key("objective", "text_dropout", 0.1, Range{0, 1},
                "probability of training with the empty prompt (T5 and CLIP together)"),
      float_key("objective", "vae_scale_factor", 0.3611, above(0), "latent normalisation: scale * (z - shift)"),
      float_key("objective", "vae_shift_factor", 0.1159, any(), "latent normalisation shift"),
      float_key("objective", "train_guidance", 1.0, at_least(0),
                "guidance input during training (guidance_embed models)"),

  };
}

// Data.
std::vector<KeySpec> data_keys() {
  return {
      string_key("data", "train_data", "", "training shards: a glob (data/train-*.tar), a list file or a directory"),
      string_key("data", "valid_data", "", "validation shards (same forms); empty = no validation"),
      string_key("data", "empty_prompt_file", "",
                 "safetensors with t5 and clip of the empty prompt (text dropout); empty = zeros"),
      int_key("data", "data_shuffle_buffer", 1000, between(0, 1e6), "samples in the shuffle buffer; 0 = no shuffling"),
      int_key("data", "data_prefetch", 64, between(1, 65536), "samples decoded ahead by the loader thread"),
      choice_key("data", "data_overlap", "auto", {"auto", "on", "off"},
                 "build and upload micro-batch k + 1 (loader, VAE draw, patches, text features, the copy to the "
                 "device) on a thread of its own while the device computes k, into two device input buffers (on: "
                 "always; off: on the training thread before each micro-batch; auto: on with the CUDA backend, off on "
                 "the CPU, whose cores compute the step). Same results either way"),
      bool_key("data", "data_skip_corrupt", false,
               "skip a sample that fails to decode (and the rest of a shard whose tar framing is broken) with a "
               "warning naming shard and member, instead of stopping"),
      bool_key("data", "demo_data", false,
               "generate the embedded demo dataset into train_data's directory when it has no shards"),
      int_key("data", "demo_train_samples", 4000, between(1, 1e6), "demo dataset: training samples"),
      int_key("data", "demo_val_samples", 256, between(1, 1e6), "demo dataset: validation samples"),

  };
}

// The run: checkpoints, evaluation, logging, samples.
std::vector<KeySpec> run_keys() {
  return {
      string_key("run", "save_dir", "runs/flux8", "directory of checkpoints, metrics.jsonl and samples"),
      int_key("run", "save_interval", 0, between(0, kMaxSteps),
              "checkpoint every N steps (and at the end); 0 = only at the end"),
      int_key("run", "keep_last_checkpoints", 3, between(0, 1e6), "checkpoints kept; 0 = keep all"),
      choice_key("run", "async_save", "auto", {"auto", "on", "off"},
                 "write checkpoints behind training: a save waits only for a host copy of the parameters and AdamW "
                 "moments, then a thread of its own converts, hashes and writes the same files while the next steps "
                 "run, one save in flight (on: when the copy fits in half the host memory available at the start, else "
                 "in line; off: each save in line, training waits for it; auto: on with the CUDA backend, off on the "
                 "CPU, whose cores compute the step)"),
      int_key("run", "eval_interval", 0, between(0, kMaxSteps),
              "validate every N steps (and at step 0 and the end); 0 = only at the start and end"),
      int_key("run", "eval_samples", 0, between(0, kMaxSamples), "validation samples used; 0 = all"),
      int_key("run", "log_interval", 1, between(1, kMaxSteps), "metrics line every N steps"),
      string_key("run", "sample_prompts", "",
                 "prompts of the sample grids (previews, end of run), separated by ';' (pixel-space models)"),
      int_key("run", "sample_steps", 20, between(1, 10000), "Euler steps of the samples (previews, end of run)"),
      int_key("run", "samples_per_prompt", 4, between(1, 256), "images per prompt in the sample grids"),
      int_key(
          "run", "sample_interval", 0, between(0, kMaxSteps),
          "a preview grid of the sample prompts into save_dir/samples/ every N steps; 0 = only the end-of-run grid"),
      string_key("run", "sample_text_embeddings", "",
                 "latent models: the sample prompts as T5/CLIP encodings (tools/encode_prompts.py), for the previews "
                 "and the end-of-run grid"),
      string_key("run", "sample_vae", "",
                 "latent models: the VAE that decodes samples to PNG through tools/decode_latents.py (a local "
                 "directory or a Hugging Face id); empty = samples kept as latents"),
      float_key("run", "sample_guidance", 3.5, Range{0, 100},
                "guidance-embedding input of the samples (guidance_embed models, e.g. FLUX.1-dev)"),
      string_key("run", "tensorboard_dir", "",
                 "directory of the TensorBoard event files (events.out.tfevents.*, written by rank 0): \"\" = "
                 "SAVE_DIR/tensorboard; none = no event files"),
      bool_key("run", "log_timers_to_tensorboard", false,
               "also write the timers (step, data wait/read/assemble/upload, validation, checkpoint save) to "
               "TensorBoard under timers/ (Megatron's key)"),
      bool_key("run", "mlperf_logging", false,
               "write SAVE_DIR/mlperf.log: the MLPerf Training log (`:::MLLOG` lines) of the Flux benchmark"),
      string_key("run", "mlperf_submission_org", "flux8", "MLPerf log: submission_org"),
      string_key("run", "mlperf_submission_platform", "",
                 "MLPerf log: submission_platform; \"\" = the backend's device name"),
      choice_key("run", "mlperf_submission_division", "open", {"open", "closed"}, "MLPerf log: submission_division"),
      choice_key("run", "mlperf_submission_status", "onprem", {"onprem", "cloud", "preview", "research"},
                 "MLPerf log: submission_status"),
      float_key("run", "target_eval_loss", 0, between(0, 1e30),
                "stop the run, after a checkpoint (MLPerf run_stop status success), at the first validation after "
                "training began whose loss is at or below this; 0 = no target (MLPerf Flux: 0.586)"),

  };
}

// FP8 (Transformer Engine semantics; Megatron/Primus key names).
std::vector<KeySpec> fp8_keys() {
  return {
      choice_key("fp8", "fp8", "none", {"none", "e4m3", "hybrid"},
                 "FP8 training: e4m3 everywhere, or hybrid (E4M3 forward, E5M2 gradients); none (or null) = BF16"),
      choice_key("fp8", "fp8_recipe", "delayed", {"delayed", "tensorwise", "blockwise", "mxfp8"}, "scaling recipe"),
      int_key("fp8", "fp8_margin", 0, between(0, 64), "delayed: scale = fp8_max * 2^-margin / amax"),
      int_key("fp8", "fp8_amax_history_len", 1024, between(1, 65536), "delayed: steps of amax history"),
      choice_key("fp8", "fp8_amax_compute_algo", "max", {"max", "most_recent"},
                 "delayed: amax from the history window's max or the newest value"),
      bool_key("fp8", "fp8_wgrad", true, "compute weight gradients in FP8; false = from the BF16 operands"),
      choice_key(
          "fp8", "fp8_weight_transpose", "auto", {"auto", "keep", "in_backward"},
          "the dgrad operand of each FP8 weight: keep its transposed cast from the weight's cast (1 byte a "
          "parameter), or transpose the rowwise cast into one shared buffer in each Linear's backward (per-tensor "
          "recipes: delayed, tensorwise); auto: in_backward with a per-tensor recipe, else keep"),
      choice_key("fp8", "fp8_scale_rounding", "auto", {"auto", "power_of_2", "exact"},
                 "tensorwise/blockwise scales: auto = power_of_2 for blockwise, exact for tensorwise"),
      bool_key("fp8", "fp8_modulation", false, "also run the modulation Linears in FP8 (they see one row per sample)"),
      bool_key("fp8", "fp8_dot_product_attention", false,
               "attention of the FP8 blocks in FP8 (cuDNN's FP8 SDPA; needs fp8: hybrid, fp8_recipe: delayed, head dim "
               "128 and sequence lengths that are multiples of 64 on the GPU)"),
      bool_key(
          "fp8", "fp8_fprop_fast_accumulation", true,
          "forward GEMMs keep their running sum in the tensor cores' accumulator (Hopper FP8 fast accumulation: faster "
          "forward GEMMs; Transformer Engine's fprop and torchao's default); false = split fp32 accumulation as the "
          "gradient GEMMs. Per-tensor recipes (delayed, tensorwise) only; the CPU backend sums in fp32 either way"),
      bool_key("fp8", "fp8_multi_head_attention", false,
               "FP8 attention including the qkv/proj boundaries (not implemented: an error when true)"),
      bool_key("fp8", "first_last_layers_bf16", false,
               "keep the first/last blocks (double blocks counted first, then single) in BF16"),
      int_key("fp8", "num_layers_at_start_in_bf16", 1, between(0, 2 * kMaxBlocks),
              "blocks kept in BF16 at the start (with first_last_layers_bf16)"),
      int_key("fp8", "num_layers_at_end_in_bf16", 1, between(0, 2 * kMaxBlocks),
              "blocks kept in BF16 at the end (with first_last_layers_bf16)"),
      int_key("fp8", "fp8_stats_interval", 100, between(0, kMaxSteps),
              "FP8 telemetry (amax, scale, saturation, underflow per tensor) every N steps, counted only on those "
              "steps; 0 = off"),
      float_key("fp8", "fp8_underflow_warning", 0.05, between(0, 1),
                "the FP8 health report (every fp8_stats_interval steps) warns, naming the tensor and the remedy, "
                "when a cast flushes more than this fraction of a tensor's non-zero values to zero; 0 = never"),
      float_key("fp8", "fp8_saturation_warning", 0.001, between(0, 1),
                "the FP8 health report warns when a cast clamps more than this fraction of a tensor's values to the "
                "format's largest; 0 = never"),
      choice_key("training", "nan_policy", "skip", {"skip", "halt"},
                 "non-finite loss or gradient: skip the step (weights kept) or stop at once"),
      int_key("training", "nan_max_consecutive_skips", 10, between(1, kMaxSteps),
              "with nan_policy skip: stop after this many bad steps in a row"),
  };
}

// How a job of several ranks splits the work (Megatron's key names; docs/DISTRIBUTED.md).
std::vector<KeySpec> parallel_keys() {
  return {
      int_key("parallel", "tensor_model_parallel_size", 1, between(1, 1024),
              "ranks that split each block's attention heads and MLP (Megatron-style, neighbouring ranks); the "
              "job's ranks / this = the data-parallel size"),
      int_key("parallel", "pipeline_model_parallel_size", 1, between(1, 1024),
              "pipeline stages: 1 (flux8 does not split the model into stages; other values are refused)"),
      int_key("parallel", "context_parallel_size", 1, between(1, 1024),
              "ranks that split a sequence: 1 (sequences are not split; other values are refused)"),
      bool_key("parallel", "use_distributed_optimizer", false,
               "Megatron's distributed optimizer: each data-parallel rank keeps and updates only its shard of the "
               "f32 master weights and the AdamW moments; gradients are reduce-scattered and every rank's device "
               "forms of the weights made from the updated masters, gathered a window at a time"),
      bool_key("parallel", "overlap_grad_reduce", false,
               "data parallelism: each 2^24-element gradient bucket's reduction starts during the step's last "
               "backward as soon as the bucket's gradients are final (off: after that backward); the same "
               "collectives in the same order, so the same bits either way. With more than one data-parallel "
               "rank it turns `cuda_graph` off (docs/DISTRIBUTED.md)"),
      bool_key("parallel", "overlap_param_gather", false,
               "accepted for Megatron configs; with use_distributed_optimizer the updated weights are gathered "
               "right after the update (overlapping the gather with the next step is not implemented)"),
      float_key("parallel", "distributed_timeout_minutes", 10, above(0),
                "a collective that waits longer than this for the other ranks ends the job, naming the rank"),
  };
}

// Defaults are the flux_12b_schnell model (docs/FLUX.md) so an empty config is a real model.
std::vector<KeySpec> make_keys() {
  std::vector<KeySpec> keys;
  for (auto section :
       {model_keys, runtime_keys, training_keys, objective_keys, data_keys, run_keys, fp8_keys, parallel_keys}) {
    std::vector<KeySpec> part = section();
    keys.insert(keys.end(), std::make_move_iterator(part.begin()), std::make_move_iterator(part.end()));
  }
  return keys;
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string format_number(double v) {
  // fmt's "{}" is the shortest text that round-trips; keep a '.' or exponent so the YAML
  // reader sees a float.
  std::string s = fmt::format("{}", v);
  if (std::isfinite(v) && s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

// A YAML double-quoted string; control characters escaped so that dump() loads back.
std::string quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\')
      out += '\\', out += c;
    else if (u < 0x20 || u == 0x7f)
      out += fmt::format("\\x{:02x}", u);
    else
      out += c;
  }
  return out + "\"";
}

}  // namespace

const std::vector<KeyAlias>& config_key_aliases() {
  static const std::vector<KeyAlias> aliases = {
      {"exp_avg_dtype", "adam_moment_precision", {{"fp32", "f32"}, {"bf16", "bf16"}}},
      {"exp_avg_sq_dtype", "adam_moment_precision", {{"fp32", "f32"}, {"bf16", "bf16"}}},
  };
  return aliases;
}

const KeyAlias* find_key_alias(std::string_view name) {
  for (const KeyAlias& a : config_key_aliases())
    if (a.alias == name) return &a;
  return nullptr;
}

namespace {
// Whole bounds as integers (65536, 1000000000), not as "1e+09".
std::string format_bound(double v) {
  if (v == std::trunc(v) && std::fabs(v) <= 9007199254740992.0) return fmt::format("{}", static_cast<int64_t>(v));
  return fmt::format("{}", v);
}
}  // namespace

std::string Range::describe() const {
  const bool has_lo = std::isfinite(lo), has_hi = std::isfinite(hi);
  if (has_lo && has_hi) return fmt::format("in {}{}, {}]", lo_open ? "(" : "[", format_bound(lo), format_bound(hi));
  if (has_lo) return fmt::format("{} {}", lo_open ? ">" : ">=", format_bound(lo));
  if (has_hi) return fmt::format("<= {}", format_bound(hi));
  return "";
}

const std::vector<KeySpec>& config_keys() {
  static const std::vector<KeySpec> keys = make_keys();
  return keys;
}

const KeySpec* find_config_key(std::string_view name) {
  for (const KeySpec& k : config_keys())
    if (k.name == name) return &k;
  return nullptr;
}

std::string closest_config_key(std::string_view name) {
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const KeySpec& k : config_keys()) {
    const size_t d = edit_distance(name, k.name);
    if (d < best_d) best_d = d, best = k.name;
  }
  // Farther than a third of the name is a different word, not a typo...
  if (best_d <= std::max<size_t>(2, name.size() / 3)) return best;
  // ...unless it is an abbreviation of a key (micro_batch -> micro_batch_size).
  best.clear();
  if (name.size() < 4) return best;
  for (const KeySpec& k : config_keys())
    if (k.name.find(name) != std::string::npos && (best.empty() || k.name.size() < best.size())) best = k.name;
  return best;
}

std::string_view key_type_name(KeyType t) {
  switch (t) {
    case KeyType::integer: return "int";
    case KeyType::real: return "float";
    case KeyType::boolean: return "bool";
    case KeyType::string: return "string";
    case KeyType::choice: return "enum";
    case KeyType::int_list: return "int list";
    case KeyType::float_list: return "float list";
  }
  return "?";
}

std::string format_config_value(const ConfigValue& v) {
  struct Formatter {
    std::string operator()(int64_t x) const { return fmt::format("{}", x); }
    std::string operator()(double x) const { return format_number(x); }
    std::string operator()(bool x) const { return x ? "true" : "false"; }
    std::string operator()(const std::string& x) const { return quote(x); }
    std::string operator()(const std::vector<int64_t>& x) const { return fmt::format("[{}]", fmt::join(x, ", ")); }
    std::string operator()(const std::vector<double>& x) const {
      std::vector<std::string> parts;
      for (double d : x) parts.push_back(format_number(d));
      return fmt::format("[{}]", fmt::join(parts, ", "));
    }
  };
  return std::visit(Formatter{}, v);
}

std::string format_key_value(const KeySpec& spec, const ConfigValue& v) {
  if (spec.type == KeyType::choice) return std::get<std::string>(v);
  return format_config_value(v);
}

std::string describe_allowed(const KeySpec& spec) {
  const std::string range = spec.range.describe();
  const std::string suffix = range.empty() ? "" : " " + range;
  switch (spec.type) {
    case KeyType::integer: return "an integer" + suffix;
    case KeyType::real: return "a number" + suffix;
    case KeyType::boolean: return "true or false";
    case KeyType::string: return "a string";
    case KeyType::choice: return fmt::format("one of: {}", fmt::join(spec.choices, ", "));
    case KeyType::int_list: return "a list of integers" + (range.empty() ? "" : ", each" + suffix);
    case KeyType::float_list: return "a list of numbers" + (range.empty() ? "" : ", each" + suffix);
  }
  return "?";
}

std::string describe_keys() {
  constexpr const char* kRow = "  {:<28} {:<10} {:<20} {:<12} {}\n";
  std::string out = fmt::format(kRow, "key", "type", "default", "allowed", "meaning");
  std::string section;
  for (const KeySpec& k : config_keys()) {
    if (k.section != section) {
      section = k.section;
      out += fmt::format("\n[{}]\n", section);
    }
    std::string allowed = k.type == KeyType::choice ? fmt::format("{}", fmt::join(k.choices, "|")) : k.range.describe();
    out += fmt::format(kRow, k.name, key_type_name(k.type), format_key_value(k, k.default_value), allowed, k.help);
  }
  return out;
}

}  // namespace flux8

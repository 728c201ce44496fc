#pragma once
// The rectified-flow training objective (docs/FLUX.md, MLPerf Flux reference): from raw
// samples to the model's inputs. Every random draw comes from the counter-based RNG keyed by
// (seed, step, rank, sample), so a run is reproducible, independent of thread count and of how
// the global batch is split into micro-batches, and a resumed run continues exactly.
#include <cstdint>
#include <string>
#include <vector>

#include "data/sample.h"
#include "model/flux_config.h"

namespace flux8 {

class Config;

struct ObjectiveConfig {
  std::string timestep_sampling = "uniform";  // uniform (MLPerf) | logit_normal
  double logit_mean = 0.0, logit_std = 1.0;
  bool timestep_shift = false;  // resolution-dependent shift of t (as in sampling)
  double text_dropout = 0.1;    // probability of replacing T5 and CLIP by the empty prompt
  double vae_scale = 0.3611, vae_shift = 0.1159;
  double train_guidance = 1.0;  // guidance input of guidance-embedding models during training
  static ObjectiveConfig from_config(const Config& cfg);
};

// What each random draw is for; part of the RNG stream key.
enum class Draw : uint64_t { timestep = 1, flow_noise = 2, vae_noise = 3, text_dropout = 4 };

// Stream of a training sample: `index` is the sample's position in the global batch of the
// step (0 .. global_batch−1), so micro-batching does not change any draw.
uint64_t train_stream(uint64_t step, uint64_t rank, uint64_t index, Draw what);
// Stream of validation sample j: fixed for the whole run.
uint64_t validation_stream(uint64_t j, Draw what);

// The empty-prompt encodings that replace dropped captions.
struct EmptyPrompt {
  HostTensor t5, clip;
};

// A batch ready to upload: x0 packed into tokens, conditioning, t per sample, noise streams.
struct HostBatch {
  int64_t batch = 0, txt_tokens = 0, img_tokens = 0;
  // The per-sample tensors in f32, as the samples hold them and the device takes them: no double
  // round trip for W1's 134 MB of text features a step.
  std::vector<float> x0, txt, y;
  std::vector<double> img_ids, txt_ids, t, guidance;
  std::vector<uint64_t> noise_streams;  // for Backend::flow_match_inputs
};

// x0 [C, h, w] -> tokens [(h/p)(w/p), C·p²], feature = c·p² + ph·p + pw (row-major patches).
std::vector<double> pack_patches(const HostTensor& x, int64_t patch, int64_t* rows, int64_t* cols);
// The inverse, for sampling: tokens -> [C, h, w].
std::vector<double> unpack_patches(const double* tokens, int64_t channels, int64_t h, int64_t w, int64_t patch);
// Position ids (0, row, col) of an (h/p) × (w/p) patch grid, row-major.
std::vector<double> image_position_ids(int64_t h, int64_t w, int64_t patch);

// Shifted timestep: t' = e^μ / (e^μ + 1/t − 1), μ = 0.5 + 0.65·(image_tokens − 256)/3840.
double shift_timestep(double t, int64_t image_tokens);

// pack_patches into out[rows·cols] (f32: the batch's x0), rows and cols known from x's shape.
void pack_patches_into(const HostTensor& x, int64_t patch, float* out);

// Fails naming the sample when its own tensors do not fit `model` (image data and its patch
// grid, t5 [tokens, context_dim], clip [vec_dim]): what the batch builders check of each sample,
// for the data loader to check as it decodes (LoaderOptions::check).
void check_sample_fits(const Sample& s, const FluxConfig& model);

// Training batch for `step`: samples[i] is global-batch sample first_index + i on `rank`.
HostBatch make_train_batch(const std::vector<Sample>& samples, const FluxConfig& model, const ObjectiveConfig& obj,
                           const EmptyPrompt& empty, uint64_t seed, uint64_t step, uint64_t rank, int64_t first_index);
// The same into `b`, reusing its vectors (the trainer's one batch, written in place each step).
void make_train_batch(HostBatch& b, const std::vector<Sample>& samples, const FluxConfig& model,
                      const ObjectiveConfig& obj, const EmptyPrompt& empty, uint64_t seed, uint64_t step, uint64_t rank,
                      int64_t first_index);
// Validation batch (MLPerf): sample j at t = k/8 with k its "timestep" field (MLPerf's COCO
// validation set) or j mod 8; fixed noise, no text dropout.
HostBatch make_validation_batch(const std::vector<Sample>& samples, const FluxConfig& model, const ObjectiveConfig& obj,
                                uint64_t seed, int64_t first_index);

}  // namespace flux8

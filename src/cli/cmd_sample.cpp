// `flux8 sample`: images from a trained model with the Euler sampler (train/sampler.h).
// Pixel-space models (the embedded demo) write a PNG grid. Latent models write their latents
// and, for a .png --out, decode them through the VAE with tools/decode_latents.py
// (train/latent_decoder.h): flux8 has no VAE decoder and no T5/CLIP of its own.
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <optional>

#include "backend/backend.h"
#include "cli/commands.h"
#include "config/config.h"
#include "core/error.h"
#include "core/text_file.h"
#include "data/text_encoder.h"
#include "io/png.h"
#include "model/flux_model.h"
#include "model/weights_io.h"
#include "train/checkpoint.h"
#include "train/latent_decoder.h"
#include "train/sample_files.h"
#include "train/sampler.h"

namespace flux8::cli {

namespace {

namespace fs = std::filesystem;

struct Opts {
  std::string checkpoint, config, text_embeddings, out, vae;
  std::vector<std::string> overrides, prompts;
  int64_t steps = 20, per_prompt = 4;
  bool shift = false, no_shift = false;
  std::optional<double> guidance;
  double cfg_scale = 1.0;
  std::optional<uint64_t> seed;
  std::optional<int64_t> image_size, grid_scale;
};

bool ends_with(std::string s, const std::string& suffix) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char ch) { return std::tolower(ch); });
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The run config and the weights file named by --checkpoint (and -c).
std::pair<Config, std::string> resolve_model(const Opts& o) {
  std::error_code ec;
  const fs::file_status st = fs::status(o.checkpoint, ec);
  if (fs::is_regular_file(st)) {
    if (o.config.empty())
      fail(
          "sample: --checkpoint {} is a weights file; give the model's config with -c/--config "
          "(or pass a checkpoint directory, which carries its config)",
          o.checkpoint);
    return {Config::load(o.config, o.overrides), o.checkpoint};
  }
  if (!fs::is_directory(st))
    fail(
        "sample: --checkpoint {}: no such file or directory; give a checkpoint directory "
        "(ROOT/step-N) or a weights .safetensors file with -c/--config",
        o.checkpoint);
  std::string dir = o.checkpoint;
  if (!fs::exists(fs::path(dir) / "trainer_state.json")) {
    // A checkpoint root: take its newest complete checkpoint.
    const std::optional<std::string> latest = find_latest_checkpoint(dir);
    if (!latest)
      fail(
          "sample: --checkpoint {} is a directory without trainer_state.json and without complete "
          "step-N checkpoints; give a checkpoint directory or a weights file with -c",
          dir);
    fmt::print("sample: using the newest checkpoint of {}: {}\n", dir, *latest);
    dir = *latest;
  }
  if (!o.config.empty())
    fail(
        "sample: --checkpoint {} is a checkpoint directory, which carries the run's config in "
        "trainer_state.json; drop -c {} (change keys with --set)",
        dir, o.config);
  if (!fs::exists(fs::path(dir) / "model.safetensors")) fail("sample: checkpoint {} has no model.safetensors", dir);
  const std::string state_path = (fs::path(dir) / "trainer_state.json").string();
  const TrainerState state = trainer_state_from_json(read_text_or_fail(state_path, "trainer state"), state_path);
  if (state.config_yaml.empty())
    fail(
        "sample: {} has an empty config_yaml; give the weights file {}/model.safetensors with "
        "-c/--config instead",
        state_path, dir);
  return {Config::load_text(state.config_yaml, state_path + ":config_yaml", o.overrides), resolve_weights_path(dir)};
}

// The output format follows the model: a PNG grid of a pixel-space RGB model, latents otherwise.
void check_output_format(const Opts& o, const FluxConfig& cfg, bool pixel, const std::string& kind) {
  if (pixel && cfg.latent_channels != 3)
    fail(
        "sample: model {} is pixel-space (vae_downsample 1) with latent_channels {}; a PNG grid "
        "needs 3 (RGB)",
        cfg.name, cfg.latent_channels);
  if (pixel && !ends_with(o.out, ".png"))
    fail(
        "sample: model {} is a pixel-space model; it writes a PNG grid, so --out must end in .png "
        "(got {})",
        cfg.name, o.out);
  if (!pixel && !ends_with(o.out, ".safetensors") && !ends_with(o.out, ".png"))
    fail(
        "sample: model {} is a {} model: give --out GRID.png (decoded through the VAE, --vae) or "
        "--out LATENTS.safetensors (the latents alone; got {})",
        cfg.name, kind, o.out);
  if (o.grid_scale && !pixel) fail("sample: --grid-scale applies to PNG grids of pixel-space models only");
  if (!o.vae.empty() && pixel) fail("sample: --vae applies to latent models; model {} is pixel-space", cfg.name);
}

// A latent model's PNG needs a VAE; said before sampling rather than after.
void check_vae_given(const Opts& o, const Config& config, bool pixel) {
  if (!pixel && ends_with(o.out, ".png") && o.vae.empty() && config.get_string("sample_vae").empty())
    fail(
        "sample: --out {} is a PNG, which a latent model gets through the VAE: give --vae (a local VAE directory, "
        "or e.g. black-forest-labs/FLUX.1-dev, whose vae/ subfolder is used), or --out FILE.safetensors for the "
        "latents alone",
        o.out);
}

// Latent samples: the latents file, then (for a .png --out) the PNG decoded through the VAE.
// Exit status 1 when the PNG could not be made; the latents are kept either way.
int write_latent_samples(const Opts& o, const Config& config, const FluxConfig& cfg, const SamplerOptions& so,
                         const std::vector<HostTensor>& images, const std::vector<std::string>& labels,
                         int64_t image_size) {
  const bool png = ends_with(o.out, ".png");
  const std::string latents = png ? o.out.substr(0, o.out.size() - 4) + ".latents.safetensors" : o.out;
  write_sample_latents(latents, images, so,
                       {"flux8 sample", cfg.name, labels, image_size, config.get_float("vae_scale_factor"),
                        config.get_float("vae_shift_factor"), cfg.guidance_embed});
  fmt::print("wrote {} (latents [{}, {}, {}, {}], prompt-major)\n", latents, images.size(), cfg.latent_channels,
             so.height, so.width);
  if (!png) return 0;
  const LatentDecoder decoder{std::string(FLUX8_SOURCE_DIR) + "/tools/decode_latents.py",
                              o.vae.empty() ? config.get_string("sample_vae") : o.vae};
  const DecodeOutcome d = decode_latents_to_png(decoder, latents, o.out);
  if (d.ok()) return 0;
  fmt::print(
      stderr,
      "sample: {} not written: {}. The latents are kept in {}; decode them with\n  {} {} {} --vae VAE --out {}\n",
      o.out, d.reason, latents, LatentDecoder::python(), decoder.script, latents, o.out);
  return 1;
}

int run_sample(const Opts& o) {
  auto [config, weights] = resolve_model(o);
  const FluxConfig cfg = FluxConfig::from_config(config);
  std::error_code ec;
  if (fs::equivalent(o.out, weights, ec))
    fail("sample: --out {} is the weights file being sampled; writing it would overwrite the model", o.out);
  const bool pixel = cfg.vae_downsample == 1;
  const std::string kind = pixel ? "pixel-space" : fmt::format("latent (vae_downsample {})", cfg.vae_downsample);

  check_output_format(o, cfg, pixel, kind);
  check_vae_given(o, config, pixel);

  // Prompts.
  std::vector<TextEncoding> prompts;
  std::optional<TextEncoding> empty;
  std::vector<std::string> labels = o.prompts;
  if (!o.text_embeddings.empty()) {
    EncodedPrompts encoded = read_encoded_prompts(o.text_embeddings, "sample: --text-embeddings");
    prompts = std::move(encoded.prompts);
    empty = std::move(encoded.empty);
    if (!labels.empty() && labels.size() != prompts.size())
      fail(
          "sample: {} --prompt given but --text-embeddings {} holds {} prompts (t5.0 .. t5.{}); "
          "give one --prompt per encoding, or none",
          labels.size(), o.text_embeddings, prompts.size(), prompts.size() - 1);
    if (labels.empty()) labels = std::move(encoded.labels);
  } else if (pixel) {
    if (o.prompts.empty()) fail("sample: give at least one --prompt \"...\"");
    const DemoTextEncoder enc(cfg.text_seq_len, cfg.context_dim, cfg.vec_dim);
    for (const std::string& p : o.prompts) prompts.push_back(enc.encode(p));
    empty = enc.encode("");
  } else {
    fail(
        "sample: model {} is a {} model conditioned on T5 and CLIP, which flux8 does not run; "
        "give --text-embeddings FILE.safetensors holding t5.<i> [tokens, {}] and clip.<i> [{}] "
        "per prompt (and t5.empty/clip.empty for --cfg-scale)",
        cfg.name, kind, cfg.context_dim, cfg.vec_dim);
  }

  SamplerOptions so;
  so.steps = o.steps;
  so.shift = o.shift || (!o.no_shift && !pixel);
  so.cfg_scale = o.cfg_scale;
  so.seed = o.seed ? *o.seed : static_cast<uint64_t>(config.get_int("seed"));
  so.images_per_prompt = o.per_prompt;
  if (o.guidance && !cfg.guidance_embed)
    fail(
        "sample: model {} has no guidance embedding (guidance_embed false), so --guidance has no "
        "input to set; use --cfg-scale for classifier-free guidance",
        cfg.name);
  so.guidance = o.guidance.value_or(config.get_float("sample_guidance"));
  if (so.cfg_scale != 1.0 && !empty)
    fail(
        "sample: --cfg-scale {} needs the empty prompt's encodings: add t5.empty and clip.empty to "
        "--text-embeddings {}",
        so.cfg_scale, o.text_embeddings);
  const int64_t image_size = o.image_size.value_or(config.get_int("image_size"));
  if (image_size % (cfg.vae_downsample * cfg.patch_size) != 0)
    fail("sample: image size {} px is not a multiple of vae_downsample x patch_size = {}", image_size,
         cfg.vae_downsample * cfg.patch_size);
  so.height = so.width = image_size / cfg.vae_downsample;

  const BackendOptions bopts = BackendOptions::from_config(config);
  std::unique_ptr<Backend> be = make_backend(config.get_string("backend"), bopts);
  FluxModel model(cfg, *be, DType::f32);
  load_weights(model.params(), cfg, weights);
  fmt::print("sample: {} ({} model), {} prompt(s) x {} image(s), {}x{} px, {} steps, shift {}, cfg {}{}, seed {}\n",
             weights, kind, prompts.size(), so.images_per_prompt, image_size, image_size, so.steps,
             so.shift ? "on" : "off", so.cfg_scale, cfg.guidance_embed ? fmt::format(", guidance {}", so.guidance) : "",
             so.seed);

  std::vector<HostTensor> images = sample_images(model, prompts, empty ? &*empty : nullptr, so);
  int64_t non_finite = 0;
  for (const HostTensor& im : images)
    for (float v : im.data) non_finite += !std::isfinite(v);
  if (non_finite)
    fmt::print(stderr, "sample: warning: {} non-finite values in the samples (diverged model?)\n", non_finite);

  if (pixel) {
    const int64_t scale = o.grid_scale.value_or(std::max<int64_t>(1, 128 / image_size));
    write_image_grid(o.out, images, static_cast<int64_t>(prompts.size()), so.images_per_prompt, scale);
    fmt::print("wrote {} ({} rows (prompts) x {} images, {}x{} px each, shown x{})\n", o.out, prompts.size(),
               so.images_per_prompt, image_size, image_size, scale);
    return 0;
  }
  return write_latent_samples(o, config, cfg, so, images, labels, image_size);
}

}  // namespace

Command add_sample_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("sample", "generate images from a checkpoint with the Euler sampler");
  cmd->footer(
      "Timesteps run 1 -> 0. Pixel-space models (vae_downsample 1) encode --prompt with the built-in demo "
      "text encoder and write a PNG grid, one row per prompt. Latent models need --text-embeddings (T5/CLIP "
      "encodings from tools/encode_prompts.py) and write 'latents' [images, latent_channels, h, w], "
      "prompt-major, mapped back to the VAE's space (z = x / vae_scale_factor + vae_shift_factor, the "
      "config's keys), with the prompts in the metadata: --out GRID.png writes them to GRID.latents.safetensors "
      "and decodes them through the VAE (--vae) with tools/decode_latents.py, run by $FLUX8_PYTHON (else "
      "python3) with torch and diffusers; --out FILE.safetensors writes the latents alone");
  auto o = std::make_shared<Opts>();
  cmd->add_option("--checkpoint", o->checkpoint,
                  "checkpoint directory (ROOT/step-N, config from its trainer_state.json; a "
                  "checkpoint root uses its newest), or a weights .safetensors with -c")
      ->required();
  cmd->add_option("-c,--config", o->config, "model config YAML, with a weights-file --checkpoint")
      ->check(CLI::ExistingFile);
  cmd->add_option("--set", o->overrides, "override a config key: --set key=value (repeatable)");
  cmd->add_option("--prompt", o->prompts, "a prompt (repeatable); with --text-embeddings, labels for its encodings");
  cmd->add_option("--text-embeddings", o->text_embeddings,
                  "safetensors with t5.<i> [tokens, context_dim] and clip.<i> [vec_dim] per prompt i, "
                  "optionally t5.empty/clip.empty (for --cfg-scale); required for latent models")
      ->check(CLI::ExistingFile);
  cmd->add_option("--steps", o->steps, "Euler steps")->capture_default_str()->check(CLI::Range(1, 100000));
  auto* shift = cmd->add_flag("--shift", o->shift, "resolution-dependent timestep shift (default for latent models)");
  cmd->add_flag("--no-shift", o->no_shift, "no timestep shift (default for pixel-space models)")->excludes(shift);
  cmd->add_option("--guidance", o->guidance,
                  "guidance-embedding input (guidance_embed models; default: the config's sample_guidance, 3.5)");
  cmd->add_option("--cfg-scale", o->cfg_scale, "classifier-free guidance v = v_empty + S*(v_prompt - v_empty); 1 = off")
      ->capture_default_str();
  cmd->add_option("--seed", o->seed, "noise seed (default: the config's seed)");
  cmd->add_option("--per-prompt", o->per_prompt, "images per prompt")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  cmd->add_option("--image-size", o->image_size, "image side in pixels (default: the config's image_size)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--grid-scale", o->grid_scale,
                  "PNG grid: each pixel shown as NxN (default: enough for >= 128 px cells)")
      ->check(CLI::Range(1, 64));
  cmd->add_option("--vae", o->vae,
                  "latent models, --out GRID.png: the VAE that decodes the latents (a local directory or a Hugging "
                  "Face id; default: the config's sample_vae)");
  cmd->add_option("--out", o->out, "GRID.png, or (latent models) LATENTS.safetensors for the latents alone")
      ->required();
  return {cmd, [o]() { return run_sample(*o); }};
}

}  // namespace flux8::cli

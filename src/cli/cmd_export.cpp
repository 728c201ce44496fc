// `flux8 export`: a checkpoint's (or any weights file's) model written for other programs, in
// the reference layout (ComfyUI, BFL) or as a diffusers folder, in f32, bf16 or FP8
// (model/weights_export.h).
#include <fmt/core.h>

#include <filesystem>
#include <optional>

#include "cli/commands.h"
#include "config/config.h"
#include "core/error.h"
#include "core/text_file.h"
#include "io/safetensors_index.h"
#include "model/weight_source.h"
#include "model/weights_export.h"
#include "train/checkpoint.h"

namespace flux8::cli {

namespace {

namespace fs = std::filesystem;

struct Opts {
  std::string checkpoint, format, dtype = "bf16", out, config, max_shard_size = "10GB";
  std::vector<std::string> overrides;
};

// The model's config and the weights: a checkpoint directory carries its run's config; a weights
// file written by flux8 (init, export, a checkpoint's model.safetensors) carries it in its
// metadata; anything else (a diffusers folder, a file from elsewhere) needs -c.
std::pair<Config, std::string> resolve_model(const Opts& o) {
  std::error_code ec;
  std::string dir = o.checkpoint;
  if (fs::is_directory(dir, ec) && !fs::exists(fs::path(dir) / "trainer_state.json", ec) && !is_diffusers_folder(dir)) {
    if (const std::optional<std::string> latest = find_latest_checkpoint(dir)) {  // a checkpoint root
      fmt::print("export: using the newest checkpoint of {}: {}\n", dir, *latest);
      dir = *latest;
    }
  }
  if (fs::exists(fs::path(dir) / "trainer_state.json", ec)) {
    if (!o.config.empty())
      fail("export: {} is a checkpoint directory, which carries its run's config; drop -c (change keys with --set)",
           dir);
    const std::string state_path = (fs::path(dir) / "trainer_state.json").string();
    const TrainerState state = trainer_state_from_json(read_text_or_fail(state_path, "trainer state"), state_path);
    return {Config::load_text(state.config_yaml, state_path + ":config_yaml", o.overrides), resolve_weights_path(dir)};
  }
  if (!fs::exists(o.checkpoint, ec))
    fail(
        "export: {}: no such file or directory; give a checkpoint directory (ROOT/step-N), a .safetensors "
        "weights file or a diffusers folder",
        o.checkpoint);
  const std::string weights = resolve_weights_path(o.checkpoint);
  if (!o.config.empty()) return {Config::load(o.config, o.overrides), weights};
  const std::string located = locate_weights(weights);
  if (located.size() < 11 || located.compare(located.size() - 11, 11, ".index.json") != 0) {
    const SafetensorsSet file = SafetensorsSet::open_file(located);
    for (const char* key : {"flux8_config", "config"})
      if (const auto it = file.metadata().find(key); it != file.metadata().end() && !it->second.empty())
        return {Config::load_text(it->second, located + ":" + key, o.overrides), weights};
  }
  fail(
      "export: {} does not say which model it holds; give its config with -c/--config (e.g. "
      "configs/models/flux_12b_dev.yaml)",
      o.checkpoint);
}

}  // namespace

Command add_export_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "export", "write a checkpoint's model for other programs: BFL/ComfyUI file or diffusers folder, f32/bf16/fp8");
  auto o = std::make_shared<Opts>();
  cmd->add_option("checkpoint", o->checkpoint,
                  "a checkpoint directory (ROOT/step-N; a ROOT: its newest that verifies), a .safetensors weights "
                  "file (either naming, any dtype) or a diffusers folder")
      ->required();
  cmd->add_option("--format", o->format,
                  "bfl: one .safetensors file in the reference names; diffusers: a FluxTransformer2DModel folder")
      ->required()
      ->check(CLI::IsMember({"bfl", "diffusers"}));
  cmd->add_option("--dtype", o->dtype,
                  "f32, bf16, or fp8 (bfl only: ComfyUI's F8_E4M3 block weights with per-tensor weight_scale)")
      ->check(CLI::IsMember({"f32", "bf16", "fp8"}));
  cmd->add_option("--out", o->out, "the file (bfl) or folder (diffusers) to write")->required();
  cmd->add_option("--max-shard-size", o->max_shard_size,
                  "diffusers: most tensor bytes a shard holds, e.g. 10GB (default), 500MB, 2GiB");
  cmd->add_option("-c,--config", o->config, "the model's YAML, for weights that do not carry their config")
      ->check(CLI::ExistingFile);
  cmd->add_option("--set", o->overrides, "override a config key: --set key=value (repeatable)");
  return {cmd, [o, cmd]() {
            ExportOptions eo;
            eo.format = o->format == "bfl" ? ExportFormat::bfl : ExportFormat::diffusers;
            eo.dtype = o->dtype == "f32" ? ExportDtype::f32 : o->dtype == "fp8" ? ExportDtype::fp8 : ExportDtype::bf16;
            if (cmd->count("--max-shard-size") && eo.format == ExportFormat::bfl)
              fail("export: --max-shard-size is for --format diffusers; a bfl export is one file");
            eo.max_shard_bytes = parse_byte_size(o->max_shard_size, "export --max-shard-size");
            const auto [config, weights] = resolve_model(*o);
            const FluxConfig cfg = FluxConfig::from_config(config);
            eo.metadata = {{"producer", "flux8 export"}, {"model", cfg.name}};
            if (eo.format == ExportFormat::bfl) eo.metadata["flux8_config"] = config.dump();
            const WeightSource source = WeightSource::open(weights);
            const ExportResult r = export_weights(source, cfg, o->out, eo);
            fmt::print("wrote {} ({} tensors{}, {:.1f} MB of tensor data, {} file{})\n", o->out, r.tensors,
                       r.fp8_tensors ? fmt::format(", {} in FP8", r.fp8_tensors) : "",
                       static_cast<double>(r.tensor_bytes) / 1e6, r.files.size(), r.files.size() == 1 ? "" : "s");
            return 0;
          }};
}

}  // namespace flux8::cli

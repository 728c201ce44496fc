#pragma once
// `flux8 export`: weights from any WeightSource written for other programs, one tensor at a time
// (the source is memory-mapped; host memory holds one parameter, never the model):
//
//   bfl        one .safetensors file in the reference (Black Forest Labs) names, as
//              flux1-dev.safetensors: ComfyUI's "Load Diffusion Model", BFL's own code;
//   diffusers  a folder FluxTransformer2DModel.from_pretrained loads: config.json, and the
//              tensors in diffusers' names in diffusion_pytorch_model-0000N-of-0000M.safetensors
//              shards of at most max_shard_bytes with diffusion_pytorch_model.safetensors.index.json
//              (one shard: diffusion_pytorch_model.safetensors alone, as save_pretrained does).
//
// Element types: f32, bf16 (round to nearest even), or fp8 (bfl only): ComfyUI's FP8 layout —
// each Linear weight of the double and single blocks as F8_E4M3 codes with a per-tensor F32
// scale "<layer>.weight_scale" = amax / 448 (code = RNE(w / scale), so code · scale ≈ w), listed in
// the "_quantization_metadata" header entry; every other tensor (embedders, final layer, biases,
// norms) in BF16. diffusers' from_pretrained has no per-tensor FP8 scale, so diffusers exports are
// f32 or bf16.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "model/flux_config.h"
#include "model/weight_source.h"

namespace flux8 {

enum class ExportFormat { bfl, diffusers };
enum class ExportDtype { f32, bf16, fp8 };

struct ExportOptions {
  ExportFormat format = ExportFormat::diffusers;
  ExportDtype dtype = ExportDtype::bf16;
  uint64_t max_shard_bytes = 10'000'000'000;    // diffusers' save_pretrained default, "10GB"
  std::map<std::string, std::string> metadata;  // added to every safetensors file written
};

struct ExportResult {
  std::vector<std::string> files;  // the paths written
  uint64_t tensor_bytes = 0;       // tensor data over all files
  size_t tensors = 0, fp8_tensors = 0;
};

// Writes the model `cfg` from `source` (checked against cfg first) to `out`: the file (bfl) or
// the folder (diffusers). A folder is written beside it and renamed into place when complete; an
// existing non-empty `out` folder is refused. Fails naming the config key diffusers cannot
// express (mlp_ratio other than 4, no qkv bias, another rope_theta or epsilon).
ExportResult export_weights(const WeightSource& source, const FluxConfig& cfg, const std::string& out,
                            const ExportOptions& options);

// FluxTransformer2DModel's config.json for `cfg` (the same checks).
std::string diffusers_config_json(const FluxConfig& cfg);

}  // namespace flux8

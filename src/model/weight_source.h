#pragma once
// The weights a model loads or `flux8 export` converts, wherever they come from:
//   - one safetensors file in the reference (Black Forest Labs) or diffusers naming, its names
//     optionally under a prefix ("model.diffusion_model." as ComfyUI saves whole models);
//   - a diffusers folder: FluxTransformer2DModel's diffusion_pytorch_model.safetensors, or its
//     shards with diffusion_pytorch_model.safetensors.index.json; a pipeline folder (FLUX.1-dev
//     as downloaded) is read through its transformer/ subfolder; an index file named directly.
// Tensors are F32, F64, BF16, F16 or FP8 (F8_E4M3, F8_E5M2). An FP8 weight may carry a per-tensor
// scale as ComfyUI's FP8 checkpoints do — "<layer>.weight_scale" (ComfyUI's current format) or
// "<layer>.scale_weight" (its older "scaled_fp8" files) — and is loaded as code · scale: the FP8
// value and the F32 scale multiplied exactly in f64, then rounded once to the parameter's type.
// The other tensors those files carry (input scales, "<layer>.comfy_quant", the "scaled_fp8"
// marker) say how to run the layer in FP8 and are accepted and not read.
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "io/safetensors_index.h"
#include "model/flux_config.h"
#include "model/params.h"

namespace flux8 {

enum class WeightNaming { reference, diffusers };

class WeightSource {
 public:
  // `path`: a file or folder as above. `prefix` as in the file; empty tries none, then
  // "model.diffusion_model.". The naming is detected from "img_in.weight" (reference) or
  // "x_embedder.weight" (diffusers); anything else fails saying so.
  static WeightSource open(const std::string& path, const std::string& prefix = "");

  const std::string& path() const { return path_; }
  WeightNaming naming() const { return naming_; }
  const SafetensorsSet& files() const { return files_; }
  // Where the named reference parameter is stored as it is (same name, no scale, not FP8): the
  // file tensor's name, or "" when it must be assembled or decoded (read_param).
  std::string stored_as_is(const std::string& param) const;

  // Checks every tensor against the model: each one it needs present with its shape and a
  // loadable dtype, scales well-formed and only on FP8 weights, nothing unexpected under the
  // prefix. Fails with one message listing every problem, naming the file and each tensor.
  void check(const FluxConfig& cfg) const;
  // The whole reference parameter `whole` (of the one-rank layout) in f64, after check().
  void read_param(const ParamInfo& whole, const FluxConfig& cfg, std::vector<double>& out) const;

 private:
  // File tensor `name` decoded (FP8 codes times their scale) into dst (numel elements).
  void read_tensor(const std::string& name, double* dst) const;
  // The name of the scale tensor of file tensor `name`, or "" when it has none.
  std::string scale_of(const std::string& name) const;

  std::string path_, prefix_;
  WeightNaming naming_ = WeightNaming::reference;
  SafetensorsSet files_;
};

// Whether `path` is a folder locate_weights reads (a diffusers model or pipeline folder).
bool is_diffusers_folder(const std::string& path);

// A file or folder path resolved the way WeightSource::open reads it: a diffusers folder to its
// index or single file (or those of its transformer/ subfolder); anything else as it is.
std::string locate_weights(const std::string& path);

}  // namespace flux8

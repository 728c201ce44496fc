#pragma once
// Model weights <-> safetensors files in the reference (Black Forest Labs Flux.1) naming, or
// in diffusers' FluxTransformer2DModel naming through the name map.
#include <map>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "io/safetensors.h"
#include "model/flux_config.h"
#include "model/params.h"

namespace flux8 {

class Backend;

enum class WeightNaming { reference, diffusers };

// Detected from the file: "img_in.weight" -> reference, "x_embedder.weight" -> diffusers.
// Names may carry `prefix` (e.g. "model.diffusion_model." as ComfyUI stores them); when
// prefix is empty, "model.diffusion_model." is tried too.
//
// Checks every tensor's presence, shape and dtype (F32, BF16, F16 or F64) and fails with
// one message listing every mismatch (missing, unexpected, wrong shape, wrong dtype).
void load_weights(ParamStore& store, const FluxConfig& cfg, const std::string& path,
                  const std::string& prefix = "");

// Buffers upload_file_tensor reuses from call to call.
struct UploadBuffers {
  std::vector<float> f32;
  std::vector<double> f64;
  std::vector<uint8_t> scratch;
};
// Uploads file tensor `name` into the contiguous backend tensor t of the same element count
// (the caller checked the shape): into f32 or bf16 tensors through f32 — an aligned F32 tensor
// straight from the file's mapping, bf16 rounded to nearest even — and into f64 tensors (the
// CPU backend's double-precision runs) through f64, exactly.
void upload_file_tensor(Backend& be, const SafetensorsReader& file, const std::string& name, const Tensor& t,
                        UploadBuffers& buffers);

// The writer of all parameters in the reference naming (file dtype bf16, f32 or f16) with
// `metadata`: each parameter streams from the backend a piece at a time when the writer writes
// (the store must outlive that). For checkpoints, which write it beside the optimizer state.
SafetensorsWriter reference_weights_writer(const ParamStore& store, DType file_dtype,
                                           const std::map<std::string, std::string>& metadata);

// Writes all parameters (file dtype bf16, f32 or f16) atomically. In the reference naming each
// parameter streams from the backend to the file a piece at a time (no host copy of the model).
void save_weights(const ParamStore& store, const FluxConfig& cfg, const std::string& path,
                  DType file_dtype, WeightNaming naming,
                  const std::map<std::string, std::string>& metadata = {});

}  // namespace flux8

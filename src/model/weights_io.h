#pragma once
// Model weights <-> safetensors files in the reference (Black Forest Labs Flux.1) naming, or
// in diffusers' FluxTransformer2DModel naming through the name map.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "io/safetensors.h"
#include "model/flux_config.h"
#include "model/params.h"
#include "model/weight_source.h"

namespace flux8 {

class Backend;

// Loads the weights at `path`: any file or folder WeightSource reads (model/weight_source.h:
// either naming, a diffusers folder with shards, F32/F64/BF16/F16 or FP8 tensors with ComfyUI's
// scales). Names may carry `prefix` (e.g. "model.diffusion_model." as ComfyUI stores them);
// when prefix is empty, "model.diffusion_model." is tried too.
//
// Checks every tensor's presence, shape and dtype and fails with one message listing every
// mismatch (missing, unexpected, wrong shape, wrong dtype, bad scale). The file holds whole
// tensors; a tensor-parallel rank's store (ParamLayout::build with a rank) loads its shard of
// each.
void load_weights(ParamStore& store, const FluxConfig& cfg, const std::string& path, const std::string& prefix = "");

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

// A flat buffer laid out like the parameters (the parameters themselves, or an AdamW moment):
// on a backend, streamed from it a piece at a time as a file is written, or in host memory (a
// checkpoint's snapshot, train/checkpoint.h). The buffer must outlive the writers it fills.
struct FlatSource {
  Backend* backend = nullptr;  // null: `data` is host memory
  const void* data = nullptr;
  DType dtype = DType::f32;

  static FlatSource on_backend(Backend& be, const Tensor& flat) { return {&be, flat.data, flat.dtype}; }
  // Produces parameter p's elements in `file_dtype` (f32, bf16 or f16; download_as's and
  // convert_elements' rounding). `scratch` is shared by fills that run one after another.
  SafetensorsWriter::FillChunk fill(const ParamInfo& p, DType file_dtype,
                                    std::shared_ptr<std::vector<uint8_t>> scratch) const;
};

// The writer of all parameters in the reference naming (file dtype bf16, f32 or f16) from `src`,
// with "format": "pt" and `metadata`: each parameter is produced a piece at a time when the
// writer writes. save_weights' reference files and checkpoints' model.safetensors. Whole tensors
// only: a tensor-parallel rank's shards are refused (assemble_full gathers them).
SafetensorsWriter reference_weights_writer(const std::vector<ParamInfo>& params, const FlatSource& src,
                                           DType file_dtype, const std::map<std::string, std::string>& metadata);

// Writes all parameters (file dtype bf16, f32 or f16) atomically. The store must hold whole
// tensors (a tensor-parallel rank's store is refused: its shards are gathered first). In the reference naming each
// parameter streams from the backend to the file a piece at a time (no host copy of the model).
void save_weights(const ParamStore& store, const FluxConfig& cfg, const std::string& path, DType file_dtype,
                  WeightNaming naming, const std::map<std::string, std::string>& metadata = {});

}  // namespace flux8

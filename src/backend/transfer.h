#pragma once
// Host <-> backend copies of whole tensors as f64 values, whatever the tensor's dtype (f32,
// f64, or bf16: an activation in bf16 storage, rounded to nearest even on the way in). Used for checkpoints, CLI
// inputs/outputs and tests; never on a hot path.
#include <vector>

#include "core/tensor.h"

namespace flux8 {

class Backend;

std::vector<double> to_host(Backend& backend, const Tensor& t);
void from_host(Backend& backend, const Tensor& t, const std::vector<double>& values);
// The same from f32 values: uploaded as they are into an f32 tensor (no conversion pass).
void from_host(Backend& backend, const Tensor& t, const std::vector<float>& values);

// t.numel() f32 values uploaded into a contiguous f32, f64 or bf16 tensor (bf16: rounded to
// nearest even), converting through `scratch` (reused from call to call) where t is not f32.
void upload_f32(Backend& backend, const Tensor& t, const float* values, std::vector<uint8_t>& scratch);

// Elements [first, first + count) of a contiguous f32, f64 or bf16 tensor, downloaded into dst
// as `dst_dtype` (f32, f64, bf16 or f16): as they are when the types match, else converted
// (core/dtype.h's convert_elements). `scratch` holds the downloaded values for a conversion and
// is reused from call to call. For checkpoints, which stream a tensor to disk a piece at a time
// instead of holding it all on the host.
void download_as(Backend& backend, const Tensor& t, size_t first, size_t count, DType dst_dtype, void* dst,
                 std::vector<uint8_t>& scratch);

}  // namespace flux8

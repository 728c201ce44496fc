#pragma once
// Model inputs read from a safetensors file (the `flux8 forward` interface and the golden
// tests): img, img_ids, txt, txt_ids, timesteps, y, guidance; ids may omit the batch
// dimension ([L, 3], shared by all samples, as diffusers stores them).
#include <memory>
#include <string>
#include <vector>

#include "model/flux_config.h"
#include "model/flux_model.h"
#include "model/owned_tensors.h"

namespace flux8 {

class Backend;
class SafetensorsReader;

// Owns backend copies of the inputs.
class InputBatch {
 public:
  InputBatch(Backend& backend, DType dtype) : buffers_(backend, dtype) {}

  // The batch and token counts the inputs in `file` give.
  struct Extent {
    int64_t batch = 0, image_tokens = 0, text_tokens = 0;
  };
  // Checks the shapes of `prefix + name` for every input against each other and the model from
  // the file's header alone, without reading or allocating anything; fails naming the file and
  // the tensor when one is missing, has a dtype that does not convert, has a shape that does
  // not fit, or holds no sample or no token.
  static Extent check(const SafetensorsReader& file, const FluxConfig& cfg, const std::string& prefix = "");
  // check(), then reads every input.
  void load(const SafetensorsReader& file, const FluxConfig& cfg, const std::string& prefix = "");
  const FluxInputs& inputs() const { return inputs_; }
  int64_t batch() const { return inputs_.img.shape[0]; }

  // A backend tensor holding `values` with `shape` (owned by this batch).
  Tensor make(Shape shape, const std::vector<double>& values);

 private:
  OwnedTensors buffers_;
  FluxInputs inputs_;
};

}  // namespace flux8

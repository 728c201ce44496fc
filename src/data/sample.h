#pragma once
// One training sample as the data pipeline hands it to the trainer: named host tensors in
// f32, decoded from a WebDataset tar shard. Field names are canonical, whatever the source
// called them:
//   "mean", "logvar"  VAE posterior [16, h, w] (MLPerf preprocessed layout), or
//   "latent"          a latent [C, h, w] used as is (Primus "latents"), or
//   "image"           pixels [3, H, W] in [-1, 1] (the embedded demo, pixel-space models)
//   "t5"              text encoder tokens [Lt, context_dim] (Primus "prompt_embeds")
//   "clip"            pooled text vector [vec_dim] (Primus "pooled_prompt_embeds")
//   "caption"         optional, text (kept in Sample::caption, not as a tensor)
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/host_tensor.h"

namespace flux8 {

struct Sample {
  std::string key;    // WebDataset sample key (member name up to the first dot)
  std::string shard;  // file it came from (for error messages)
  std::map<std::string, HostTensor> fields;
  std::string caption;
  bool has(const std::string& field) const { return fields.count(field) != 0; }
  const HostTensor& at(const std::string& field) const;  // fails naming key, shard and field
};

}  // namespace flux8

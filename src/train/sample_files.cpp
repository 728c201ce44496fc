#include "train/sample_files.h"

#include <fmt/core.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/text_file.h"
#include "io/safetensors.h"

namespace flux8 {

namespace {

HostTensor read_host(const SafetensorsReader& f, const std::string& name) {
  HostTensor t{f.tensor(name).shape, {}};
  t.data.resize(static_cast<size_t>(t.numel()));
  f.read_f32(name, t.data.data());
  return t;
}

// The prompts' text from the file's metadata, when it has one string per encoding.
std::vector<std::string> stored_labels(const SafetensorsReader& f, size_t count) {
  const auto it = f.metadata().find("prompts");
  if (it == f.metadata().end()) return {};
  std::string error;
  const std::optional<nlohmann::json> j = parse_json(it->second, error);
  if (!j || !j->is_array() || j->size() != count) return {};
  std::vector<std::string> out;
  for (const nlohmann::json& p : *j) {
    if (!p.is_string()) return {};
    out.push_back(p.get<std::string>());
  }
  return out;
}

}  // namespace

EncodedPrompts read_encoded_prompts(const std::string& path, const std::string& who) {
  const SafetensorsReader f(path);
  EncodedPrompts e;
  for (size_t i = 0; f.contains(fmt::format("t5.{}", i)); ++i) {
    if (!f.contains(fmt::format("clip.{}", i))) fail("{} {} has t5.{} but no clip.{}", who, path, i, i);
    e.prompts.push_back({read_host(f, fmt::format("t5.{}", i)), read_host(f, fmt::format("clip.{}", i))});
  }
  if (e.prompts.empty())
    fail(
        "{} {} has no t5.0; expected t5.<i> [tokens, context_dim] and clip.<i> [vec_dim] for prompts i = 0, 1, ... "
        "(tools/encode_prompts.py writes them)",
        who, path);
  if (f.contains("t5.empty") != f.contains("clip.empty"))
    fail("{} {} must hold both t5.empty and clip.empty, or neither", who, path);
  if (f.contains("t5.empty")) e.empty = TextEncoding{read_host(f, "t5.empty"), read_host(f, "clip.empty")};
  e.labels = stored_labels(f, e.prompts.size());
  if (e.labels.empty())
    for (size_t i = 0; i < e.prompts.size(); ++i) e.labels.push_back(fmt::format("<{} t5.{}>", path, i));
  return e;
}

void write_sample_latents(const std::string& path, const std::vector<HostTensor>& images, const SamplerOptions& so,
                          const LatentsFileInfo& info) {
  if (images.empty()) fail("no samples to write to {}", path);
  std::vector<float> latents;
  for (const HostTensor& im : images)
    for (float v : im.data) latents.push_back(static_cast<float>(v / info.vae_scale + info.vae_shift));
  SafetensorsWriter out;
  out.add("latents", DType::f32, {static_cast<int64_t>(images.size()), images[0].shape[0], so.height, so.width},
          latents.data());
  out.set_metadata("producer", info.producer);
  out.set_metadata("model", info.model);
  out.set_metadata("prompts", nlohmann::json(info.labels).dump());
  out.set_metadata("images_per_prompt", std::to_string(so.images_per_prompt));
  out.set_metadata("image_size", std::to_string(info.image_size));
  out.set_metadata("steps", std::to_string(so.steps));
  out.set_metadata("shift", so.shift ? "true" : "false");
  out.set_metadata("cfg_scale", fmt::format("{}", so.cfg_scale));
  if (info.guidance_embed) out.set_metadata("guidance", fmt::format("{}", so.guidance));
  out.set_metadata("seed", std::to_string(so.seed));
  out.set_metadata("vae_scale_factor", fmt::format("{}", info.vae_scale));
  out.set_metadata("vae_shift_factor", fmt::format("{}", info.vae_shift));
  out.write(path);
}

}  // namespace flux8

#include "model/weights_export.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "fp8/format.h"
#include "io/safetensors.h"
#include "io/safetensors_index.h"
#include "model/name_map.h"

namespace flux8 {

namespace {

namespace fs = std::filesystem;

constexpr const char* kShardStem = "diffusion_pytorch_model";
// The version whose config.json keys these are (Flux's transformer arrived in diffusers 0.30).
constexpr const char* kDiffusersVersion = "0.30.0";

std::vector<int64_t> dims(const Shape& s) { return std::vector<int64_t>(s.d.begin(), s.d.begin() + s.rank); }

// Rows [param_row, +rows) of reference parameter `param` are rows [out_row, +rows) of the tensor.
struct RowSource {
  const ParamInfo* param;
  int64_t param_row, out_row, rows;
};

struct OutTensor {
  std::string name;
  Shape shape;
  std::vector<RowSource> rows;
  bool fp8 = false;
};

// What is exported, in the reference parameter order.
std::vector<OutTensor> out_tensors(const ParamLayout& layout, const FluxConfig& cfg, const ExportOptions& o) {
  std::vector<OutTensor> out;
  if (o.format == ExportFormat::bfl) {
    for (const ParamInfo& p : layout.params()) out.push_back({p.name, p.shape, {{&p, 0, 0, p.shape[0]}}});
  } else {
    std::map<std::string, size_t> index;
    for (const DiffusersTensor& t : diffusers_tensors(layout, cfg)) {
      index[t.name] = out.size();
      out.push_back({t.name, t.shape, {}});
    }
    for (const ParamInfo& p : layout.params())
      for (const NamePiece& piece : diffusers_pieces(p, cfg))
        out[index.at(piece.diffusers)].rows.push_back({&p, piece.bfl_row, piece.diffusers_row, piece.rows});
  }
  // ComfyUI's FP8 files quantize the blocks' Linear weights and keep the rest in 16 bits.
  if (o.dtype == ExportDtype::fp8)
    for (OutTensor& t : out)
      t.fp8 = t.shape.rank == 2 && t.name.size() > 7 && t.name.compare(t.name.size() - 7, 7, ".weight") == 0 &&
              (t.name.rfind("double_blocks.", 0) == 0 || t.name.rfind("single_blocks.", 0) == 0);
  return out;
}

// Builds one output tensor at a time in f64 from the source, keeping the last parameter read
// (diffusers' to_q, to_k, to_v come from one qkv parameter).
class TensorAssembler {
 public:
  TensorAssembler(const WeightSource& source, const FluxConfig& cfg) : source_(source), cfg_(cfg) {}
  const std::vector<double>& values(const OutTensor& t) {
    if (current_ == &t) return tensor_;
    tensor_.assign(static_cast<size_t>(t.shape.numel()), 0.0);
    const int64_t row_elems = t.shape.numel() / t.shape[0];
    for (const RowSource& r : t.rows) {
      if (cached_ != r.param) {
        source_.read_param(*r.param, cfg_, param_);
        cached_ = r.param;
      }
      std::copy_n(param_.begin() + r.param_row * row_elems, r.rows * row_elems,
                  tensor_.begin() + r.out_row * row_elems);
    }
    current_ = &t;
    return tensor_;
  }

 private:
  const WeightSource& source_;
  const FluxConfig& cfg_;
  const ParamInfo* cached_ = nullptr;
  const OutTensor* current_ = nullptr;
  std::vector<double> param_, tensor_;
};

// The per-tensor scale of an FP8 tensor: amax / 448 in f32, so the largest magnitude maps to
// E4M3's largest finite value; 1 for an all-zero tensor.
float fp8_scale(const std::vector<double>& v) {
  double amax = 0;
  for (double x : v) amax = std::max(amax, std::abs(x));
  const float scale = static_cast<float>(amax / kE4M3Max);
  return scale > 0 && std::isfinite(scale) ? scale : 1.0f;
}

// Adds tensor t (and its scale) to `w`; returns its bytes.
uint64_t add_tensor(SafetensorsWriter& w, const OutTensor& t, TensorAssembler& assembler, DType dtype) {
  const uint64_t n = static_cast<uint64_t>(t.shape.numel());
  if (!t.fp8) {
    w.add_filled(t.name, dtype, dims(t.shape), [&assembler, &t, dtype](size_t first, size_t count, void* dst) {
      const double* v = assembler.values(t).data() + first;
      if (dtype == DType::f32) {
        float* out = static_cast<float*>(dst);
        for (size_t i = 0; i < count; ++i) out[i] = static_cast<float>(v[i]);
      } else {
        uint16_t* out = static_cast<uint16_t*>(dst);
        for (size_t i = 0; i < count; ++i) out[i] = f32_to_bf16_bits(static_cast<float>(v[i]));
      }
    });
    return n * dtype_size(dtype);
  }
  // The scale is needed before the codes: the weight's first fill computes it.
  auto scale = std::make_shared<float>(1.0f);
  w.add_filled_bytes(t.name, "F8_E4M3", dims(t.shape), [&assembler, &t, scale](size_t first, size_t count, void* dst) {
    const std::vector<double>& v = assembler.values(t);
    if (first == 0) *scale = fp8_scale(v);
    uint8_t* out = static_cast<uint8_t*>(dst);
    for (size_t i = 0; i < count; ++i)
      out[i] = e4m3_encode(static_cast<float>(v[first + i] / static_cast<double>(*scale)));
  });
  const std::string layer = t.name.substr(0, t.name.size() - 7);
  w.add_filled(layer + ".weight_scale", DType::f32, {},
               [scale](size_t, size_t, void* dst) { *static_cast<float*>(dst) = *scale; });
  return n + 4;
}

void check_diffusers_expressible(const FluxConfig& cfg) {
  auto refuse = [&](const char* key, const std::string& value, const char* needed) {
    fail(
        "export --format diffusers: model '{}' has {} = {}; diffusers' FluxTransformer2DModel has no such setting "
        "and always uses {}. Export --format bfl instead",
        cfg.name, key, value, needed);
  };
  if (cfg.mlp_ratio != 4.0) refuse("mlp_ratio", fmt::format("{}", cfg.mlp_ratio), "4");
  if (!cfg.qkv_bias) refuse("qkv_bias", "false", "biases on q, k and v");
  if (cfg.rope_theta != 10000.0) refuse("rope_theta", fmt::format("{}", cfg.rope_theta), "10000");
  if (cfg.qk_norm_eps != 1e-6) refuse("qk_norm_eps", fmt::format("{}", cfg.qk_norm_eps), "1e-6");
  if (cfg.layernorm_eps != 1e-6) refuse("layernorm_eps", fmt::format("{}", cfg.layernorm_eps), "1e-6");
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  f.close();
  if (!f) fail("export: cannot write {}", path.string());
}

ExportResult write_bfl(const std::vector<OutTensor>& tensors, TensorAssembler& assembler, const std::string& out,
                       const ExportOptions& o) {
  ExportResult r;
  const DType dtype = o.dtype == ExportDtype::f32 ? DType::f32 : DType::bf16;
  SafetensorsWriter w;
  nlohmann::json layers = nlohmann::json::object();
  for (const OutTensor& t : tensors) {
    r.tensor_bytes += add_tensor(w, t, assembler, dtype);
    if (t.fp8) {
      layers[t.name.substr(0, t.name.size() - 7)] = {{"format", "float8_e4m3fn"}};
      ++r.fp8_tensors;
    }
  }
  w.set_metadata("format", "pt");
  for (const auto& [k, v] : o.metadata) w.set_metadata(k, v);
  if (!layers.empty())
    w.set_metadata("_quantization_metadata", nlohmann::json{{"format_version", "1.0"}, {"layers", layers}}.dump());
  w.write(out);
  r.files.push_back(out);
  r.tensors = tensors.size();
  return r;
}

// The shards into `dir` (which exists and is empty), then the index and config.json.
ExportResult write_diffusers(const std::vector<OutTensor>& tensors, TensorAssembler& assembler, const fs::path& dir,
                             const FluxConfig& cfg, const ExportOptions& o) {
  const DType dtype = o.dtype == ExportDtype::f32 ? DType::f32 : DType::bf16;
  std::vector<uint64_t> bytes;
  for (const OutTensor& t : tensors) bytes.push_back(static_cast<uint64_t>(t.shape.numel()) * dtype_size(dtype));
  const std::vector<size_t> shard_of = assign_shards(bytes, o.max_shard_bytes);
  const size_t shards = shard_of.empty() ? 1 : shard_of.back() + 1;
  auto shard_name = [&](size_t s) {
    return shards == 1 ? std::string(kShardStem) + ".safetensors"
                       : fmt::format("{}-{:05d}-of-{:05d}.safetensors", kShardStem, s + 1, shards);
  };
  ExportResult r;
  std::map<std::string, std::string> weight_map;
  for (size_t s = 0, i = 0; s < shards; ++s) {
    SafetensorsWriter w;
    for (; i < tensors.size() && shard_of[i] == s; ++i) {
      r.tensor_bytes += add_tensor(w, tensors[i], assembler, dtype);
      weight_map[tensors[i].name] = shard_name(s);
    }
    w.set_metadata("format", "pt");
    for (const auto& [k, v] : o.metadata) w.set_metadata(k, v);
    const fs::path path = dir / shard_name(s);
    w.write(path.string());
    r.files.push_back(path.string());
  }
  if (shards > 1) {
    const fs::path index = dir / (std::string(kShardStem) + ".safetensors.index.json");
    write_text(index, safetensors_index_json(weight_map, r.tensor_bytes));
    r.files.push_back(index.string());
  }
  write_text(dir / "config.json", diffusers_config_json(cfg));
  r.files.push_back((dir / "config.json").string());
  r.tensors = tensors.size();
  return r;
}

}  // namespace

std::string diffusers_config_json(const FluxConfig& cfg) {
  check_diffusers_expressible(cfg);
  nlohmann::ordered_json j;
  j["_class_name"] = "FluxTransformer2DModel";
  j["_diffusers_version"] = kDiffusersVersion;
  j["attention_head_dim"] = cfg.head_dim();
  j["axes_dims_rope"] = cfg.axes_dim;
  j["guidance_embeds"] = cfg.guidance_embed;
  j["in_channels"] = cfg.in_channels;  // flux8's tokens are already patches: diffusers' patch_size 1
  j["joint_attention_dim"] = cfg.context_dim;
  j["num_attention_heads"] = cfg.num_heads;
  j["num_layers"] = cfg.num_double_blocks;
  j["num_single_layers"] = cfg.num_single_blocks;
  j["out_channels"] =
      cfg.out_channels == cfg.in_channels ? nlohmann::ordered_json() : nlohmann::ordered_json(cfg.out_channels);
  j["patch_size"] = 1;
  j["pooled_projection_dim"] = cfg.vec_dim;
  return j.dump(2) + "\n";
}

ExportResult export_weights(const WeightSource& source, const FluxConfig& cfg, const std::string& out,
                            const ExportOptions& o) {
  if (o.format == ExportFormat::diffusers && o.dtype == ExportDtype::fp8)
    fail(
        "export: --dtype fp8 is for --format bfl (ComfyUI's FP8 layout, per-tensor scales); diffusers' "
        "from_pretrained has no FP8 scales: export diffusers as bf16 or f32");
  if (o.format == ExportFormat::diffusers) check_diffusers_expressible(cfg);
  source.check(cfg);
  const ParamLayout layout = ParamLayout::build(cfg);
  const std::vector<OutTensor> tensors = out_tensors(layout, cfg, o);
  TensorAssembler assembler(source, cfg);
  if (o.format == ExportFormat::bfl) {
    if (fs::is_directory(out))
      fail("export --format bfl: --out {} is a folder; give the .safetensors file to write", out);
    return write_bfl(tensors, assembler, out, o);
  }
  std::error_code ec;
  if (fs::exists(out, ec) && !(fs::is_directory(out, ec) && fs::is_empty(out, ec)))
    fail("export --format diffusers: --out {} exists and is not an empty folder; name a new folder", out);
  // Written beside `out` and renamed into place: a failed export leaves no partial folder.
  const fs::path final_dir = fs::absolute(out);
  const fs::path tmp = final_dir.parent_path() / fmt::format(".{}.tmp-{}", final_dir.filename().string(), ::getpid());
  fs::remove_all(tmp, ec);
  if (!fs::create_directories(tmp, ec) || ec) fail("export: cannot create folder {}: {}", tmp.string(), ec.message());
  try {
    ExportResult r = write_diffusers(tensors, assembler, tmp, cfg, o);
    fs::rename(tmp, final_dir, ec);
    if (ec) fail("export: cannot rename {} to {}: {}", tmp.string(), final_dir.string(), ec.message());
    for (std::string& f : r.files) f = (fs::path(out) / fs::path(f).filename()).string();
    return r;
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
}

}  // namespace flux8

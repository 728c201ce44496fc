#include "model/weight_source.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include "core/error.h"
#include "fp8/format.h"
#include "model/name_map.h"

namespace flux8 {

namespace {

namespace fs = std::filesystem;

constexpr const char* kDiffusersIndex = "diffusion_pytorch_model.safetensors.index.json";
constexpr const char* kDiffusersFile = "diffusion_pytorch_model.safetensors";
constexpr const char* kComfyPrefix = "model.diffusion_model.";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_fp8(const std::string& dtype) { return dtype == "F8_E4M3" || dtype == "F8_E5M2"; }
bool loadable(const std::string& dtype) {
  return dtype == "F32" || dtype == "BF16" || dtype == "F16" || dtype == "F64" || is_fp8(dtype);
}

std::vector<int64_t> dims(const Shape& s) { return std::vector<int64_t>(s.d.begin(), s.d.begin() + s.rank); }
std::string shape_str(const std::vector<int64_t>& v) { return fmt::format("[{}]", fmt::join(v, ", ")); }

// ComfyUI's per-layer companions of "<layer>.weight": the weight's scale (current name first),
// and tensors that say how to run the layer, which loading the weights does not need.
const std::vector<std::string> kScaleSuffixes = {".weight_scale", ".scale_weight"};
const std::vector<std::string> kLayerExtras = {".input_scale", ".scale_input", ".comfy_quant"};

// Collects every problem before failing, so one run shows the user all of them.
struct Problems {
  std::vector<std::string> lines;
  void add(std::string s) { lines.push_back(std::move(s)); }
  void raise(const std::string& path, const FluxConfig& cfg, WeightNaming naming) const {
    if (lines.empty()) return;
    std::string msg = fmt::format("checkpoint {} ({} naming) does not match model '{}' ({} problem{}):", path,
                                  naming == WeightNaming::reference ? "reference" : "diffusers", cfg.name, lines.size(),
                                  lines.size() == 1 ? "" : "s");
    const size_t shown = std::min<size_t>(lines.size(), 40);
    for (size_t i = 0; i < shown; ++i) msg += "\n  " + lines[i];
    if (shown < lines.size()) msg += fmt::format("\n  ... and {} more", lines.size() - shown);
    msg +=
        "\nCheck that the config (hidden_size, num_*_blocks, guidance_embed, in_channels, ...) "
        "is the one the checkpoint was made with.";
    throw Error(msg);
  }
};

// The problem with scale tensor `t`, or "": one finite positive number in a float type.
std::string scale_problem(const SafetensorsReader& file, const SafetensorsTensor& t) {
  if (t.numel() != 1 || t.shape.size() > 1)
    return fmt::format("scale: {} is {}; a per-tensor scale is one number (shape [] or [1])", t.name,
                       shape_str(t.shape));
  if (t.dtype != "F32" && t.dtype != "BF16" && t.dtype != "F16" && t.dtype != "F64")
    return fmt::format("scale: {} is {}; scales must be F32, BF16, F16 or F64", t.name, t.dtype);
  double v = 0;
  file.read_f64(t.name, &v);
  if (!std::isfinite(v) || v <= 0) return fmt::format("scale: {} is {}; it must be finite and positive", t.name, v);
  return "";
}

}  // namespace

namespace {
std::string diffusers_file_in(const std::string& path) {
  std::error_code ec;
  for (const fs::path& dir : {fs::path(path), fs::path(path) / "transformer"})
    for (const char* name : {kDiffusersIndex, kDiffusersFile})
      if (fs::exists(dir / name, ec)) return (dir / name).string();
  return "";
}
}  // namespace

bool is_diffusers_folder(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && !diffusers_file_in(path).empty();
}

std::string locate_weights(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return path;
  if (std::string file = diffusers_file_in(path); !file.empty()) return file;
  fail(
      "weights folder '{}' has neither {} nor {} (a diffusers FluxTransformer2DModel folder), nor a transformer/ "
      "subfolder with one; give that folder, a .safetensors file, or a flux8 checkpoint directory",
      path, kDiffusersIndex, kDiffusersFile);
}

WeightSource WeightSource::open(const std::string& path, const std::string& prefix) {
  WeightSource s;
  s.path_ = locate_weights(path);
  s.files_ =
      ends_with(s.path_, ".index.json") ? SafetensorsSet::open_index(s.path_) : SafetensorsSet::open_file(s.path_);
  s.prefix_ = prefix;
  const SafetensorsSet& f = s.files_;
  if (prefix.empty() && !f.contains("img_in.weight") && !f.contains("x_embedder.weight") &&
      (f.contains(std::string(kComfyPrefix) + "img_in.weight") ||
       f.contains(std::string(kComfyPrefix) + "x_embedder.weight")))
    s.prefix_ = kComfyPrefix;
  if (f.contains(s.prefix_ + "img_in.weight")) {
    s.naming_ = WeightNaming::reference;
  } else if (f.contains(s.prefix_ + "x_embedder.weight")) {
    s.naming_ = WeightNaming::diffusers;
  } else {
    fail(
        "checkpoint {}: found neither '{}img_in.weight' (reference Flux naming) nor "
        "'{}x_embedder.weight' (diffusers naming); is this a Flux transformer checkpoint?",
        s.path_, s.prefix_, s.prefix_);
  }
  return s;
}

std::string WeightSource::scale_of(const std::string& name) const {
  if (!ends_with(name, ".weight")) return "";
  const std::string layer = name.substr(0, name.size() - 7);
  for (const std::string& suffix : kScaleSuffixes)
    if (files_.contains(layer + suffix)) return layer + suffix;
  return "";
}

std::string WeightSource::stored_as_is(const std::string& param) const {
  if (naming_ != WeightNaming::reference) return "";
  const std::string name = prefix_ + param;
  if (is_fp8(files_.tensor(name).dtype) || !scale_of(name).empty()) return "";
  return name;
}

void WeightSource::check(const FluxConfig& cfg) const {
  Problems problems;
  std::set<std::string> used;
  // Expected file tensors: name -> shape. The file holds whole tensors: a tensor-parallel rank
  // checks the full model's and loads its shards out of them.
  const ParamLayout full = ParamLayout::build(cfg);
  std::map<std::string, std::vector<int64_t>> expected;
  if (naming_ == WeightNaming::reference) {
    for (const ParamInfo& p : full.params()) expected[p.name] = dims(p.shape);
  } else {
    for (const DiffusersTensor& t : diffusers_tensors(full, cfg)) expected[t.name] = dims(t.shape);
  }
  for (const auto& [short_name, shape] : expected) {
    const std::string name = prefix_ + short_name;
    if (!files_.contains(name)) {
      problems.add(fmt::format("missing: {} {}", name, shape_str(shape)));
      continue;
    }
    used.insert(name);
    const SafetensorsTensor& t = files_.tensor(name);
    if (t.shape != shape)
      problems.add(
          fmt::format("shape: {} is {} in the file, the model needs {}", name, shape_str(t.shape), shape_str(shape)));
    if (!loadable(t.dtype))
      problems.add(
          fmt::format("dtype: {} is {}; weights must be F32, BF16, F16, F64, F8_E4M3 or F8_E5M2", name, t.dtype));
    if (!ends_with(name, ".weight")) continue;
    const std::string layer = name.substr(0, name.size() - 7);
    std::vector<std::string> scales;
    for (const std::string& suffix : kScaleSuffixes)
      if (files_.contains(layer + suffix)) scales.push_back(layer + suffix);
    for (const std::string& suffix : kLayerExtras)
      if (files_.contains(layer + suffix)) used.insert(layer + suffix);
    if (scales.size() > 1) problems.add(fmt::format("scale: {} has two scales, {}", name, fmt::join(scales, " and ")));
    for (const std::string& scale : scales) {
      used.insert(scale);
      if (!is_fp8(t.dtype))
        problems.add(fmt::format("scale: {} scales FP8 weights only, but {} is {}", scale, name, t.dtype));
      const std::string why = scale_problem(files_.file_of(scale), files_.tensor(scale));
      if (!why.empty()) problems.add(why);
    }
  }
  if (files_.contains(prefix_ + "scaled_fp8")) used.insert(prefix_ + "scaled_fp8");  // ComfyUI's marker
  for (const std::string& name : files_.names())
    if (name.rfind(prefix_, 0) == 0 && !used.count(name))
      problems.add(fmt::format("unexpected: {} (no such parameter in this model)", name));
  problems.raise(path_, cfg, naming_);
}

void WeightSource::read_tensor(const std::string& name, double* dst) const {
  const SafetensorsReader& file = files_.file_of(name);
  const SafetensorsTensor& t = file.tensor(name);
  if (!is_fp8(t.dtype)) {
    file.read_f64(name, dst);
    return;
  }
  double scale = 1;
  if (const std::string s = scale_of(name); !s.empty()) files_.file_of(s).read_f64(s, &scale);
  const Fp8Format format = t.dtype == "F8_E4M3" ? Fp8Format::e4m3 : Fp8Format::e5m2;
  const int64_t n = t.numel();
  // An FP8 value has at most 4 significant bits and an F32 scale 24: their product is exact in
  // f64, and rounds once when it is stored.
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<double>(fp8_decode(t.data[i], format)) * scale;
}

void WeightSource::read_param(const ParamInfo& whole, const FluxConfig& cfg, std::vector<double>& out) const {
  out.resize(static_cast<size_t>(whole.shape.numel()));
  if (naming_ == WeightNaming::reference) {
    read_tensor(prefix_ + whole.name, out.data());
    return;
  }
  // diffusers' tensors hold row ranges of the reference parameter (model/name_map.h).
  const int64_t row_elems = whole.shape.numel() / whole.shape[0];
  std::vector<double> src;
  for (const NamePiece& piece : diffusers_pieces(whole, cfg)) {
    const std::string name = prefix_ + piece.diffusers;
    src.resize(static_cast<size_t>(files_.tensor(name).numel()));
    read_tensor(name, src.data());
    std::copy_n(src.begin() + piece.diffusers_row * row_elems, piece.rows * row_elems,
                out.begin() + piece.bfl_row * row_elems);
  }
}

}  // namespace flux8

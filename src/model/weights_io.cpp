#include "model/weights_io.h"

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <set>
#include <vector>

#include "backend/backend.h"
#include "backend/transfer.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "model/name_map.h"

namespace flux8 {

namespace {

std::vector<int64_t> dims(const Shape& s) { return std::vector<int64_t>(s.d.begin(), s.d.begin() + s.rank); }

std::string shape_str(const std::vector<int64_t>& v) { return fmt::format("[{}]", fmt::join(v, ", ")); }

bool loadable_dtype(const std::string& d) { return d == "F32" || d == "BF16" || d == "F16" || d == "F64"; }

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

}  // namespace

void load_weights(ParamStore& store, const FluxConfig& cfg, const std::string& path, const std::string& prefix_in) {
  SafetensorsReader file(path);
  std::string prefix = prefix_in;
  if (prefix.empty() && !file.contains("img_in.weight") && !file.contains("x_embedder.weight") &&
      (file.contains("model.diffusion_model.img_in.weight")))
    prefix = "model.diffusion_model.";
  WeightNaming naming;
  if (file.contains(prefix + "img_in.weight")) {
    naming = WeightNaming::reference;
  } else if (file.contains(prefix + "x_embedder.weight")) {
    naming = WeightNaming::diffusers;
  } else {
    fail(
        "checkpoint {}: found neither '{}img_in.weight' (reference Flux naming) nor "
        "'{}x_embedder.weight' (diffusers naming); is this a Flux transformer checkpoint?",
        path, prefix, prefix);
  }

  Problems problems;
  std::set<std::string> used;
  // Expected file tensors: name -> shape. The file holds whole tensors: a tensor-parallel rank
  // checks the full model's and loads its shards out of them.
  const ParamLayout full = ParamLayout::build(cfg);
  std::map<std::string, std::vector<int64_t>> expected;
  if (naming == WeightNaming::reference) {
    for (const ParamInfo& p : full.params()) expected[p.name] = dims(p.shape);
  } else {
    for (const DiffusersTensor& t : diffusers_tensors(full, cfg)) expected[t.name] = dims(t.shape);
  }
  for (const auto& [name, shape] : expected) {
    const std::string full = prefix + name;
    if (!file.contains(full)) {
      problems.add(fmt::format("missing: {} {}", full, shape_str(shape)));
      continue;
    }
    used.insert(full);
    const SafetensorsTensor& t = file.tensor(full);
    if (t.shape != shape)
      problems.add(
          fmt::format("shape: {} is {} in the file, the model needs {}", full, shape_str(t.shape), shape_str(shape)));
    if (!loadable_dtype(t.dtype))
      problems.add(fmt::format("dtype: {} is {}; weights must be F32, BF16, F16 or F64", full, t.dtype));
  }
  for (const std::string& name : file.names())
    if (name.rfind(prefix, 0) == 0 && !used.count(name))
      problems.add(fmt::format("unexpected: {} (no such parameter in this model)", name));
  problems.raise(path, cfg, naming);

  Backend& be = store.backend();
  UploadBuffers buffers;
  for (const ParamInfo& p : store.layout().params()) {
    const Tensor t = store.param(p.name);
    if (naming == WeightNaming::reference && !p.shard.sharded()) {
      upload_file_tensor(be, file, prefix + p.name, t, buffers);
      continue;
    }
    // A shard, or diffusers' tensors, which hold pieces of several parameters: the whole tensor
    // assembled in f64 (exact for any parameter type), then this rank's shard of it.
    const ParamInfo& whole = full.at(p.name);
    std::vector<double> values(static_cast<size_t>(whole.shape.numel()));
    if (naming == WeightNaming::reference) {
      file.read_f64(prefix + p.name, values.data());
    } else {
      const int64_t row_elems = whole.shape.numel() / whole.shape[0];
      for (const NamePiece& piece : diffusers_pieces(whole, cfg)) {
        const std::string name = prefix + piece.diffusers;
        std::vector<double> src(static_cast<size_t>(file.tensor(name).numel()));
        file.read_f64(name, src.data());
        std::copy_n(src.begin() + piece.diffusers_row * row_elems, piece.rows * row_elems,
                    values.begin() + piece.bfl_row * row_elems);
      }
    }
    from_host(be, t, p.shard.sharded() ? take_shard(p.shard, p.shard.rank, values) : values);
  }
  store.params_changed();
}

void upload_file_tensor(Backend& be, const SafetensorsReader& file, const std::string& name, const Tensor& t,
                        UploadBuffers& buffers) {
  const SafetensorsTensor& stored = file.tensor(name);
  const auto n = static_cast<size_t>(stored.numel());
  if (t.dtype == DType::f64) {
    buffers.f64.resize(n);
    file.read_f64(name, buffers.f64.data());
    be.upload(t.data, buffers.f64.data(), n * 8);
    return;
  }
  const float* values;
  if (stored.dtype == "F32" && reinterpret_cast<uintptr_t>(stored.data) % alignof(float) == 0) {
    values = reinterpret_cast<const float*>(stored.data);  // straight from the file's mapping
  } else {
    buffers.f32.resize(n);
    file.read_f32(name, buffers.f32.data());
    values = buffers.f32.data();
  }
  upload_f32(be, t, values, buffers.scratch);
}

namespace {
void check_file_dtype(DType file_dtype) {
  if (file_dtype != DType::f32 && file_dtype != DType::bf16 && file_dtype != DType::f16)
    fail("save_weights: file dtype must be f32, bf16 or f16, not {}", dtype_name(file_dtype));
}

// A weights file holds whole tensors under their reference names: a tensor-parallel rank's
// shards would be written with the wrong shapes.
void check_whole_tensors(const std::vector<ParamInfo>& params, const std::string& what) {
  for (const ParamInfo& p : params)
    if (p.shard.sharded())
      fail(
          "{}: this model is rank {} of {} tensor-parallel ranks and holds a shard of '{}' ({} of {}); a weights "
          "file holds whole tensors: assemble them from every rank's shards (assemble_full) first",
          what, p.shard.rank, p.shard.size, p.name, p.shape.str(), p.shard.full.str());
}
}  // namespace

SafetensorsWriter::FillChunk FlatSource::fill(const ParamInfo& p, DType file_dtype,
                                              std::shared_ptr<std::vector<uint8_t>> scratch) const {
  const size_t esize = dtype_size(dtype);
  const char* first_element = static_cast<const char*>(data) + static_cast<size_t>(p.offset) * esize;
  if (backend)
    return [be = backend, t = Tensor(const_cast<char*>(first_element), dtype, p.shape), file_dtype, scratch](
               size_t first, size_t count, void* dst) { download_as(*be, t, first, count, file_dtype, dst, *scratch); };
  return [first_element, esize, src = dtype, file_dtype](size_t first, size_t count, void* dst) {
    convert_elements(first_element + first * esize, src, count, file_dtype, dst);
  };
}

SafetensorsWriter reference_weights_writer(const std::vector<ParamInfo>& params, const FlatSource& src,
                                           DType file_dtype, const std::map<std::string, std::string>& metadata) {
  check_file_dtype(file_dtype);
  check_whole_tensors(params, "the weights writer");
  SafetensorsWriter writer;
  auto scratch = std::make_shared<std::vector<uint8_t>>();  // the fills run one after another
  for (const ParamInfo& p : params)
    writer.add_filled(p.name, file_dtype, dims(p.shape), src.fill(p, file_dtype, scratch));
  writer.set_metadata("format", "pt");
  for (const auto& [k, v] : metadata) writer.set_metadata(k, v);
  return writer;
}

void save_weights(const ParamStore& store, const FluxConfig& cfg, const std::string& path, DType file_dtype,
                  WeightNaming naming, const std::map<std::string, std::string>& metadata) {
  check_whole_tensors(store.layout().params(), "save_weights " + path);
  if (naming == WeightNaming::reference) {
    reference_weights_writer(store.layout().params(), FlatSource::on_backend(store.backend(), store.flat_params()),
                             file_dtype, metadata)
        .write(path);
    return;
  }
  check_file_dtype(file_dtype);
  Backend& be = store.backend();
  SafetensorsWriter writer;
  // Host copies must outlive write(): one f32 vector per file tensor (diffusers' tensors are
  // assembled from pieces of several parameters).
  std::vector<std::vector<float>> host;
  host.reserve(store.layout().params().size() * 2);
  std::map<std::string, size_t> slot;
  for (const DiffusersTensor& t : diffusers_tensors(store.layout(), cfg)) {
    slot[t.name] = host.size();
    host.emplace_back(static_cast<size_t>(t.shape.numel()));
  }
  for (const ParamInfo& p : store.layout().params()) {
    const std::vector<double> v = to_host(be, store.param(p.name));
    const int64_t row_elems = p.shape.numel() / p.shape[0];
    for (const NamePiece& piece : diffusers_pieces(p, cfg)) {
      std::vector<float>& dst = host[slot.at(piece.diffusers)];
      std::copy_n(v.begin() + piece.bfl_row * row_elems, piece.rows * row_elems,
                  dst.begin() + piece.diffusers_row * row_elems);
    }
  }
  for (const DiffusersTensor& t : diffusers_tensors(store.layout(), cfg))
    writer.add_f32_as(t.name, dims(t.shape), host[slot.at(t.name)].data(), file_dtype);
  writer.set_metadata("format", "pt");
  for (const auto& [k, v] : metadata) writer.set_metadata(k, v);
  writer.write(path);
}

}  // namespace flux8

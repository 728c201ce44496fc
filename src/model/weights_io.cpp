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

}  // namespace

void load_weights(ParamStore& store, const FluxConfig& cfg, const std::string& path, const std::string& prefix) {
  const WeightSource source = WeightSource::open(path, prefix);
  source.check(cfg);
  const ParamLayout full = ParamLayout::build(cfg);
  Backend& be = store.masters_backend();
  UploadBuffers buffers;
  std::vector<double> values;
  for (const ParamInfo& p : store.layout().params()) {
    if (store.masters_sharded()) {  // the part of the tensor this rank holds the masters of
      const ParamStore::HeldPart part = store.held_part(p);
      if (!part.view.defined()) continue;
      source.read_param(full.at(p.name), cfg, values);
      const std::vector<double> mine = p.shard.sharded() ? take_shard(p.shard, p.shard.rank, values) : values;
      from_host(be, part.view,
                std::vector<double>(mine.begin() + part.first, mine.begin() + part.first + part.view.numel()));
      continue;
    }
    const Tensor t = store.param(p.name);
    if (const std::string name = source.stored_as_is(p.name); !name.empty() && !p.shard.sharded()) {
      upload_file_tensor(be, source.files().file_of(name), name, t, buffers);
      continue;
    }
    // A shard, diffusers' tensors (pieces of several parameters) or FP8 codes: the whole tensor
    // in f64 (exact for any parameter type), then this rank's shard of it.
    source.read_param(full.at(p.name), cfg, values);
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
  if (store.masters_sharded())
    fail(
        "save_weights {}: this rank holds its shard of the master weights only (use_distributed_optimizer); save a "
        "checkpoint, whose model.safetensors holds every tensor, or export from one",
        path);
  if (naming == WeightNaming::reference) {
    reference_weights_writer(store.layout().params(),
                             FlatSource::on_backend(store.masters_backend(), store.flat_params()), file_dtype, metadata)
        .write(path);
    return;
  }
  check_file_dtype(file_dtype);
  Backend& be = store.masters_backend();
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

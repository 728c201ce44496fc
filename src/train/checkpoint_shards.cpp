#include "train/checkpoint_shards.h"

#include <algorithm>
#include <cstddef>
#include <memory>
#include <tuple>
#include <vector>

#include "backend/transfer.h"
#include "core/error.h"
#include "train/checkpoint.h"

namespace flux8 {

namespace {

// A flat buffer of the whole model (the one-rank layout) in host memory.
struct WholeFlat {
  std::unique_ptr<std::byte[]> data;  // uninitialised: every parameter's elements are written
  DType dtype = DType::f32;
  FlatSource source() const { return FlatSource{nullptr, data.get(), dtype}; }
};

// One backend buffer that holds a split tensor's shards from every rank, for all_gather.
class Staging {
 public:
  Staging(Backend& be, size_t bytes) : be_(be), data_(bytes ? be.allocate(bytes) : nullptr) {}
  ~Staging() {
    if (data_) be_.release(data_);
  }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  void* data() const { return data_; }

 private:
  Backend& be_;
  void* data_;
};

Tensor flat_view(void* data, DType dtype, int64_t n) { return Tensor(data, dtype, Shape{n}); }

// The bytes of the largest split tensor's whole size, in the widest of the buffers' types.
size_t staging_bytes(const ParamLayout& local, const std::vector<const Tensor*>& flats) {
  int64_t most = 0;
  for (const ParamInfo& p : local.params())
    if (p.shard.sharded()) most = std::max(most, p.shard.full.numel());
  size_t widest = 0;
  for (const Tensor* f : flats) widest = std::max(widest, dtype_size(f->dtype));
  return static_cast<size_t>(most) * widest;
}

void check_buffer(const ProcessGroups& groups, const ParamStore& store, const Tensor& t, const char* name) {
  const int64_t n = store.layout().total();
  if (!t.defined() || !t.contiguous() || t.numel() != n ||
      (t.dtype != DType::f32 && t.dtype != DType::f64 && t.dtype != DType::bf16))
    fail(
        "save_checkpoint_shards on rank {} (tensor-parallel rank {} of {}): {} must be a contiguous f32/f64/bf16 "
        "buffer of {} elements laid out like this rank's parameters (the whole-buffer moments: gather_moments() "
        "first), got {}",
        groups.world_rank(), groups.tp_rank(), groups.tp_size(), name, n, t.str());
}

void check_store(const ProcessGroups& groups, const ParamStore& store) {
  for (const ParamInfo& p : store.layout().params())
    if (p.shard.size != groups.tp_size() || p.shard.rank != groups.tp_rank())
      fail(
          "save_checkpoint_shards on rank {}: parameter '{}' is tensor-parallel rank {} of {}, but this rank is "
          "tensor-parallel rank {} of {}: build the model with the job's tensor-parallel group",
          groups.world_rank(), p.name, p.shard.rank, p.shard.size, groups.tp_rank(), groups.tp_size());
}

// Brings `flat` (this rank's shard of every tensor, laid out like `local`, on `flat_on`) to
// tensor-parallel rank 0 as the whole model laid out like `whole`: split tensors all-gathered one
// at a time through `staging` (a flat in host memory goes up through `mine` first), the rest
// downloaded by rank 0 alone. `out` is filled on rank 0 only.
void gather_flat(Communicator& tp, Backend& be, const ParamLayout& local, const ParamLayout& whole, const Tensor& flat,
                 Backend& flat_on, const Staging& staging, const Staging& mine_staging, WholeFlat* out) {
  const size_t esize = dtype_size(flat.dtype);
  std::vector<std::byte> shards;  // rank 0: one split tensor's shards, downloaded
  for (const ParamInfo& p : local.params()) {
    const int64_t n = p.shape.numel();
    std::byte* full = out ? out->data.get() + static_cast<size_t>(whole.at(p.name).offset) * esize : nullptr;
    auto* mine = static_cast<std::byte*>(flat.data) + static_cast<size_t>(p.offset) * esize;
    if (!p.shard.sharded()) {
      if (out) flat_on.download(full, mine, static_cast<size_t>(n) * esize);
      continue;
    }
    if (&flat_on != &be) {
      be.upload(mine_staging.data(), mine, static_cast<size_t>(n) * esize);
      mine = static_cast<std::byte*>(mine_staging.data());
    }
    const int64_t gathered = n * p.shard.size;
    tp.all_gather(flat_view(staging.data(), flat.dtype, gathered), flat_view(mine, flat.dtype, n));
    if (!out) continue;
    shards.resize(static_cast<size_t>(gathered) * esize);
    be.download(shards.data(), staging.data(), shards.size());
    for (int r = 0; r < p.shard.size; ++r)
      place_shard(p.shard, r, shards.data() + static_cast<size_t>(r * n) * esize, full, esize);
  }
}

// The bytes of the largest split tensor's local shard, in the widest type (the upload of a shard
// kept in host memory).
size_t local_staging_bytes(const ParamLayout& local, const std::vector<const Tensor*>& flats) {
  int64_t most = 0;
  for (const ParamInfo& p : local.params())
    if (p.shard.sharded()) most = std::max(most, p.shape.numel());
  size_t widest = 0;
  for (const Tensor* f : flats) widest = std::max(widest, dtype_size(f->dtype));
  return static_cast<size_t>(most) * widest;
}

}  // namespace

std::string save_checkpoint_shards(ProcessGroups& groups, const std::string& root, const TrainerState& state,
                                   const FluxConfig& cfg, const ParamStore& store, const Tensor& adam_m,
                                   const Tensor& adam_v, int keep_last, const Fp8MetaRegistry* fp8) {
  return save_checkpoint_shards(groups, root, state, cfg, store, CheckpointFlats::of(store, adam_m, adam_v), keep_last,
                                fp8);
}

std::string save_checkpoint_shards(ProcessGroups& groups, const std::string& root, const TrainerState& state,
                                   const FluxConfig& cfg, const ParamStore& store, const CheckpointFlats& flats,
                                   int keep_last, const Fp8MetaRegistry* fp8) {
  if (groups.dp_rank() != 0) return "";
  check_store(groups, store);
  check_buffer(groups, store, flats.params, "the master weights");
  check_buffer(groups, store, flats.adam_m, "adam_m");
  check_buffer(groups, store, flats.adam_v, "adam_v");
  const bool writer = groups.tp_rank() == 0;
  Backend& be = store.backend();
  const ParamLayout whole = ParamLayout::build(cfg);
  const std::vector<const Tensor*> all{&flats.params, &flats.adam_m, &flats.adam_v};
  const Staging staging(be, staging_bytes(store.layout(), all));
  const bool any_on_host = flats.params_on != &be || flats.moments_on != &be;
  const Staging mine_staging(be, any_on_host ? local_staging_bytes(store.layout(), all) : 0);
  WholeFlat values, m, v;
  for (const auto& [flat, on, host] :
       {std::tuple{&flats.params, flats.params_on, &values}, std::tuple{&flats.adam_m, flats.moments_on, &m},
        std::tuple{&flats.adam_v, flats.moments_on, &v}}) {
    if (writer) {
      host->dtype = flat->dtype;
      host->data.reset(new std::byte[static_cast<size_t>(whole.total()) * dtype_size(flat->dtype)]);
    }
    gather_flat(groups.tp(), be, store.layout(), whole, *flat, *on, staging, mine_staging, writer ? host : nullptr);
  }
  if (!writer) return "";
  return save_checkpoint(root, state, whole.params(), values.source(), m.source(), v.source(), keep_last, fp8);
}

void upload_file_shard(Backend& be, const SafetensorsReader& file, const std::string& name, const ParamInfo& p,
                       const Tensor& t, UploadBuffers& buffers) {
  if (!p.shard.sharded()) {
    upload_file_tensor(be, file, name, t, buffers);
    return;
  }
  std::vector<double>& whole = buffers.f64;
  whole.resize(static_cast<size_t>(p.shard.full.numel()));
  file.read_f64(name, whole.data());
  from_host(be, t, take_shard(p.shard, p.shard.rank, whole));
}

}  // namespace flux8

#include "train/optimizer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "backend/backend.h"
#include "config/config.h"
#include "core/dtype.h"
#include "core/error.h"

namespace flux8 {

AdamWConfig AdamWConfig::from_config(const Config& c) {
  AdamWConfig a;
  a.beta1 = c.get_float("adam_beta1");
  a.beta2 = c.get_float("adam_beta2");
  a.eps = c.get_float("adam_eps");
  a.weight_decay = c.get_float("weight_decay");
  a.clip_grad = c.get_float("clip_grad");
  a.moment_dtype = c.get_string("adam_moment_precision") == "bf16" ? DType::bf16 : DType::f32;
  const std::string offload = c.get_string("optimizer_offload");
  a.offload = offload != "none";
  a.offload_masters = offload == "cpu";
  a.offload_chunk = c.get_int("optimizer_offload_chunk");
  a.host_update = c.get_string("optimizer_offload_update") == "host";
  a.overlap = c.get_bool("optimizer_offload_overlap");
  return a;
}

AdamWOptimizer::AdamWOptimizer(ParamStore& store, AdamWConfig cfg) : store_(store), cfg_(cfg) {
  // adam_moment_precision bf16 applies to f32 parameters; the f64 models of the gradient
  // checks keep f64 moments (moment_dtype f32 means "the parameters' type").
  if (cfg.moment_dtype == DType::bf16 && store.dtype() != DType::f32)
    fail("adam_moment_precision bf16 needs f32 parameters; this model's are {}", dtype_name(store.dtype()));
  if (cfg.offload && cfg.offload_chunk < 64)
    fail("optimizer offload: a chunk of {} elements is below the minimum of 64", cfg.offload_chunk);
  if (cfg.offload_masters != store.masters_offloaded())
    fail("internal error: optimizer_offload: cpu needs the model's master weights in host memory, and only then");
  if (cfg.host_update && !cfg.offload_masters)
    fail("optimizer_offload_update: host runs AdamW where the master weights are: it needs optimizer_offload: cpu");
  // The host memory of offloaded moments: a CPU backend's, so that checkpoints read and write them
  // through the same Backend calls as moments on the device.
  if (cfg.offload_masters) {
    host_ = &store.masters_backend();
  } else if (cfg.offload) {
    own_host_ = make_backend("cpu");
    host_ = own_host_.get();
  }
  owned_ = FlatRange{0, store.layout().total()};
  m_ = allocate_moment(owned_.count);
  v_ = allocate_moment(owned_.count);
}

Tensor AdamWOptimizer::allocate_moment(int64_t n, bool pin) {
  const DType dt = cfg_.moment_dtype == DType::bf16 ? DType::bf16 : store_.dtype();
  const size_t bytes = static_cast<size_t>(n) * dtype_size(dt);
  const Tensor t(moments_backend().allocate(bytes), dt, Shape{n});
  if (host_ && pin && store_.backend().register_host_memory(t.data, bytes)) pinned_.push_back(t.data);
  return t;
}

void AdamWOptimizer::release_moment(Tensor& t) {
  if (!t.defined()) return;
  if (const auto it = std::find(pinned_.begin(), pinned_.end(), t.data); it != pinned_.end()) {
    store_.backend().unregister_host_memory(t.data);
    pinned_.erase(it);
  }
  moments_backend().release(t.data);
  t = Tensor{};
}

AdamWOptimizer::~AdamWOptimizer() {
  release_full_moments();
  release_moment(m_);
  release_moment(v_);
  release_slots();
  release_moment(host_grads_);
  release_moment(host_grads_raw_);
}

void AdamWOptimizer::set_data_parallel(DataParallel* dp, bool distributed) {
  dp_ = dp && dp->size() > 1 ? dp : nullptr;
  const bool shard = dp_ && distributed;
  if (shard && store_.masters_offloaded())
    fail(
        "optimizer_offload: cpu keeps every rank's whole f32 master weights in its host memory, which "
        "use_distributed_optimizer would shard: set optimizer_offload: moments to offload each rank's shard of the "
        "moments, or turn use_distributed_optimizer off");
  if (shard != sharded_) {
    sharded_ = shard;
    release_moment(m_);
    release_moment(v_);
    const int64_t total = store_.layout().total();
    sharding_ = FlatSharding::of(total, shard ? dp_->size() : 1);
    owned_ = shard ? sharding_.owned(dp_->rank()) : FlatRange{0, total};
    m_ = allocate_moment(owned_.count);
    v_ = allocate_moment(owned_.count);
    if (shard && !full_host_) full_host_ = make_backend("cpu");
  }
  if (store_.masters_sharded() &&
      (!sharded_ || store_.held_begin() != owned_.begin || store_.held_count() != owned_.count))
    fail(
        "internal error: the model holds the master weights of flat range [{}, {}), the optimizer updates [{}, {}): "
        "build the model with AdamWOptimizer::master_shards of the same data-parallel group",
        store_.held_begin(), store_.held_begin() + store_.held_count(), owned_.begin, owned_.end());
}

MasterShards AdamWOptimizer::master_shards(DataParallel* dp, bool distributed, int64_t total) {
  if (!dp || dp->size() < 2 || !distributed) return {};
  const FlatSharding s = FlatSharding::of(total, dp->size());
  MasterShards m{&dp->group(), {}};
  for (int r = 0; r < s.ranks; ++r) m.begins.push_back(s.owned(r).begin);
  m.begins.push_back(total);
  return m;
}

Tensor AdamWOptimizer::masters(FlatRange r) const {
  if (!store_.masters_sharded()) return flat_slice(store_.flat_params(), r);
  return flat_slice(store_.held_masters(), {r.begin - store_.held_begin(), r.count});
}

namespace {
Tensor allocate_on(Backend& be, int64_t n, DType dt) {
  return Tensor(be.allocate(static_cast<size_t>(n) * dtype_size(dt)), dt, Shape{n});
}
}  // namespace

void AdamWOptimizer::allocate_full_moments() {
  if (!sharded_ || full_m_.defined()) return;
  full_m_ = allocate_on(*full_host_, sharding_.total, m_.dtype);
  full_v_ = allocate_on(*full_host_, sharding_.total, v_.dtype);
}

void AdamWOptimizer::gather_moments() {
  if (!sharded_) return;
  release_full_moments();
  if (dp_->rank() == 0) {
    allocate_full_moments();
    if (store_.masters_sharded()) full_p_ = allocate_on(*full_host_, sharding_.total, store_.dtype());
  }
  gather_to_lead(m_, moments_backend(), full_m_);
  gather_to_lead(v_, moments_backend(), full_v_);
  if (store_.masters_sharded()) gather_to_lead(store_.held_masters(), store_.backend(), full_p_);
}

void AdamWOptimizer::gather_to_lead(const Tensor& mine, Backend& mine_on, const Tensor& full) {
  // Round k brings every rank's k-th piece of its shard: piece j of the group's gather buffer is
  // rank j's, the shorter ones (past the end of a shard) padded. The last rank's shard is the
  // longest (it owns the tail). The buffer holds optimizer_offload_chunk elements of all ranks.
  Backend& be = store_.backend();
  const int ranks = sharding_.ranks;
  const int64_t longest = sharding_.owned(ranks - 1).count;
  const int64_t piece = std::max<int64_t>(64, std::min(cfg_.offload_chunk / ranks, (longest + 63) / 64 * 64) / 64 * 64);
  const size_t es = dtype_size(mine.dtype);
  const Tensor buffer(be.allocate(static_cast<size_t>(piece) * ranks * es), mine.dtype, Shape{piece * ranks});
  const FlatSharding pieces = FlatSharding::of(piece * ranks, ranks);
  std::vector<std::byte> host(full.defined() ? static_cast<size_t>(piece) * ranks * es : 0);
  for (int64_t at = 0; at < longest; at += piece) {
    const int64_t n = std::clamp<int64_t>(owned_.count - at, 0, piece);
    if (n > 0) {
      const Tensor dst = flat_slice(buffer, {piece * dp_->rank(), n}), src = flat_slice(mine, {at, n});
      if (&mine_on == &be)
        be.copy(dst, src);
      else
        be.upload(dst.data, src.data, static_cast<size_t>(n) * es);
    }
    dp_->all_gather_params(buffer, pieces);
    if (!full.defined()) continue;
    be.download(host.data(), buffer.data, host.size());
    for (int r = 0; r < ranks; ++r) {
      const FlatRange theirs = sharding_.owned(r);
      const int64_t k = std::clamp<int64_t>(theirs.count - at, 0, piece);
      if (k > 0)
        std::memcpy(flat_slice(full, {theirs.begin + at, k}).data, host.data() + static_cast<size_t>(r * piece) * es,
                    static_cast<size_t>(k) * es);
    }
  }
  be.release(buffer.data);
}

void AdamWOptimizer::release_full_moments() {
  for (Tensor* t : {&full_m_, &full_v_, &full_p_})
    if (t->defined()) {
      full_host_->release(t->data);
      *t = Tensor{};
    }
}

void AdamWOptimizer::set_tensor_parallel(DataParallel* tp) {
  tp_ = tp && tp->size() > 1 ? tp : nullptr;
  split_runs_.clear();
  if (!tp_) return;
  for (const ParamInfo& p : store_.layout().params()) {
    if (!p.shard.sharded()) continue;
    if (!split_runs_.empty() && split_runs_.back().end() == p.offset)
      split_runs_.back().count += p.shape.numel();
    else
      split_runs_.push_back({p.offset, p.shape.numel()});
  }
}

double AdamWOptimizer::job_sum_squares(FlatRange range, const std::vector<Backend::LowRankGrad>& low_rank) {
  Backend& be = store_.backend();
  const Tensor grads = store_.flat_grads();
  // [0]: everything in range; [1]: the split parameters' part of it, to be summed over the
  // tensor-parallel group while the replicated rest counts once (one op for all the runs: one
  // read-back, not one a run).
  std::vector<Backend::ElementRange> runs;
  for (const FlatRange& run : split_runs_) {
    const int64_t begin = std::max(run.begin, range.begin), end = std::min(run.end(), range.end());
    if (end > begin) runs.push_back({begin, end - begin});
  }
  std::vector<double> local{be.gradient_sum_squares(flat_slice(grads, range), low_rank),
                            runs.empty() ? 0.0 : be.ranges_sum_squares(grads, runs)};
  if (sharded_) dp_->sum(local);  // the data-parallel shards of the buffer
  if (!tp_) return local[0];
  std::vector<double> split{local[1]};
  tp_->sum(split);
  return (local[0] - local[1]) + split[0];
}

StepStats AdamWOptimizer::sharded_step(int64_t step, double lr) {
  StepStats s;
  s.lr = lr;
  const Tensor grads = store_.flat_grads();
  if (!caller_reduces_) dp_->reduce_scatter_gradients(grads, sharding_);
  s.grad_norm = std::sqrt(job_sum_squares(owned_, {}));
  if (!std::isfinite(s.grad_norm)) return s;
  const double scale = cfg_.clip_grad > 0 && s.grad_norm > cfg_.clip_grad ? cfg_.clip_grad / s.grad_norm : 1.0;
  update(s, owned_, Backend::AdamW{lr, cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay, scale, step}, {}, {}, {});
  store_.params_changed();
  if (store_.masters_sharded())
    store_.refresh_device_forms();  // every rank's forms from the updated masters, a window at a time
  else
    dp_->all_gather_params(store_.flat_params(), sharding_);  // operand copies are made again at first use
  s.applied = true;
  return s;
}

StepStats AdamWOptimizer::step(int64_t step, double lr, std::span<const Backend::ParamCast> casts) {
  if (sharded_) return sharded_step(step, lr);
  if (dp_ && !caller_reduces_) dp_->all_reduce_gradients(store_.flat_grads());
  StepStats s;
  s.lr = lr;
  // The per-sample Linears' gradients may be kept as factors (ParamStore::keep_low_rank_grads):
  // the norm and the update read them from there.
  const std::vector<Backend::LowRankGrad> low_rank = store_.low_rank_grads();
  s.grad_norm = std::sqrt(job_sum_squares(FlatRange{0, store_.layout().total()}, low_rank));
  if (!std::isfinite(s.grad_norm)) return s;
  // Clipping scales the gradient inside the update (no extra pass over the gradients).
  const double scale = cfg_.clip_grad > 0 && s.grad_norm > cfg_.clip_grad ? cfg_.clip_grad / s.grad_norm : 1.0;
  // The weights' bf16 operand copies are written with the new weights (a conversion pass less).
  const std::vector<Backend::ParamCopy> copies = store_.operand_copies();
  update(s, owned_, Backend::AdamW{lr, cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay, scale, step}, copies, casts,
         low_rank);
  store_.params_updated();
  s.applied = true;
  s.casts_written = !casts.empty();
  return s;
}

// ---- the update, in place or streamed from host memory ----------------------------------------

void AdamWOptimizer::update(StepStats& s, FlatRange range, const Backend::AdamW& h,
                            std::span<const Backend::ParamCopy> copies, std::span<const Backend::ParamCast> casts,
                            const std::vector<Backend::LowRankGrad>& low_rank) {
  if (!host_) {
    Backend::AdamW at = h;
    at.index_base = range.begin;
    store_.backend().adamw(masters(range), flat_slice(store_.flat_grads(), range), m_, v_, at, copies, casts, low_rank);
    return;
  }
  // Copies, casts and low-rank gradients cover whole parameters: their chunks end at parameter
  // boundaries. A shard's update has none of them and cuts where it likes.
  const std::vector<FlatRange> chunks = offload_chunks(range, !sharded_);
  int64_t longest = 0;
  for (const FlatRange& c : chunks) longest = std::max(longest, c.count);
  const bool overlap = cfg_.overlap && !cfg_.host_update && chunks.size() > 1;
  allocate_device_chunk(longest, overlap ? 2 : 1);
  if (cfg_.host_update) {
    for (const FlatRange& c : chunks) update_chunk_on_host(s, c, h, copies, casts, low_rank);
    return;
  }
  if (overlap) return update_overlapped(s, chunks, h, copies, casts, low_rank);
  for (const FlatRange& c : chunks) update_chunk(s, c, h, copies, casts, low_rank);
}

std::vector<FlatRange> AdamWOptimizer::offload_chunks(FlatRange range, bool whole_params) const {
  std::vector<FlatRange> chunks;
  if (!whole_params) {
    for (int64_t at = range.begin; at < range.end(); at += cfg_.offload_chunk)
      chunks.push_back({at, std::min(cfg_.offload_chunk, range.end() - at)});
    return chunks;
  }
  // A chunk grows parameter by parameter to offload_chunk elements; it may end only where the
  // next parameter starts at an even index (the moments' rounding noise comes in pairs), so a
  // chunk can pass the target by a parameter or two.
  int64_t begin = range.begin;
  for (const ParamInfo& p : store_.layout().params()) {
    if (p.offset <= begin || p.offset % 2 != 0) continue;
    if (p.offset + p.shape.numel() - begin > cfg_.offload_chunk) {
      chunks.push_back({begin, p.offset - begin});
      begin = p.offset;
    }
  }
  if (range.end() > begin) chunks.push_back({begin, range.end() - begin});
  return chunks;
}

void AdamWOptimizer::release_slots() {
  for (DeviceSlot& slot : slots_)
    for (Tensor* t : {&slot.m, &slot.v, &slot.p})
      if (t->defined()) {
        store_.backend().release(t->data);
        *t = Tensor{};
      }
}

void AdamWOptimizer::allocate_device_chunk(int64_t elements, int slots) {
  Backend& be = store_.backend();
  const auto fits = [&](const Tensor& t) { return t.defined() && t.numel() >= elements; };
  const auto on_device = [&](DType dt) {
    return Tensor(be.allocate(static_cast<size_t>(elements) * dtype_size(dt)), dt, Shape{elements});
  };
  if (cfg_.host_update) {  // the device holds the masters' chunk alone; the gradients' comes to the host
    if (fits(slots_[0].p)) return;
    release_slots();
    release_moment(host_grads_);
    release_moment(host_grads_raw_);
    const DType dt = store_.dtype(), stored = store_.grad_dtype();
    slots_[0].p = on_device(dt);
    const auto pinned = [&](DType t) {
      const size_t bytes = static_cast<size_t>(elements) * dtype_size(t);
      const Tensor out(host_->allocate(bytes), t, Shape{elements});
      if (be.register_host_memory(out.data, bytes)) pinned_.push_back(out.data);
      return out;
    };
    host_grads_ = pinned(dt);
    if (stored != dt) host_grads_raw_ = pinned(stored);
    return;
  }
  if (fits(slots_[0].m) && (slots < 2 || fits(slots_[1].m))) return;
  release_slots();
  for (int i = 0; i < slots; ++i) {
    slots_[i].m = on_device(m_.dtype);
    slots_[i].v = on_device(m_.dtype);
    if (store_.masters_offloaded()) slots_[i].p = on_device(store_.dtype());
  }
}

namespace {

// The items of an adamw list (copies, casts, low-rank gradients) inside `chunk`, their offsets
// counted from the chunk's start, as adamw counts them from its param tensor.
template <typename Items>
auto in_chunk(const Items& items, FlatRange chunk) {
  std::vector<std::decay_t<decltype(*items.begin())>> out;
  for (auto item : items)
    if (item.offset >= chunk.begin && item.offset < chunk.end()) {
      item.offset -= chunk.begin;
      out.push_back(item);
    }
  return out;
}

// Host seconds since `t`, added to `total`; `t` moves on.
void lap(std::chrono::steady_clock::time_point& t, double& total) {
  const auto now = std::chrono::steady_clock::now();
  total += std::chrono::duration<double>(now - t).count();
  t = now;
}

}  // namespace

void AdamWOptimizer::apply_chunk(int slot, FlatRange chunk, Backend::AdamW h,
                                 std::span<const Backend::ParamCopy> copies, std::span<const Backend::ParamCast> casts,
                                 const std::vector<Backend::LowRankGrad>& low_rank) {
  Backend& be = store_.backend();
  const DeviceSlot& d = slots_[slot];
  const Tensor params = store_.masters_offloaded() ? flat_slice(d.p, {0, chunk.count}) : masters(chunk);
  h.index_base = chunk.begin;
  be.adamw(params, flat_slice(store_.flat_grads(), chunk), flat_slice(d.m, {0, chunk.count}),
           flat_slice(d.v, {0, chunk.count}), h, in_chunk(copies, chunk), in_chunk(casts, chunk),
           in_chunk(low_rank, chunk));
  // The residents the model reads are copied from the updated chunk.
  const std::vector<Backend::CopyPair> residents = store_.resident_copies(chunk.begin, chunk.count, params);
  if (!residents.empty()) be.copy_batch(residents);
}

std::vector<AdamWOptimizer::ChunkCopy> AdamWOptimizer::chunk_copies(int slot, FlatRange chunk) const {
  const DeviceSlot& d = slots_[slot];
  const FlatRange mine{chunk.begin - owned_.begin, chunk.count};  // in this rank's moments
  const size_t bytes = static_cast<size_t>(chunk.count) * dtype_size(m_.dtype);
  std::vector<ChunkCopy> out{{flat_slice(m_, mine).data, d.m.data, bytes},
                             {flat_slice(v_, mine).data, d.v.data, bytes}};
  // Offloaded masters come up with their moments and go back with them.
  if (store_.masters_offloaded()) {
    const Tensor held = masters(chunk);
    out.push_back({held.data, d.p.data, held.bytes()});
  }
  return out;
}

void AdamWOptimizer::update_chunk(StepStats& s, FlatRange chunk, Backend::AdamW h,
                                  std::span<const Backend::ParamCopy> copies, std::span<const Backend::ParamCast> casts,
                                  const std::vector<Backend::LowRankGrad>& low_rank) {
  Backend& be = store_.backend();
  const std::vector<ChunkCopy> state = chunk_copies(0, chunk);
  be.synchronize();  // the step's backward, not this chunk's transfers
  auto t = std::chrono::steady_clock::now();
  for (const ChunkCopy& c : state) be.upload(c.device, c.host, c.bytes);
  lap(t, s.transfer_s);
  apply_chunk(0, chunk, h, copies, casts, low_rank);
  be.synchronize();
  lap(t, s.update_s);
  for (const ChunkCopy& c : state) be.download(c.host, c.device, c.bytes);
  lap(t, s.transfer_s);
}

void AdamWOptimizer::update_overlapped(StepStats& s, const std::vector<FlatRange>& chunks, const Backend::AdamW& h,
                                       std::span<const Backend::ParamCopy> copies,
                                       std::span<const Backend::ParamCast> casts,
                                       const std::vector<Backend::LowRankGrad>& low_rank) {
  Backend& be = store_.backend();
  if (!up_) {
    up_ = be.make_copy_queue();
    down_ = be.make_copy_queue();
    for (auto* events : {&uploaded_, &updated_, &downloaded_})
      for (auto& e : *events) e = be.make_event();
  }
  be.synchronize();  // the step's backward
  auto t = std::chrono::steady_clock::now();
  for (size_t k = 0; k < chunks.size(); ++k) {
    const int slot = static_cast<int>(k % 2);
    const std::vector<ChunkCopy> state = chunk_copies(slot, chunks[k]);
    // Up, once the slot's previous chunk (k - 2) has gone down.
    if (k >= 2) up_->wait_event(*downloaded_[slot]);
    for (const ChunkCopy& c : state) up_->upload(c.device, c.host, c.bytes);
    up_->record_event(*uploaded_[slot]);
    // The update, once it is up; then down, once it is updated.
    be.wait_event(*uploaded_[slot]);
    apply_chunk(slot, chunks[k], h, copies, casts, low_rank);
    be.record_event(*updated_[slot]);
    down_->wait_event(*updated_[slot]);
    for (const ChunkCopy& c : state) down_->download(c.host, c.device, c.bytes);
    down_->record_event(*downloaded_[slot]);
  }
  // The host reads the moments and masters next (a checkpoint, the next update): all down, and
  // with them every update they waited for.
  down_->synchronize();
  lap(t, s.update_s);
  s.overlapped = true;
}

void AdamWOptimizer::update_chunk_on_host(StepStats& s, FlatRange chunk, Backend::AdamW h,
                                          std::span<const Backend::ParamCopy> copies,
                                          std::span<const Backend::ParamCast> casts,
                                          const std::vector<Backend::LowRankGrad>& low_rank) {
  Backend& be = store_.backend();
  const Tensor held = masters(chunk);  // in host memory (offload_masters)
  const Tensor params = flat_slice(slots_[0].p, {0, chunk.count});
  const Tensor grads = flat_slice(store_.flat_grads(), chunk), g = flat_slice(host_grads_, {0, chunk.count});
  be.synchronize();  // the step's backward, not this chunk's transfers
  auto t = std::chrono::steady_clock::now();
  if (grads.dtype == g.dtype) {
    be.download(g.data, grads.data, grads.bytes());
  } else {  // bf16 gradients come down as they are and are widened on the host (exactly)
    if (grads.dtype != DType::bf16 || g.dtype != DType::f32)
      fail("internal error: optimizer_offload_update: host widens bf16 gradients to f32, not {} to {}",
           dtype_name(grads.dtype), dtype_name(g.dtype));
    const Tensor raw = flat_slice(host_grads_raw_, {0, chunk.count});
    be.download(raw.data, grads.data, grads.bytes());
    const uint16_t* bits = static_cast<const uint16_t*>(raw.data);
    float* wide = static_cast<float*>(g.data);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < chunk.count; ++i) wide[i] = bf16_bits_to_f32(bits[i]);
  }
  // Kept low-rank gradients (per-sample Linears) come down as their factors, a few rows each: the
  // host's AdamW forms each element from them as the device's would.
  std::vector<Backend::LowRankGrad> factors = in_chunk(low_rank, chunk);
  std::vector<std::vector<float>> factor_bytes;
  for (Backend::LowRankGrad& f : factors)
    for (Tensor* t : {&f.a, &f.b}) {
      if (t->dtype != DType::f32 || !t->contiguous())
        fail("internal error: low-rank gradient factors are contiguous f32, not {}", t->str());
      factor_bytes.emplace_back(static_cast<size_t>(t->numel()));
      be.download(factor_bytes.back().data(), t->data, t->bytes());
      *t = Tensor(factor_bytes.back().data(), t->dtype, t->shape);
    }
  lap(t, s.transfer_s);
  h.index_base = chunk.begin;
  const FlatRange mine{chunk.begin - owned_.begin, chunk.count};
  // The host backend's AdamW: the same operations in the same order as the device's kernel, so
  // the same bits (backend/ops/training.h).
  host_->adamw(held, g, flat_slice(m_, mine), flat_slice(v_, mine), h, {}, {}, factors);
  lap(t, s.host_update_s);
  be.upload(params.data, held.data, params.bytes());
  lap(t, s.transfer_s);
  // The forms the device update writes with the weights, from the uploaded masters: the bf16
  // copies rounded to nearest even, the FP8 casts as quantize() makes them with their delayed
  // scales (ParamCopy, ParamCast), the small parameters' f32 residents.
  const auto at = [&](int64_t offset, Shape shape) {
    return Tensor(static_cast<char*>(params.data) + static_cast<size_t>(offset) * dtype_size(params.dtype),
                  params.dtype, shape);
  };
  for (const Backend::ParamCopy& c : in_chunk(copies, chunk)) be.copy(c.copy, at(c.offset, c.copy.shape));
  for (const Backend::ParamCast& c : in_chunk(casts, chunk)) {
    Backend::Quantize q;
    q.format = c.codes.format;
    q.delayed_scale = c.scale;
    q.amax = c.amax;
    be.quantize(c.codes, QTensor{}, at(c.offset, Shape{c.codes.rows, c.codes.cols}), q);
  }
  const std::vector<Backend::CopyPair> residents = store_.resident_copies(chunk.begin, chunk.count, params);
  if (!residents.empty()) be.copy_batch(residents);
  be.synchronize();
  lap(t, s.update_s);
}

}  // namespace flux8

#include "model/params.h"

#include <algorithm>
#include <cmath>

#include "backend/backend.h"
#include "core/error.h"
#include "core/rng.h"
#include "model/tensor_parallel.h"

namespace flux8 {

void ParamLayout::add(std::string name, ParamShard shard, ParamInit init, std::string component, bool block_linear,
                      bool linear_weight, bool per_sample) {
  const Shape shape = shard.local_shape();
  index_.emplace(name, params_.size());
  params_.push_back({std::move(name), shape, total_, init, std::move(component), block_linear, linear_weight,
                     per_sample, false, std::move(shard)});
  total_ += shape.numel();
}

void ParamLayout::add_linear(const std::string& prefix, int64_t out, int64_t in, ParamInit init,
                             const std::string& component, bool bias, bool block_linear, bool per_sample,
                             LinearParallel parallel, std::vector<int64_t> segments) {
  ParamShard w = replicated(Shape{out, in}), b = replicated(Shape{out});
  if (parallel == LinearParallel::column) {
    w.split = b.split = ShardSplit::rows;
    w.segments = b.segments = segments.empty() ? std::vector<int64_t>{out} : segments;
  } else if (parallel == LinearParallel::row) {
    w.split = ShardSplit::cols;
    w.segments = segments.empty() ? std::vector<int64_t>{in} : segments;
  }
  add(prefix + ".weight", std::move(w), init, component, block_linear, true, per_sample);
  if (!bias) return;
  add(prefix + ".bias", std::move(b), ParamInit::zeros, component);
  params_.back().linear_bias = true;
}

// Order follows the reference module definition order (and so its state dict).
ParamLayout ParamLayout::build(const FluxConfig& c, int tp_rank, int tp_size) {
  check_tensor_parallel(c, tp_size);
  if (tp_rank < 0 || tp_rank >= tp_size)
    fail("tensor-parallel rank {} is outside a group of {} ranks", tp_rank, tp_size);
  ParamLayout L;
  L.rank_ = tp_rank;
  L.size_ = tp_size;
  const int64_t H = c.hidden_size, M = c.mlp_hidden(), D = c.head_dim();
  const auto xavier = ParamInit::xavier_uniform, normal = ParamInit::normal_002, zeros = ParamInit::zeros;
  const auto column = LinearParallel::column, row = LinearParallel::row;
  auto mlp_embedder = [&](const std::string& name, int64_t in) {
    L.add_linear(name + ".in_layer", H, in, normal, name, true, false, true);
    L.add_linear(name + ".out_layer", H, H, normal, name, true, false, true);
  };
  // The QK-norm scales: shared by every head, so each rank's gradient is its heads' part.
  auto qk_norm_scale = [&](const std::string& name, const std::string& component) {
    ParamShard s = L.replicated(Shape{D});
    s.reduce_grad = true;
    L.add(name, std::move(s), ParamInit::ones, component);
  };
  L.add_linear("img_in", H, c.in_channels, xavier, "img_in", true);
  mlp_embedder("time_in", 256);
  mlp_embedder("vector_in", c.vec_dim);
  if (c.guidance_embed) mlp_embedder("guidance_in", 256);
  L.add_linear("txt_in", H, c.context_dim, xavier, "txt_in", true);

  for (int64_t i = 0; i < c.num_double_blocks; ++i) {
    const std::string b = "double_blocks." + std::to_string(i) + ".";
    for (const char* s : {"img", "txt"}) {
      const std::string p = b + s;
      L.add_linear(p + "_mod.lin", 6 * H, H, zeros, "double_blocks", true, false, true);
      L.add_linear(p + "_attn.qkv", 3 * H, H, xavier, "double_blocks", c.qkv_bias, true, false, column, {H, H, H});
      qk_norm_scale(p + "_attn.norm.query_norm.scale", "double_blocks");
      qk_norm_scale(p + "_attn.norm.key_norm.scale", "double_blocks");
      L.add_linear(p + "_attn.proj", H, H, xavier, "double_blocks", true, true, false, row);
      L.add_linear(p + "_mlp.0", M, H, xavier, "double_blocks", true, true, false, column);
      L.add_linear(p + "_mlp.2", H, M, xavier, "double_blocks", true, true, false, row);
    }
  }
  for (int64_t i = 0; i < c.num_single_blocks; ++i) {
    const std::string b = "single_blocks." + std::to_string(i) + ".";
    L.add_linear(b + "linear1", 3 * H + M, H, xavier, "single_blocks", true, true, false, column, {H, H, H, M});
    L.add_linear(b + "linear2", H, H + M, xavier, "single_blocks", true, true, false, row, {H, M});
    qk_norm_scale(b + "norm.query_norm.scale", "single_blocks");
    qk_norm_scale(b + "norm.key_norm.scale", "single_blocks");
    L.add_linear(b + "modulation.lin", 3 * H, H, zeros, "single_blocks", true, false, true);
  }
  L.add_linear("final_layer.linear", c.out_channels, H, zeros, "final_layer", true);
  L.add_linear("final_layer.adaLN_modulation.1", 2 * H, H, zeros, "final_layer", true, false, true);
  return L;
}

const ParamInfo* ParamLayout::find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &params_[it->second];
}

const ParamInfo& ParamLayout::at(std::string_view name) const {
  const ParamInfo* p = find(name);
  if (!p) fail("no parameter named '{}' in this model", name);
  return *p;
}

ParamStore::ParamStore(const FluxConfig& cfg, Backend& backend, DType dtype, int tp_rank, int tp_size, Backend* masters,
                       MasterShards shards)
    : layout_(ParamLayout::build(cfg, tp_rank, tp_size)),
      backend_(backend),
      masters_(masters ? *masters : backend),
      dtype_(dtype),
      grad_dtype_(backend.gradient_dtype(dtype)) {
  if (masters_offloaded() && !masters_.memory_is_host())
    fail("internal error: offloaded master weights need a backend whose memory is host memory");
  if (masters_offloaded() && shards.group)
    fail("internal error: master weights are either offloaded to host memory or sharded, not both");
  const size_t elements = static_cast<size_t>(layout_.total());
  held_count_ = layout_.total();
  if (shards.group)
    shard_masters(std::move(shards));
  else
    params_ = masters_.allocate(elements * dtype_size(dtype));
  grads_ = backend.allocate(elements * dtype_size(grad_dtype_));
  for (size_t i = 0; i < layout_.params().size(); ++i) by_offset_.emplace(layout_.params()[i].offset, i);
  written_.assign(layout_.params().size(), 1);  // the buffer starts zero-filled: a valid gradient
  if (masters_offloaded())  // page-locked where the backend can: the optimizer moves them over PCIe every step
    masters_pinned_ = backend_.register_host_memory(params_, elements * dtype_size(dtype));
  if (device_forms()) {
    // Every parameter but the Linear weights (which get operand copies or FP8 casts) is read by
    // the model as it is stored: those keep an f32 resident on the backend.
    std::vector<size_t> small;
    for (size_t i = 0; i < layout_.params().size(); ++i)
      if (!layout_.params()[i].linear_weight) small.push_back(i);
    allocate_residents(small);
  }
}

ParamStore::~ParamStore() {
  if (masters_pinned_) backend_.unregister_host_memory(params_);
  release_masters();
  backend_.release(grads_);
  if (operand_buffer_) backend_.release(operand_buffer_);
  if (low_rank_buffer_) backend_.release(low_rank_buffer_);
  for (void* b : resident_buffers_) backend_.release(b);
  if (staging_.defined()) backend_.release(staging_.data);
}

static Tensor view(void* base, DType dtype, const ParamInfo& p) {
  return Tensor(static_cast<char*>(base) + static_cast<size_t>(p.offset) * dtype_size(dtype), dtype, p.shape);
}

// take_shard on the backend: `local` (contiguous, the shard's shape) from `full` (contiguous).
static void copy_shard_on_backend(Backend& be, const ParamShard& s, const Tensor& full, const Tensor& local) {
  const bool by_rows = s.split == ShardSplit::rows;
  // Rows of a 1-D tensor are its elements.
  const Tensor f = full.shape.rank == 1 ? full.reshaped(Shape{full.numel(), 1}) : full;
  const Tensor l = local.shape.rank == 1 ? local.reshaped(Shape{local.numel(), 1}) : local;
  for (const ShardPiece& piece : shard_pieces(s, s.rank)) {
    if (by_rows)
      be.copy(l.rows_slice(piece.local_begin, piece.count), f.rows_slice(piece.full_begin, piece.count));
    else
      be.copy(l.cols_slice(piece.local_begin, piece.count), f.cols_slice(piece.full_begin, piece.count));
  }
}

Tensor ParamStore::param(std::string_view name) const { return view(params_, dtype_, layout_.at(name)); }
Tensor ParamStore::grad(std::string_view name) const { return view(grads_, grad_dtype_, layout_.at(name)); }
Tensor ParamStore::flat_params() const { return Tensor(params_, dtype_, Shape{layout_.total()}); }
Tensor ParamStore::flat_grads() const { return Tensor(grads_, grad_dtype_, Shape{layout_.total()}); }

void ParamStore::init(uint64_t seed) {
  params_changed();
  // A shard is drawn as the full tensor (in a buffer of the largest one) and its pieces copied.
  int64_t largest_split = 0;
  for (const ParamInfo& p : layout_.params())
    if (p.shard.sharded()) largest_split = std::max(largest_split, p.shard.full.numel());
  void* full_buffer =
      largest_split > 0 ? masters_.allocate(static_cast<size_t>(largest_split) * dtype_size(dtype_)) : nullptr;
  // On the backend (the GPU for a CUDA run): 1.31B parameters start in milliseconds instead of
  // seconds of host generation and upload. Each value is a pure function of (seed, stream, j).
  // Offloaded masters are drawn on the backend too, a tensor at a time in the staging buffer, and
  // downloaded: the host's cores draw them far slower.
  // Sharded masters are drawn a tensor at a time in the staging buffer too, and this rank keeps
  // the part it holds.
  const bool staged = (masters_offloaded() && largest_split == 0) || masters_sharded();
  Backend& be = staged ? backend_ : masters_;
  for (size_t i = 0; i < layout_.params().size(); ++i) {
    const ParamInfo& p = layout_.params()[i];
    const uint64_t stream = rng_stream(0x706172616d73ull /*"params"*/, i);
    const Tensor local = staged ? Tensor(staging_for(p.shape.numel()).data, dtype_, p.shape) : view(params_, dtype_, p);
    const Tensor t = p.shard.sharded() ? Tensor(full_buffer, dtype_, p.shard.full) : local;
    switch (p.init) {
      case ParamInit::zeros: be.fill(t, 0.0); break;
      case ParamInit::ones: be.fill(t, 1.0); break;
      case ParamInit::normal_002: be.fill_random(t, Backend::Random::normal, seed, stream, 0.02); break;
      case ParamInit::xavier_uniform:
        // U(−a, a), a = √(6 / (fan_in + fan_out)) on the fused weight shape.
        be.fill_random(t, Backend::Random::uniform, seed, stream,
                       std::sqrt(6.0 / static_cast<double>(p.shard.full[0] + p.shard.full[1])));
        break;
    }
    if (p.shard.sharded()) copy_shard_on_backend(be, p.shard, t, local);
    if (masters_sharded()) {
      if (const HeldPart h = held_part(p); h.view.defined())
        backend_.copy(h.view, Tensor(static_cast<char*>(local.data) + static_cast<size_t>(h.first) * dtype_size(dtype_),
                                     dtype_, h.view.shape));
    } else if (staged) {
      backend_.download(view(params_, dtype_, p).data, local.data,
                        static_cast<size_t>(p.shape.numel()) * dtype_size(dtype_));
    }
  }
  if (full_buffer) masters_.release(full_buffer);
}

void ParamStore::zero_grads() {
  std::fill(written_.begin(), written_.end(), 0);
  pending_copies_.clear();  // a step abandoned mid-backward: its rows may be gone
}

size_t ParamStore::index_in(const void* buffer, const Tensor& view) const {
  const char* base = static_cast<const char*>(buffer);
  const char* p = static_cast<const char*>(view.data);
  const size_t unit = dtype_size(buffer == grads_ ? grad_dtype_ : dtype_);
  if (p < base || (p - base) % unit != 0) return kNoParam;
  const auto it = by_offset_.find(static_cast<int64_t>((p - base) / unit));
  if (it == by_offset_.end() || view.numel() != layout_.params()[it->second].shape.numel()) return kNoParam;
  return it->second;
}

void ParamStore::use_operand_copies(const std::vector<std::string>& names) {
  const DType t = backend_.weight_operand_dtype(dtype_);
  if (t == dtype_ && device_forms() && residents_.size() == layout_.params().size()) {
    // No operand type (the CPU backend): the weights the GEMMs read as stored need residents.
    std::vector<size_t> which;
    for (const std::string& name : names) {
      const size_t i = static_cast<size_t>(&layout_.at(name) - layout_.params().data());
      if (!residents_[i].defined()) which.push_back(i);
    }
    allocate_residents(which);
    return;
  }
  if (t == dtype_ || names.empty() || operand_buffer_) return;
  operands_.assign(layout_.params().size(), OperandCopy{});
  std::vector<std::pair<size_t, size_t>> placed;  // (parameter, byte offset in the buffer)
  size_t bytes = 0;
  for (const std::string& name : names) {
    const ParamInfo& p = layout_.at(name);
    placed.emplace_back(static_cast<size_t>(&p - layout_.params().data()), bytes);
    bytes += padded_bytes(static_cast<size_t>(p.shape.numel()) * dtype_size(t));
  }
  operand_buffer_ = backend_.allocate(bytes);
  operand_bytes_ = bytes;
  for (const auto& [i, offset] : placed)
    operands_[i].copy = Tensor(static_cast<char*>(operand_buffer_) + offset, t, layout_.params()[i].shape);
}

ParamStore::OperandCopy* ParamStore::operand_copy_of(const Tensor& p) {
  if (operands_.empty() || !p.defined()) return nullptr;
  const size_t i = index_in(params_, p);
  return i == kNoParam || !operands_[i].copy.defined() ? nullptr : &operands_[i];
}

Tensor ParamStore::current(OperandCopy& c, const Tensor& p) {
  if (c.version != params_version_) {
    backend_.copy(c.copy, p);  // rounded to nearest even, as the GEMM's per-call conversion did
    c.version = params_version_;
  }
  return c.copy;
}

Tensor ParamStore::operand(const Tensor& w) {
  if (masters_sharded()) return offloaded_operand(w, std::nullopt);
  OperandCopy* c = operand_copy_of(w);
  return c ? current(*c, w) : w;
}

Tensor ParamStore::bias_operand(const Tensor& b, const Tensor& out) {
  if (masters_sharded()) return offloaded_operand(b, out.dtype);
  OperandCopy* c = operand_copy_of(b);
  return c && c->copy.dtype == out.dtype ? current(*c, b) : b;
}

std::vector<Backend::ParamCopy> ParamStore::operand_copies() const {
  std::vector<Backend::ParamCopy> copies;
  for (size_t i = 0; i < operands_.size(); ++i)
    if (operands_[i].copy.defined()) copies.push_back({layout_.params()[i].offset, operands_[i].copy});
  return copies;
}

bool ParamStore::keep_low_rank_grads(int64_t rows) {
  if (low_rank_buffer_) {
    backend_.release(low_rank_buffer_);  // (after a step's copies into the factors)
    low_rank_buffer_ = nullptr;
  }
  low_rank_.clear();
  pending_copies_.clear();
  if (rows < 1 || rows > kLowRankMaxRows || dtype_ != DType::f32) return false;
  std::vector<std::pair<size_t, size_t>> placed;  // (parameter, byte offset of its a; b follows)
  size_t bytes = 0;
  const auto padded = [](int64_t elements) { return padded_bytes(static_cast<size_t>(elements) * sizeof(float)); };
  for (size_t i = 0; i < layout_.params().size(); ++i) {
    const ParamInfo& p = layout_.params()[i];
    if (!p.per_sample) continue;
    placed.emplace_back(i, bytes);
    bytes += padded(rows * p.shape[0]) + padded(rows * p.shape[1]);
  }
  if (placed.empty()) return false;
  low_rank_buffer_ = backend_.allocate(bytes);
  low_rank_.assign(layout_.params().size(), LowRank{});
  for (const auto& [i, at] : placed) {
    const Shape& s = layout_.params()[i].shape;
    char* base = static_cast<char*>(low_rank_buffer_) + at;
    low_rank_[i].a = Tensor(base, DType::f32, Shape{rows, s[0]});
    low_rank_[i].b = Tensor(base + padded(rows * s[0]), DType::f32, Shape{rows, s[1]});
    low_rank_[i].dense = true;  // until a backward writes its factors, the flat buffer holds it
  }
  return true;
}

int64_t ParamStore::low_rank_rows() const {
  for (const LowRank& L : low_rank_)
    if (L.a.defined()) return L.a.shape[0];
  return 0;
}

bool ParamStore::add_low_rank_grad(const Tensor& dw, const Tensor& dy, const Tensor& x, bool first) {
  if (low_rank_.empty()) return false;
  const size_t i = index_in(grads_, dw);
  if (i == kNoParam || !low_rank_[i].a.defined()) return false;
  LowRank& L = low_rank_[i];
  const int64_t n = dy.rows(), M = L.a.shape[1], K = L.b.shape[1];
  if (x.rows() != n || dy.cols() != M || x.cols() != K)
    fail("internal error: the low-rank gradient of '{}' [{}, {}] cannot take dy {} and x {}", layout_.params()[i].name,
         M, K, dy.str(), x.str());
  if (first) {
    L.rows = 0;
    L.dense = false;
  }
  if (L.dense) return false;
  if (L.rows + n > L.a.shape[0]) {  // more rows than kept: this step goes on in the flat buffer
    if (L.rows > 0)
      write_low_rank(i);
    else
      L.dense = true;  // the first write: the caller overwrites dw
    return false;
  }
  pending_copies_.push_back({L.a.rows_slice(L.rows, n), dy.rows_slice(0, n)});
  pending_copies_.push_back({L.b.rows_slice(L.rows, n), x.rows_slice(0, n)});
  L.rows += n;
  return true;
}

void ParamStore::flush_low_rank_copies() {
  if (pending_copies_.empty()) return;
  backend_.copy_batch(pending_copies_);
  pending_copies_.clear();
}

void ParamStore::write_low_rank(size_t i) {
  flush_low_rank_copies();
  LowRank& L = low_rank_[i];
  const Tensor dw = view(grads_, grad_dtype_, layout_.params()[i]);
  if (L.rows == 0) {
    backend_.fill(dw, 0.0);
  } else {
    const Tensor w = view(params_, dtype_, layout_.params()[i]);
    backend_.linear_backward(Tensor{}, dw, Tensor{}, L.a.rows_slice(0, L.rows), L.b.rows_slice(0, L.rows), w, false,
                             false);
  }
  L.dense = true;
}

std::vector<Backend::LowRankGrad> ParamStore::low_rank_grads() {
  flush_low_rank_copies();
  std::vector<Backend::LowRankGrad> out;
  for (size_t i = 0; i < low_rank_.size(); ++i) {
    const LowRank& L = low_rank_[i];
    if (!L.a.defined() || L.dense || !written_[i]) continue;
    if (L.rows == 0) fail("internal error: the low-rank gradient of '{}' has no rows", layout_.params()[i].name);
    out.push_back({layout_.params()[i].offset, L.a.rows_slice(0, L.rows), L.b.rows_slice(0, L.rows)});
  }
  return out;
}

void ParamStore::materialize_low_rank_grads() {
  flush_low_rank_copies();
  for (size_t i = 0; i < low_rank_.size(); ++i)
    if (low_rank_[i].a.defined() && !low_rank_[i].dense && written_[i]) write_low_rank(i);
}

int64_t ParamStore::offset_of(const Tensor& w) const {
  const size_t i = index_in(params_, w);
  if (i == kNoParam) fail("ParamStore::offset_of: tensor {} is not a whole parameter of this model", w.str());
  return layout_.params()[i].offset;
}

void ParamStore::params_updated() {
  ++params_version_;
  for (OperandCopy& c : operands_)
    if (c.copy.defined()) c.version = params_version_;
  if (masters_offloaded()) forms_version_ = params_version_;
}

bool ParamStore::first_write(const Tensor& grad) {
  const size_t i = index_in(grads_, grad);
  if (i == kNoParam)
    fail("ParamStore::first_write: tensor {} is not a whole parameter gradient of this model", grad.str());
  const bool first = !written_[i];
  written_[i] = 1;
  return first;
}

void ParamStore::zero_if_unwritten(const Tensor& grad) {
  if (first_write(grad)) backend_.fill(grad, 0.0);
}

void ParamStore::finish_grads() {
  flush_low_rank_copies();
  for (size_t i = 0; i < written_.size(); ++i)
    if (!written_[i])
      fail(
          "internal error: the backward wrote no gradient for parameter '{}' (its gradient buffer would hold stale "
          "values); please report this",
          layout_.params()[i].name);
}

}  // namespace flux8

#include "model/linear_site.h"

#include <algorithm>
#include <exception>

#include "core/error.h"
#include "fp8/recipe.h"

namespace flux8 {

LinearSite LinearSite::bind(const ParamStore& store, const std::string& prefix) {
  LinearSite s;
  s.name = prefix;
  s.store = &store;
  s.w = store.param(prefix + ".weight");
  s.dw = store.grad(prefix + ".weight");
  if (store.layout().find(prefix + ".bias")) {
    s.b = store.param(prefix + ".bias");
    s.db = store.grad(prefix + ".bias");
  }
  return s;
}

bool LinearSite::accumulate_grads() const {
  if (!store) return true;
  const bool first = store->first_write(dw);
  if (db.defined() && store->first_write(db) != first)
    fail("internal error: {}: the weight and bias gradients disagree on being written this step", name);
  return !first;
}

Fp8Runtime::Fp8Runtime(const Fp8Config& cfg, Backend& backend)
    : cfg_(cfg), be_(backend), registry_(static_cast<int>(cfg.amax_history_len)) {}

Fp8Runtime::~Fp8Runtime() {
  try {
    be_.synchronize();
    release_state();
  } catch (const std::exception&) {
    // A failing device is reported by whatever runs next; a destructor must not throw.
  }
}

void Fp8Runtime::release_state() {
  for (Tensor* t : {&history_dev_, &scale_dev_, &scale_inv_dev_, &fp8_max_dev_, &scratch_amax_dev_}) {
    if (t->defined()) be_.release(t->data);
    *t = Tensor{};
  }
  device_current_ = false;
}

Fp8MetaRegistry& Fp8Runtime::registry() {
  pull_state();
  device_current_ = false;  // the caller may change it
  return registry_;
}

const Fp8MetaRegistry& Fp8Runtime::registry() const {
  pull_state();
  return registry_;
}

void Fp8Runtime::pull_state() const {
  if (host_current_) return;
  Fp8MetaRegistry& r = const_cast<Fp8MetaRegistry&>(registry_);  // the mirror is a cache
  be_.download(r.amax_history_data(), history_dev_.data, history_dev_.bytes());
  be_.download(r.scale_data(), scale_dev_.data, scale_dev_.bytes());
  be_.download(r.scale_inv_data(), scale_inv_dev_.data, scale_inv_dev_.bytes());
  host_current_ = true;
}

void Fp8Runtime::push_state() {
  if (device_current_) return;
  const int64_t n = registry_.size(), L = registry_.history_len();
  if (!history_dev_.defined() || history_dev_.shape[0] != L || history_dev_.shape[1] != n) {
    release_state();
    auto alloc = [&](Shape shape) {
      return Tensor(be_.allocate(static_cast<size_t>(std::max<int64_t>(shape.numel(), 1)) * sizeof(float)),
                    DType::f32, shape);
    };
    history_dev_ = alloc(Shape{L, n});
    scale_dev_ = alloc(Shape{n});
    scale_inv_dev_ = alloc(Shape{n});
    fp8_max_dev_ = alloc(Shape{n});
    scratch_amax_dev_ = alloc(Shape{1});
    std::vector<float> fmax(static_cast<size_t>(n));
    for (int s = 0; s < n; ++s)
      fmax[static_cast<size_t>(s)] = fp8_max(registry_.role(s) == Fp8Role::grad_output ? format(Operand::grad_output)
                                                                                         : format(Operand::input));
    be_.upload(fp8_max_dev_.data, fmax.data(), fp8_max_dev_.bytes());
  }
  be_.upload(history_dev_.data, registry_.amax_history().data(), history_dev_.bytes());
  be_.upload(scale_dev_.data, registry_.scales().data(), scale_dev_.bytes());
  be_.upload(scale_inv_dev_.data, registry_.scale_invs().data(), scale_inv_dev_.bytes());
  device_current_ = true;
}

void Fp8Runtime::add_site(LinearSite& site) {
  pull_state();
  device_current_ = false;  // the backend copy is re-made with the new slots
  site.fp8 = true;
  site.index = static_cast<int>(stats_.size());
  first_slot_.push_back(registry_.add(site.name, Fp8Role::input));
  registry_.add(site.name, Fp8Role::weight);
  registry_.add(site.name, Fp8Role::grad_output);
  stats_.push_back({site.name, {}});
}

int Fp8Runtime::add_attention(const std::string& name) {
  pull_state();
  device_current_ = false;  // the backend copy is re-made with the new slots
  static constexpr const char* kNames[] = {"q", "k", "v", "o", "do", "ds", "dq", "dk", "dv"};
  attention_slot_.push_back(registry_.size());
  attention_stats_.emplace_back();
  for (int t = 0; t < kAttentionSlots; ++t)
    registry_.add(name + "." + kNames[t], t < static_cast<int>(AttentionTensor::dout) ? Fp8Role::input
                                                                                       : Fp8Role::grad_output);
  return attentions() - 1;
}

CastStats* Fp8Runtime::AttentionCastStats::of(AttentionTensor t) {
  switch (t) {
    case AttentionTensor::q: return &q;
    case AttentionTensor::k: return &k;
    case AttentionTensor::v: return &v;
    case AttentionTensor::dout: return &dout;
    default: return nullptr;  // cast inside cuDNN's kernels
  }
}

Fp8Format Fp8Runtime::attention_format(AttentionTensor t) const {
  return t < AttentionTensor::dout ? format(Operand::input) : format(Operand::grad_output);
}

Backend::Quantize Fp8Runtime::attention_cast(int index, AttentionTensor t) {
  FLUX8_CHECK(cfg_.recipe == Fp8Recipe::delayed, "FP8 attention runs with the delayed recipe only");
  push_state();
  const int slot = attention_slot_[static_cast<size_t>(index)] + static_cast<int>(t);
  Backend::Quantize q;
  q.format = attention_format(t);
  q.delayed_scale = scale_dev_.ptr<float>() + slot;
  q.amax = amax_target(slot);
  if (collect_stats_) {
    q.stats = recording_ ? attention_stats_[static_cast<size_t>(index)].of(t) : &scratch_stats_;
    stats_pending_ |= recording_;
  }
  return q;
}

Backend::Fp8AttentionScales Fp8Runtime::attention_scales(int index) {
  FLUX8_CHECK(cfg_.recipe == Fp8Recipe::delayed, "FP8 attention runs with the delayed recipe only");
  push_state();
  const int first = attention_slot_[static_cast<size_t>(index)];
  auto scale = [&](AttentionTensor t) { return scale_dev_.ptr<float>() + first + static_cast<int>(t); };
  auto inverse = [&](AttentionTensor t) { return scale_inv_dev_.ptr<float>() + first + static_cast<int>(t); };
  auto amax = [&](AttentionTensor t) { return amax_target(first + static_cast<int>(t)); };
  using T = AttentionTensor;
  Backend::Fp8AttentionScales sc;
  sc.o = scale(T::o);
  sc.ds = scale(T::ds), sc.ds_inv = inverse(T::ds);
  sc.dq = scale(T::dq), sc.dk = scale(T::dk), sc.dv = scale(T::dv);
  sc.amax_o = amax(T::o), sc.amax_ds = amax(T::ds);
  sc.amax_dq = amax(T::dq), sc.amax_dk = amax(T::dk), sc.amax_dv = amax(T::dv);
  return sc;
}

Fp8Format Fp8Runtime::format(Operand o) const {
  return o == Operand::grad_output && cfg_.hybrid ? Fp8Format::e5m2 : Fp8Format::e4m3;
}

Fp8Scaling Fp8Runtime::scaling(Operand o) const {
  switch (cfg_.recipe) {
    case Fp8Recipe::delayed:
    case Fp8Recipe::tensorwise: return Fp8Scaling::per_tensor;
    case Fp8Recipe::blockwise: return o == Operand::weight ? Fp8Scaling::block_128x128 : Fp8Scaling::block_1x128;
    case Fp8Recipe::mxfp8: return Fp8Scaling::mx_1x32;
  }
  return Fp8Scaling::per_tensor;
}

float* Fp8Runtime::amax_target(int slot) {
  if (!recording_) return scratch_amax_dev_.ptr<float>();
  host_current_ = false;  // the device's amaxes will move past the host copy
  // Row 0 of the history (history-major) is the staging row: element `slot`.
  return history_dev_.ptr<float>() + slot;
}

Backend::Quantize Fp8Runtime::quantize_args(const LinearSite& site, Operand o) {
  Backend::Quantize q;
  q.format = format(o);
  q.scaling = scaling(o);
  q.pow2 = cfg_.power_of_2_scales;
  const int slot = first_slot_[static_cast<size_t>(site.index)] + static_cast<int>(o);
  if (cfg_.recipe == Fp8Recipe::delayed) {
    push_state();
    q.delayed_scale = scale_dev_.ptr<float>() + slot;
    q.amax = amax_target(slot);
  }
  if (collect_stats_) {
    q.stats = recording_ ? &stats_[static_cast<size_t>(site.index)].op[static_cast<int>(o)] : &scratch_stats_;
    stats_pending_ |= recording_;
  }
  return q;
}

QTensor allocate_qtensor(Arena& arena, int64_t rows, int64_t cols, Fp8Format f, Fp8Scaling s, SlotKind kind) {
  QTensor q;
  q.rows = rows;
  q.cols = cols;
  q.format = f;
  q.scaling = s;
  q.codes = static_cast<uint8_t*>(arena.alloc(DType::u8, Shape{rows * cols}, kind).data);
  const int64_t n = QTensor::scale_count(s, rows, cols);
  if (s == Fp8Scaling::mx_1x32)
    q.scale_e8m0 = static_cast<uint8_t*>(arena.alloc(DType::u8, Shape{n}, SlotKind::statistic).data);
  else
    q.scale_inv = static_cast<float*>(arena.alloc(DType::f32, Shape{n}, SlotKind::statistic).data);
  if (arena.measuring()) q.codes = reinterpret_cast<uint8_t*>(1);  // "defined" while planning
  return q;
}

void Fp8Runtime::allocate_weight_casts(std::vector<LinearSite*>& sites) {
  sites_.clear();
  for (LinearSite* s : sites)
    if (s->fp8) sites_.push_back(s);
  auto plan = [&](Arena& a) {
    for (LinearSite* s : sites) {
      if (!s->fp8) continue;
      const int64_t M = s->w.shape[0], K = s->w.shape[1];
      s->w_row = allocate_qtensor(a, M, K, format(Operand::weight), scaling(Operand::weight), SlotKind::activation);
      s->w_col = allocate_qtensor(a, K, M, format(Operand::weight), scaling(Operand::weight), SlotKind::activation);
      s->w_version = -1;
    }
  };
  Arena measure;
  plan(measure);
  weight_arena_.reserve(be_, measure.peak());
  plan(weight_arena_);
}

void Fp8Runtime::ensure_weight_cast(LinearSite& site) {
  if (site.w_version == weight_version_ && (site.w_recorded || !recording_) && (site.w_counted || !collect_stats_))
    return;
  be_.quantize(site.w_row, site.w_col, site.w, quantize_args(site, Operand::weight));
  site.w_version = weight_version_;
  site.w_recorded = recording_;
  site.w_counted = collect_stats_;
}

std::vector<Backend::ParamCast> Fp8Runtime::weight_casts(const ParamStore& store) {
  std::vector<Backend::ParamCast> casts;
  if (cfg_.recipe != Fp8Recipe::delayed) return casts;
  push_state();
  for (const LinearSite* s : sites_) {
    const int slot = first_slot_[static_cast<size_t>(s->index)] + static_cast<int>(Operand::weight);
    // As quantize_args for a recording cast: the registry's scale, the staging row's amax (the
    // next step's, as the first forward use would record it).
    casts.push_back({store.offset_of(s->w), s->w_row, scale_dev_.ptr<float>() + slot, history_dev_.ptr<float>() + slot});
  }
  if (!casts.empty()) host_current_ = false;
  return casts;
}

void Fp8Runtime::weights_updated(bool cast_by_update) {
  ++weight_version_;
  if (!cast_by_update) return;
  for (LinearSite* s : sites_) {
    be_.transpose_codes(s->w_col, s->w_row);
    s->w_version = weight_version_;
    s->w_recorded = true;
    s->w_counted = false;
  }
}

void Fp8Runtime::end_step() {
  if (cfg_.recipe == Fp8Recipe::delayed && registry_.size() > 0) {
    push_state();
    if (const auto& hook = registry_.allreduce_hook()) {
      // The hook reduces the staging row in host memory, as the registry's own update() gives
      // it: bring row 0 over (after every cast of the step), reduce, put it back. Only runs with
      // more than one rank, where the synchronisation is paid once per step.
      std::vector<float> row0(static_cast<size_t>(registry_.size()));
      be_.download(row0.data(), history_dev_.data, row0.size() * sizeof(float));
      hook(row0.data(), registry_.size());
      be_.upload(history_dev_.data, row0.data(), row0.size() * sizeof(float));
    }
    be_.delayed_scaling_update(history_dev_, scale_dev_, scale_inv_dev_, fp8_max_dev_,
                               cfg_.amax_max ? AmaxAlgo::max : AmaxAlgo::most_recent, cfg_.margin);
    host_current_ = false;
  }
  if (stats_pending_) be_.synchronize();  // the step's cast statistics (telemetry) reach the host
  stats_pending_ = false;
  last_stats_ = stats_;
  last_attention_stats_ = attention_stats_;
  for (AttentionCastStats& a : attention_stats_) a = AttentionCastStats{};
  for (SiteStats& s : stats_)
    for (CastStats& c : s.op) c = CastStats{};
}

float Fp8Runtime::scale_of(int site, Operand o) const {
  if (cfg_.recipe == Fp8Recipe::delayed) return registry().scale(first_slot_[static_cast<size_t>(site)] + static_cast<int>(o));
  if (cfg_.recipe == Fp8Recipe::tensorwise && static_cast<size_t>(site) < last_stats_.size())
    return current_scale(last_stats_[static_cast<size_t>(site)].op[static_cast<int>(o)].amax, fp8_max(format(o)),
                         cfg_.power_of_2_scales);
  return 0.0f;  // block scales: one per block, no single value
}

SavedLinearInput allocate_linear_input(Arena& arena, const LinearSite& site, const Fp8Runtime* fp8, Shape shape,
                                       DType dtype) {
  SavedLinearInput s;
  if (!wgrad_in_fp8(site, fp8)) {
    s.full = arena.alloc(dtype, shape, SlotKind::linear_input);
    return s;
  }
  const int64_t K = shape[-1], rows = shape.numel() / K;
  s.cast_t = allocate_qtensor(arena, K, rows, fp8->format(Operand::input), fp8->scaling(Operand::input),
                              SlotKind::linear_input);
  return s;
}

Tensor linear_input_buffer(Arena& scratch, const SavedLinearInput& saved, Shape shape, DType dtype) {
  return saved.full.defined() ? saved.full : scratch.alloc(dtype, shape, SlotKind::workspace);
}

namespace {

// An FP8 site's input cast for its fprop GEMM, in scratch (released by the caller): the rowwise
// codes; the transposed ones go to `saved` (the wgrad operand). Where the site keeps its input
// unquantized (fp8_wgrad off) the op writes that first and the cast reads it; otherwise the op
// runs inside the cast (quantize_fused) and its output is never stored — LayerNorm's mean and
// rstd are written either way.
QTensor cast_site_input(Backend& be, Fp8Runtime& fp8, Arena& scratch, LinearSite& site, const Backend::CastInput& in,
                        SavedLinearInput& saved) {
  const QTensor x_row = allocate_qtensor(scratch, in.x.rows(), in.cols(), fp8.format(Operand::input),
                                         fp8.scaling(Operand::input), SlotKind::workspace);
  if (saved.full.defined()) {
    if (in.op != Backend::CastInput::Op::identity || in.head.defined() || in.x.data != saved.full.data)
      be.produce(saved.full, in);
    be.quantize(x_row, saved.cast_t, saved.full, fp8.quantize_args(site, Operand::input));
    return x_row;
  }
  if (in.op == Backend::CastInput::Op::identity && !in.head.defined()) {  // a plain cast (the profiler's "quantize")
    be.quantize(x_row, saved.cast_t, in.x, fp8.quantize_args(site, Operand::input));
    return x_row;
  }
  // The row statistics, kept for the backward (unless the gated residual before wrote them).
  if (in.op == Backend::CastInput::Op::layernorm_modulate && !in.statistics_ready)
    be.layernorm_modulate(Tensor{}, in.mean, in.rstd, in.x, in.shift, in.scale, in.eps);
  be.quantize_fused(x_row, saved.cast_t, in, fp8.quantize_args(site, Operand::input));
  return x_row;
}

}  // namespace

void site_forward(Backend& be, Fp8Runtime* fp8, Arena& scratch, LinearSite& site, Tensor y, Tensor x,
                  SavedLinearInput& saved) {
  if (!site.fp8 || !fp8) {
    be.linear(y, x, site.w_operand(), site.b_operand(y));
    return;
  }
  const size_t mark = scratch.mark();
  Backend::CastInput in;
  in.x = x;
  SavedLinearInput cast_only{Tensor{}, saved.cast_t};  // x is the caller's: cast it as it is
  const QTensor x_row = cast_site_input(be, *fp8, scratch, site, in, cast_only);
  fp8->ensure_weight_cast(site);
  be.gemm_fp8_tn(y, x_row, site.w_row, site.b_operand(y), false, fp8->fprop_accumulation());
  scratch.release_to(mark);
}

void site_forward_fused(Backend& be, Fp8Runtime* fp8, Arena& scratch, LinearSite& site, Tensor y,
                        const Backend::CastInput& in, SavedLinearInput& saved, DType dtype) {
  const size_t mark = scratch.mark();
  if (!site.fp8 || !fp8) {  // the op writes the Linear's input (the saved one, or scratch)
    const Tensor x = linear_input_buffer(scratch, saved, in.shape(), dtype);
    be.produce(x, in);
    site_forward(be, fp8, scratch, site, y, x, saved);
  } else {
    const QTensor x_row = cast_site_input(be, *fp8, scratch, site, in, saved);
    fp8->ensure_weight_cast(site);
    be.gemm_fp8_tn(y, x_row, site.w_row, site.b_operand(y), false, fp8->fprop_accumulation());
  }
  scratch.release_to(mark);
}

bool layernorm_in_cast(const LinearSite& site, const Fp8Runtime* fp8, const SavedLinearInput& saved) {
  return site.fp8 && fp8 && !saved.full.defined();  // cast_site_input's path of a fused op
}

void site_forward_gelu(Backend& be, Fp8Runtime* fp8, Arena& scratch, LinearSite& site, Tensor y_gelu, Tensor h,
                       const Backend::CastInput& in, SavedLinearInput& saved, DType dtype) {
  FLUX8_CHECK(!site.fp8 || !fp8,
              "site_forward_gelu: site '{}' runs in FP8; FP8 sites run the GELU in their casts "
              "(site_forward_fused with CastInput::gelu_tanh_of, see gelu_in_epilogues)",
              site.name);
  const size_t mark = scratch.mark();
  const Tensor x = linear_input_buffer(scratch, saved, in.x.shape, dtype);
  be.produce(x, in);
  be.linear_gelu(y_gelu, h, x, site.w_operand(), site.b_operand(h));
  scratch.release_to(mark);
}

namespace {

// The FP8 backward of a site whose output gradient is `dy` (the tensor, or the element-wise op
// that makes it: Backend::quantize_fused): dy cast rowwise for the dgrad and, with FP8 wgrad,
// columnwise for the wgrad, the bias gradient summed in the same pass. With wgrad in BF16 the
// wgrad reads dy itself, which must then be stored (dy.op identity; site_backward_fused sees to
// it).
void site_backward_fp8(Backend& be, Fp8Runtime& fp8, Arena& scratch, LinearSite& site, Tensor dx,
                       const Backend::CastInput& dy, const SavedLinearInput& saved, bool accumulate_dx) {
  const bool fp8_wgrad = fp8.config().wgrad;
  const int64_t N = dy.x.rows(), M = dy.cols();
  const size_t mark = scratch.mark();
  const Fp8Format f = fp8.format(Operand::grad_output);
  const Fp8Scaling sc = fp8.scaling(Operand::grad_output);
  const QTensor dy_row = dx.defined() ? allocate_qtensor(scratch, N, M, f, sc, SlotKind::workspace) : QTensor{};
  const QTensor dy_col = fp8_wgrad ? allocate_qtensor(scratch, M, N, f, sc, SlotKind::workspace) : QTensor{};
  const bool accumulate = site.accumulate_grads();
  Backend::Quantize q = fp8.quantize_args(site, Operand::grad_output);
  q.column_sums = site.db;  // the bias gradient, summed in the pass that casts dy
  q.column_sums_accumulate = accumulate;
  be.quantize_fused(dy_row, dy_col, dy, q);
  if (dx.defined())
    be.gemm_fp8_tn(dx, dy_row, site.w_col, Tensor{}, accumulate_dx, Fp8Accumulation::fp32);  // dgrad: dy·w
  if (fp8_wgrad)
    be.gemm_fp8_tn(site.dw, dy_col, saved.cast_t, Tensor{}, accumulate, Fp8Accumulation::fp32);  // wgrad: dyᵀ·x
  else
    be.linear_backward(Tensor{}, site.dw, Tensor{}, dy.x, saved.full, site.w, false, accumulate);
  scratch.release_to(mark);
}

}  // namespace

void linear_backward_params(Backend& be, const LinearSite& site, Tensor dx, Tensor dy, Tensor x, Tensor w,
                            bool accumulate_dx) {
  const bool accumulate = site.accumulate_grads();  // the step's writes of dw and db, recorded once
  if (site.store && site.store->add_low_rank_grad(site.dw, dy, x, !accumulate)) {
    be.linear_backward(dx, Tensor{}, site.db, dy, x, w, accumulate_dx, accumulate);
    return;
  }
  be.linear_backward(dx, site.dw, site.db, dy, x, w, accumulate_dx, accumulate);
}

void site_backward(Backend& be, Fp8Runtime* fp8, Arena& scratch, LinearSite& site, Tensor dx, Tensor dy,
                   const SavedLinearInput& saved, bool accumulate_dx) {
  if (!site.fp8 || !fp8) {
    linear_backward_params(be, site, dx, dy, saved.full, dx.defined() ? site.w_operand() : site.w, accumulate_dx);
    return;
  }
  Backend::CastInput in;
  in.x = dy;
  site_backward_fp8(be, *fp8, scratch, site, dx, in, saved, accumulate_dx);
}

void site_backward_gelu(Backend& be, Fp8Runtime* fp8, LinearSite& site, Tensor dx, Tensor dh,
                        Tensor gelu_h, Tensor dy, const SavedLinearInput& saved) {
  FLUX8_CHECK(!site.fp8 || !fp8,
              "site_backward_gelu: site '{}' runs in FP8; FP8 sites run the GELU's backward in their casts "
              "(site_backward_fused with CastInput::gelu_tanh_backward_of, see gelu_in_epilogues)",
              site.name);
  be.linear_dgrad_gelu(dx, dh, dy, site.w_operand(), gelu_h);
  be.linear_backward(Tensor{}, site.dw, site.db, dy, saved.full, site.w, false, site.accumulate_grads());
}

void site_backward_fused(Backend& be, Fp8Runtime* fp8, Arena& scratch, LinearSite& site, Tensor dx,
                         const Backend::CastInput& dy, Tensor dy_buffer, const SavedLinearInput& saved,
                         bool accumulate_dx) {
  if (wgrad_in_fp8(site, fp8)) {
    site_backward_fp8(be, *fp8, scratch, site, dx, dy, saved, accumulate_dx);
    return;
  }
  be.produce(dy_buffer, dy);  // a BF16 GEMM reads dy itself
  site_backward(be, fp8, scratch, site, dx, dy_buffer, saved, accumulate_dx);
}

Backend::CastInput gated_branch_backward(Backend& be, const LinearSite& site, const Fp8Runtime* fp8, Tensor buffer,
                                         Tensor dgate, Tensor dres, Tensor y, Tensor gate) {
  if (wgrad_in_fp8(site, fp8)) {
    be.gated_residual_backward(Tensor{}, dgate, dres, y, gate);
    return Backend::CastInput::gated_of(dres, gate);
  }
  be.gated_residual_backward(buffer, dgate, dres, y, gate);
  Backend::CastInput in;
  in.x = buffer;
  return in;
}

void plan_site_scratch(Arena& scratch, const Fp8Runtime* fp8, int64_t rows, int64_t max_cols) {
  if (!fp8 || !fp8->config().enabled) return;
  // What one site holds at once, with the scales: the two casts of the output gradient in the
  // backward (the forward holds one, the input's rowwise cast). The input buffer of a cast-only
  // saved input is the block's (its plan has "a Linear's input buffer"); counting it here too,
  // with a third cast, over-reserved ~1 GiB on W1's single block.
  for (int i = 0; i < 2; ++i)
    allocate_qtensor(scratch, rows, max_cols, Fp8Format::e4m3, Fp8Scaling::block_1x128, SlotKind::workspace);
}

}  // namespace flux8

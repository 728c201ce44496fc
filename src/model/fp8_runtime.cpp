#include "model/fp8_runtime.h"

#include <algorithm>
#include <exception>
#include <unordered_map>

#include "core/error.h"
#include "fp8/recipe.h"

namespace flux8 {

Fp8Runtime::Fp8Runtime(const Fp8Config& cfg, Backend& backend, TensorParallel tp)
    : cfg_(cfg), be_(backend), tp_(tp), registry_(static_cast<int>(cfg.amax_history_len)) {
  if (tp_.sharded() && cfg_.recipe == Fp8Recipe::tensorwise)
    whole_amax_dev_ = Tensor(be_.allocate(sizeof(float)), DType::f32, Shape{1});
}

Fp8Runtime::~Fp8Runtime() {
  try {
    be_.synchronize();
    release_state();
    if (whole_amax_dev_.defined()) be_.release(whole_amax_dev_.data);
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

const Fp8MetaRegistry& Fp8Runtime::current_registry() {
  pull_state();
  return registry_;
}

void Fp8Runtime::pull_state() {
  if (host_current_) return;
  be_.download(registry_.amax_history_data(), history_dev_.data, history_dev_.bytes());
  be_.download(registry_.scale_data(), scale_dev_.data, scale_dev_.bytes());
  be_.download(registry_.scale_inv_data(), scale_inv_dev_.data, scale_inv_dev_.bytes());
  host_current_ = true;
}

void Fp8Runtime::push_state() {
  if (device_current_) return;
  const int64_t n = registry_.size(), L = registry_.history_len();
  if (!history_dev_.defined() || history_dev_.shape[0] != L || history_dev_.shape[1] != n) {
    release_state();
    auto alloc = [&](Shape shape) {
      return Tensor(be_.allocate(static_cast<size_t>(std::max<int64_t>(shape.numel(), 1)) * sizeof(float)), DType::f32,
                    shape);
    };
    history_dev_ = alloc(Shape{L, n});
    scale_dev_ = alloc(Shape{n});
    scale_inv_dev_ = alloc(Shape{n});
    fp8_max_dev_ = alloc(Shape{n});
    scratch_amax_dev_ = alloc(Shape{1});
    std::vector<float> fmax(static_cast<size_t>(n));
    for (int s = 0; s < n; ++s)
      fmax[static_cast<size_t>(s)] =
          fp8_max(registry_.role(s) == Fp8Role::grad_output ? format(Operand::grad_output) : format(Operand::input));
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
    registry_.add(name + "." + kNames[t],
                  t < static_cast<int>(AttentionTensor::dout) ? Fp8Role::input : Fp8Role::grad_output);
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

Fp8Format Fp8Runtime::format(Operand o) const { return operand_format(cfg_, o); }

Fp8Scaling Fp8Runtime::scaling(Operand o) const { return operand_scaling(cfg_, o); }

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

bool Fp8Runtime::split_over_group(const LinearSite& site, Operand o) const {
  if (!tp_.sharded()) return false;
  switch (o) {
    case Operand::weight: return site.split != ShardSplit::replicated;
    case Operand::input: return site.split == ShardSplit::cols;
    case Operand::grad_output: return site.split == ShardSplit::rows;
  }
  return false;
}

Backend::Quantize Fp8Runtime::cast_args(const LinearSite& site, Operand o, const Backend::CastInput& in) {
  Backend::Quantize q = quantize_args(site, o);
  if (q.scaling != Fp8Scaling::per_tensor || q.delayed_scale || !split_over_group(site, o)) return q;
  be_.cast_amax(whole_amax_dev_, in);
  tp_.group->all_reduce(whole_amax_dev_, ReduceOp::max);
  q.whole_amax = whole_amax_dev_.ptr<float>();
  return q;
}

void Fp8Runtime::allocate_weight_casts(std::vector<LinearSite*>& sites) {
  sites_.clear();
  for (LinearSite* s : sites)
    if (s->fp8) sites_.push_back(s);
  const bool keep = !cfg_.weight_transpose_in_backward;
  int64_t largest = 0;
  auto plan = [&](Arena& a) {
    for (LinearSite* s : sites) {
      if (!s->fp8) continue;
      const int64_t M = s->w.shape[0], K = s->w.shape[1];
      s->w_row = allocate_qtensor(a, M, K, format(Operand::weight), scaling(Operand::weight), SlotKind::activation);
      s->w_col =
          keep ? allocate_qtensor(a, K, M, format(Operand::weight), scaling(Operand::weight), SlotKind::activation)
               : QTensor{};
      s->w_version = -1;
      largest = std::max(largest, M * K);
    }
    if (!keep && largest > 0)  // shaped per site by dgrad_weight
      shared_col_ =
          allocate_qtensor(a, 1, largest, format(Operand::weight), Fp8Scaling::per_tensor, SlotKind::activation);
  };
  Arena measure;
  plan(measure);
  weight_arena_.reserve(be_, measure.peak());
  plan(weight_arena_);
}

void Fp8Runtime::ensure_weight_cast(LinearSite& site) {
  if (site.w_version == weight_version_ && (!recording_ || (site.w_recorded && (site.w_counted || !collect_stats_))))
    return;
  cast_weight(site, site.w_master());
}

void Fp8Runtime::cast_weight(LinearSite& site, const Tensor& master) {
  Backend::CastInput w;
  w.x = master;
  be_.quantize(site.w_row, site.w_col, w.x, cast_args(site, Operand::weight, w));
  site.w_version = weight_version_;
  site.w_recorded = recording_;
  site.w_counted = collect_stats_;
}

bool Fp8Runtime::weight_casts_current() const {
  return std::all_of(sites_.begin(), sites_.end(),
                     [&](const LinearSite* s) { return s->w_version == weight_version_; });
}

ParamStore::CastForms Fp8Runtime::cast_forms(const ParamStore& store) {
  ParamStore::CastForms forms;
  std::unordered_map<int64_t, LinearSite*> by_offset;
  for (LinearSite* s : sites_) {
    forms.offsets.push_back(store.offset_of(s->w));
    by_offset.emplace(forms.offsets.back(), s);
  }
  forms.write = [this, by_offset = std::move(by_offset)](int64_t offset, const Tensor& value) {
    cast_weight(*by_offset.at(offset), value);
  };
  return forms;
}

QTensor Fp8Runtime::dgrad_weight(const LinearSite& site) {
  if (site.w_col.defined()) return site.w_col;
  QTensor col = shared_col_;
  col.rows = site.w_row.cols;
  col.cols = site.w_row.rows;
  be_.transpose_codes(col, site.w_row);
  return col;
}

std::vector<Backend::ParamCast> Fp8Runtime::weight_casts(ParamStore& store) {
  std::vector<Backend::ParamCast> casts;
  if (cfg_.recipe != Fp8Recipe::delayed) return casts;
  push_state();
  for (const LinearSite* s : sites_) {
    const int slot = first_slot_[static_cast<size_t>(s->index)] + static_cast<int>(Operand::weight);
    // As quantize_args for a recording cast: the registry's scale, the staging row's amax (the
    // next step's, as the first forward use would record it).
    casts.push_back(
        {store.offset_of(s->w), s->w_row, scale_dev_.ptr<float>() + slot, history_dev_.ptr<float>() + slot});
  }
  if (!casts.empty()) host_current_ = false;
  return casts;
}

void Fp8Runtime::weights_changing() {
  ++weight_version_;
  weights_changing_ = true;
}

void Fp8Runtime::weights_updated(bool cast_by_update) {
  if (!weights_changing_) ++weight_version_;
  weights_changing_ = false;
  if (!cast_by_update) return;
  for (LinearSite* s : sites_) {
    if (s->w_col.defined()) be_.transpose_codes(s->w_col, s->w_row);
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

float Fp8Runtime::scale_of(int site, Operand o) {
  if (cfg_.recipe == Fp8Recipe::delayed)
    return current_registry().scale(first_slot_[static_cast<size_t>(site)] + static_cast<int>(o));
  const auto it = std::find_if(sites_.begin(), sites_.end(), [&](const LinearSite* s) { return s->index == site; });
  const bool whole = it == sites_.end() || !split_over_group(**it, o);
  if (cfg_.recipe == Fp8Recipe::tensorwise && whole && static_cast<size_t>(site) < last_stats_.size())
    return current_scale(last_stats_[static_cast<size_t>(site)].op[static_cast<int>(o)].amax, fp8_max(format(o)),
                         cfg_.power_of_2_scales);
  return 0.0f;  // block scales: one per block, no single value
}

}  // namespace flux8

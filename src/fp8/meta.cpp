#include "fp8/meta.h"

#include <algorithm>

#include "core/error.h"

namespace flux8 {

void CastStats::merge(const CastStats& o) {
  amax = amax_accumulate(amax, o.amax);
  elements += o.elements;
  nonzero += o.nonzero;
  saturated += o.saturated;
  flushed += o.flushed;
}

Fp8MetaRegistry::Fp8MetaRegistry(int history_len) : history_len_(history_len) {
  if (history_len < 1)
    fail("fp8_amax_history_len is {}; it must be at least 1 (1 keeps only the current step)", history_len);
}

int Fp8MetaRegistry::find(const std::string& name, Fp8Role role) const {
  for (int s = 0; s < size(); ++s)
    if (roles_[s] == role && names_[s] == name) return s;
  return -1;
}

int Fp8MetaRegistry::add(std::string name, Fp8Role role) {
  if (find(name, role) >= 0)
    fail("FP8 meta registry: tensor '{}' ({}) is registered twice; each Linear operand needs one slot", name,
         fp8_role_name(role));
  const int n = size();
  std::vector<float> history(size_t(history_len_) * size_t(n + 1), 0.0f);
  for (int r = 0; r < history_len_; ++r)
    std::copy_n(amax_history_.data() + size_t(r) * n, n, history.data() + size_t(r) * (n + 1));
  amax_history_ = std::move(history);
  names_.push_back(std::move(name));
  roles_.push_back(role);
  scale_.push_back(1.0f);
  scale_inv_.push_back(1.0f);
  cur_stats_.emplace_back();
  step_stats_.emplace_back();
  return n;
}

void Fp8MetaRegistry::record_amax(int slot, float amax) {
  amax_history_[size_t(slot)] = amax_accumulate(amax_history_[size_t(slot)], amax);
}

void Fp8MetaRegistry::record_cast(int slot, const CastStats& stats) {
  record_amax(slot, stats.amax);
  cur_stats_[size_t(slot)].merge(stats);
}

int Fp8MetaRegistry::update(const DelayedScalingParams& p) {
  const int n = size();
  if (allreduce_ && n > 0) allreduce_(amax_history_.data(), n);
  std::vector<float> fp8_max_per_slot(static_cast<size_t>(n));
  for (int s = 0; s < n; ++s) fp8_max_per_slot[size_t(s)] = fp8_max(p.format_for(roles_[s]));
  const int rolled = delayed_update_all(amax_history_.data(), n, history_len_, fp8_max_per_slot.data(), p.algo,
                                        p.margin, scale_.data(), scale_inv_.data());
  step_stats_ = cur_stats_;
  std::fill(cur_stats_.begin(), cur_stats_.end(), CastStats{});
  return rolled;
}

// Re-lays a history-major [old_len, n] buffer as [new_len, n]: row 0 stays row 0, past rows are
// aligned at the newest end (see meta.h).
static std::vector<float> relayout_history(const std::vector<float>& src, int old_len, int new_len, int n) {
  std::vector<float> dst(size_t(new_len) * size_t(n), 0.0f);
  std::copy_n(src.data(), n, dst.data());
  const int keep = std::min(old_len, new_len) - 1;  // past rows kept, the newest ones
  for (int k = 0; k < keep; ++k) {
    const int from = old_len - keep + k, to = new_len - keep + k;
    std::copy_n(src.data() + size_t(from) * n, n, dst.data() + size_t(to) * n);
  }
  return dst;
}

void Fp8MetaRegistry::resize_history(int history_len) {
  if (history_len < 1)
    fail("fp8_amax_history_len is {}; it must be at least 1 (1 keeps only the current step)", history_len);
  amax_history_ = relayout_history(amax_history_, history_len_, history_len, size());
  history_len_ = history_len;
}

void Fp8MetaRegistry::set_state(const std::vector<float>& scale, const std::vector<float>& amax_history,
                                int history_len) {
  const int n = size();
  if (scale.size() != size_t(n))
    fail(
        "FP8 meta restore: {} scales given for {} registered tensors; the checkpoint was made with a "
        "different set of FP8 Linears (check fp8_modulation / first_last_layers_bf16)",
        scale.size(), n);
  if (history_len < 1 || amax_history.size() != size_t(history_len) * size_t(n))
    fail("FP8 meta restore: amax history has {} values, expected history length {} x {} tensors", amax_history.size(),
         history_len, n);
  for (int s = 0; s < n; ++s)
    if (!f32_is_finite(scale[s]) || !(scale[s] > 0.0f))
      fail(
          "FP8 meta restore: scale of '{}' ({}) is {}; a delayed scale must be finite and positive "
          "(the checkpoint is damaged)",
          names_[s], fp8_role_name(roles_[s]), scale[s]);
  scale_ = scale;
  for (int s = 0; s < n; ++s) scale_inv_[s] = scale_inverse(scale_[s]);
  amax_history_ = relayout_history(amax_history, history_len, history_len_, n);
}

}  // namespace flux8

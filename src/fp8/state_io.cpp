#include "fp8/state_io.h"

#include <fmt/core.h>

#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <tuple>
#include <utility>

#include "core/error.h"
#include "io/safetensors.h"

namespace flux8 {

SafetensorsWriter fp8_state_writer(const Fp8MetaRegistry& reg) {
  const int64_t n = reg.size(), L = reg.history_len();
  nlohmann::json slots = nlohmann::json::array();
  for (int s = 0; s < reg.size(); ++s) slots.push_back({reg.name(s), fp8_role_name(reg.role(s))});
  SafetensorsWriter w;
  // Copies: the writer may run after the registry has moved on (an asynchronous save).
  for (const auto& [name, values, shape] :
       {std::tuple{"scale", &reg.scales(), std::vector<int64_t>{n}},
        std::tuple{"amax_history", &reg.amax_history(), std::vector<int64_t>{L, n}}}) {
    auto copy = std::make_shared<const std::vector<float>>(*values);
    w.add_filled(name, DType::f32, shape, [copy](size_t first, size_t count, void* dst) {
      std::memcpy(dst, copy->data() + first, count * sizeof(float));
    });
  }
  w.set_metadata("flux8_fp8_slots", slots.dump());
  w.set_metadata("flux8_fp8_history_len", std::to_string(L));
  return w;
}

void save_fp8_state(const Fp8MetaRegistry& reg, const std::string& path) { fp8_state_writer(reg).write(path); }

std::string load_fp8_state(Fp8MetaRegistry& reg, const std::string& path) {
  const SafetensorsReader f(path);
  if (!f.metadata().count("flux8_fp8_slots") || !f.contains("scale") || !f.contains("amax_history"))
    fail("{}: not an FP8 state file (needs tensors scale, amax_history and slot metadata)", path);
  const auto slots = nlohmann::json::parse(f.metadata().at("flux8_fp8_slots"));
  const int64_t n_file = static_cast<int64_t>(slots.size());
  const std::vector<int64_t> hshape = f.tensor("amax_history").shape;
  if (hshape.size() != 2 || hshape[1] != n_file || f.tensor("scale").numel() != n_file)
    fail("{}: scale/amax_history shapes do not match its {} slots", path, n_file);
  const int64_t L_file = hshape[0];
  std::vector<float> scale(static_cast<size_t>(n_file)), hist(static_cast<size_t>(L_file * n_file));
  f.read_f32("scale", scale.data());
  f.read_f32("amax_history", hist.data());

  std::map<std::pair<std::string, std::string>, int64_t> in_file;
  for (int64_t i = 0; i < n_file; ++i)
    in_file[{slots[static_cast<size_t>(i)][0].get<std::string>(),
             slots[static_cast<size_t>(i)][1].get<std::string>()}] = i;

  // The registry's current state, with the file's values for the slots it has, at the file's
  // history length; set_state then converts to the registry's length.
  const int64_t n = reg.size();
  std::vector<float> new_scale(reg.scales());
  std::vector<float> new_hist(static_cast<size_t>(L_file * n), 0.0f);
  int restored = 0;
  for (int s = 0; s < n; ++s) {
    auto it = in_file.find({reg.name(s), fp8_role_name(reg.role(s))});
    if (it == in_file.end()) continue;
    new_scale[static_cast<size_t>(s)] = scale[static_cast<size_t>(it->second)];
    for (int64_t r = 0; r < L_file; ++r)
      new_hist[static_cast<size_t>(r * n + s)] = hist[static_cast<size_t>(r * n_file + it->second)];
    ++restored;
  }
  const int current_len = reg.history_len();
  reg.set_state(new_scale, new_hist, static_cast<int>(L_file));  // converts to current_len
  std::string note = fmt::format("FP8 state: {} of {} tensors restored", restored, n);
  if (restored < n) note += fmt::format(", {} start fresh (scale 1)", n - restored);
  if (n_file > restored) note += fmt::format(", {} in the checkpoint unused", n_file - restored);
  if (L_file != current_len)
    note += fmt::format(", amax history {} -> {} ({})", L_file, current_len,
                        L_file > current_len ? "oldest steps dropped" : "padded with empty steps");
  return note;
}

}  // namespace flux8

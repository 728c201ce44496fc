#pragma once
// The FP8 settings of a run, resolved and checked from the config keys (docs/FP8.md).
#include <cstdint>
#include <string>
#include <vector>

namespace flux8 {

class Config;

enum class Fp8Recipe : uint8_t { delayed, tensorwise, blockwise, mxfp8 };

struct Fp8Config {
  bool enabled = false;  // fp8: e4m3 | hybrid
  bool hybrid = false;   // E5M2 for gradients
  Fp8Recipe recipe = Fp8Recipe::delayed;
  int margin = 0;
  int64_t amax_history_len = 1024;
  bool amax_max = true;  // fp8_amax_compute_algo: max (else most_recent)
  bool wgrad = true;
  bool power_of_2_scales = false;      // tensorwise / blockwise scales rounded down to 2^k
  bool modulation = false;             // modulation Linears in FP8 too
  bool dot_product_attention = false;  // attention of the FP8 blocks in FP8 (cuDNN's FP8 SDPA)
  // fp8_weight_transpose: in_backward (auto's choice with a per-tensor recipe) — no transposed
  // weight cast is kept; each Linear's backward transposes the rowwise cast into a buffer shared
  // by all (per-tensor recipes only).
  bool weight_transpose_in_backward = false;
  // Forward GEMMs with the tensor cores' fast accumulation (Fp8Accumulation::fast), as
  // Transformer Engine's fprop; per-tensor recipes only (false for blockwise and mxfp8).
  bool fprop_fast_accumulation = true;
  bool first_last_bf16 = false;
  int64_t bf16_start = 1, bf16_end = 1;
  int64_t stats_interval = 100;
  // The FP8 health report warns when a tensor's flushed fraction of non-zeros or saturated
  // fraction passes these (fp8_underflow_warning, fp8_saturation_warning; 0 = never).
  double underflow_warning = 0.05, saturation_warning = 0.001;
  // Keys set to no effect under the recipe (the amax history under tensorwise, ...): each named
  // with the reason, for the log. Not errors: a tuning profile written for one recipe still loads.
  std::vector<std::string> warnings;

  // Reads and cross-checks the fp8 keys; an impossible combination, or FP8 keys without fp8,
  // is an error naming the keys and where they were set; a key the recipe ignores, a warning.
  static Fp8Config from_config(const Config& cfg);
  // Whether block `index` (double blocks first, then single) runs its Linears in FP8.
  bool block_in_fp8(int64_t index, int64_t num_blocks) const;
  std::string describe() const;  // one line for the log
};

const char* fp8_recipe_name(Fp8Recipe r);
// fp8_weight_transpose resolved: in_backward, or auto with a per-tensor recipe (delayed,
// tensorwise), whose transposed codes are the transposed cast's bytes; keep otherwise.
bool weights_transposed_in_backward(const Config& c);

}  // namespace flux8

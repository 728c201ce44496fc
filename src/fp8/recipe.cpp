#include "fp8/recipe.h"

namespace flux8 {

int delayed_update_all(float* amax_history, int n, int history_len, const float* fp8_max_per_slot, AmaxAlgo algo,
                       int margin, float* scale, float* scale_inv) {
  int rolled = 0;
  for (int s = 0; s < n; ++s)
    rolled += delayed_update_slot(amax_history + s, n, history_len, algo, fp8_max_per_slot[s], margin, scale + s,
                                  scale_inv + s);
  return rolled;
}

const char* fp8_role_name(Fp8Role r) {
  switch (r) {
    case Fp8Role::input: return "input";
    case Fp8Role::weight: return "weight";
    case Fp8Role::grad_output: return "grad_output";
  }
  return "?";
}

const char* amax_algo_name(AmaxAlgo a) { return a == AmaxAlgo::max ? "max" : "most_recent"; }

}  // namespace flux8

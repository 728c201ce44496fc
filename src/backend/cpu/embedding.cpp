// Sinusoidal timestep embedding, evaluated in the tensor dtype with the reference's operation
// order, so the f32 result matches the PyTorch reference's f32 computation:
//   freqs = exp(−ln(max_period)·arange(half)/half);  args = (time_factor·t)·freqs.
#include <cmath>

#include "backend/cpu/common.h"
#include "backend/cpu/cpu_backend.h"

namespace flux8 {
using namespace cpu;

void CpuBackend::timestep_embedding(Tensor out, Tensor t, float time_factor, float max_period) {
  constexpr std::string_view op = "timestep_embedding";
  const DType dt = call_dtype(op, {{"out", out}, {"t", t}});
  require_rank(op, {"out", out}, 2);
  const int64_t B = out.shape[0], dim = out.shape[1], half = dim / 2;
  require_vector(op, {"t", t}, B);
  const Ctx c = make_ctx(options_, dt);
  dispatch(dt, [&]<typename T>(T) {
    const T neg_log_period = static_cast<T>(-std::log(static_cast<double>(max_period)));
    parallel_for(B, c, [&](int64_t b) {
      const T scaled_t = static_cast<T>(time_factor) * t.ptr<T>()[b];
      T* o = row<T>(out, b);
      for (int64_t k = 0; k < half; ++k) {
        const T freq = std::exp(neg_log_period * static_cast<T>(k) / static_cast<T>(half));
        const T arg = scaled_t * freq;
        o[k] = act<T>(std::cos(arg), c);
        o[half + k] = act<T>(std::sin(arg), c);
      }
      if (dim % 2) o[dim - 1] = 0;  // odd widths are zero-padded, as in the reference
    });
  });
}

}  // namespace flux8

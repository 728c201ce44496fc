#pragma once
// The conformance table: every op of FLUX8_OPS (backend/ops.h) has at least one registered case,
// and one parametrised test runs each case on every backend variant this binary can reach, against
// a reference run on the CPU backend. README.md (next to this file) says how to add a case and
// how tolerances are set.
//
// A case builds its inputs from seeds on the backend it is given (Run), allocates the outputs it
// wants compared, and returns the op to run (an AnyOp). The runner executes it, reads the outputs
// back and compares them by name with the reference run's.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "backend/backend.h"
#include "fp8/qtensor.h"

namespace flux8::conformance {

// The backends a case runs on. The CPU binary runs the CPU variants, the GPU binary the CUDA ones.
enum class Variant : uint8_t {
  cpu_f32,            // CPU backend, f32
  cpu_bf16_rounding,  // CPU backend, f32 with every activation output rounded to bf16
  cuda_f32,           // CUDA backend, f32 activations and exact f32 GEMMs
  cuda_bf16,          // CUDA backend, bf16 activations and bf16 GEMM operands (the training setup)
};
std::string_view variant_name(Variant v);
bool variant_on_cuda(Variant v);
bool variant_rounds_to_bf16(Variant v);
// The backend of a variant (created once); for the CUDA variants, "" when a GPU is usable here,
// else why not.
Backend& backend_of(Variant v);
std::string unavailable_reason(Variant v);

// What a tensor is to an op: picks its element type on a backend (backend/precision.h).
enum class Role : uint8_t {
  activation,  // activation_dtype(): inputs, outputs and input gradients
  parameter,   // the compute dtype: weights, biases, scales, statistics
  gradient,    // gradient_dtype(): parameter gradients
  heads,       // attention_heads_dtype(activations, head dim = last dimension)
};

// How a case's outputs are judged.
enum class Judge : uint8_t {
  // Against the CPU backend in f64, by normalised error max|got − ref| / max|ref| ≤ tolerance.
  f64_reference,
  // Against the CPU backend in f32 (with bf16 rounding where the variant rounds), by the same
  // normalised error, or bit for bit where the tolerance is 0: the ops the CPU runs in f32 only
  // (FP8), and the results every backend must give bit for bit (FP8 codes, the optimizer).
  cpu_f32,
};

// The memory of one run of a case on one backend. Every tensor it allocates lies between guard
// bytes; compared outputs start as NaN in their window and with a pattern in their padding
// columns and guards, which must survive the op (a stray write fails the case).
class Run {
 public:
  // compute: f64 for the reference run, else f32.
  Run(Backend& be, DType compute);
  ~Run();
  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;

  Backend& be;
  const DType compute;
  // FP8 tensors a case's build hands to its finish (Case::finish).
  std::vector<QTensor> kept;

  // An input of N(0, stddev²) values drawn from (seed, index) and rounded to bf16, so that every
  // variant's element type holds the same values exactly. `pad` columns past each row (ld =
  // cols + pad) hold NaN, which the op must not read.
  Tensor input(Shape s, uint64_t seed, double stddev = 1.0, int64_t pad = 0, Role role = Role::activation);
  // input() of a fixed element type (gradient factors, contiguous f32 on every backend).
  Tensor input_typed(Shape s, uint64_t seed, double stddev, DType dtype);
  // An input of the given values, rounded to bf16 like input()'s.
  Tensor input_values(Shape s, const std::vector<double>& values, Role role = Role::parameter);
  // A compared output that the op overwrites: its window starts as NaN.
  Tensor output(const std::string& name, Shape s, int64_t pad = 0, Role role = Role::activation);
  // A compared output that the op reads and updates (+=, in place): it starts as input() would.
  Tensor update(const std::string& name, Shape s, uint64_t seed, double stddev = 1.0, int64_t pad = 0,
                Role role = Role::activation);
  // update() with the given values (rounded to bf16 like input()'s).
  Tensor update_values(const std::string& name, Shape s, const std::vector<double>& values,
                       Role role = Role::parameter);
  // A compared output of a fixed element type (mse_loss_into's f64 loss, adamw's bf16 copies).
  Tensor output_typed(const std::string& name, Shape s, DType dtype);
  // Memory the op or the case's preparation uses but nobody compares (zero-filled).
  Tensor scratch(Shape s, Role role = Role::activation);
  // f32 scalars in backend memory (FP8 scales and amaxes), set to `value`; compared when named.
  float* scalars(const std::string& name, int64_t n, float value);
  // An FP8 tensor in backend memory whose codes and scales are compared when named (codes start
  // as 0xFF bytes, scales as NaN).
  QTensor qtensor(const std::string& name, int64_t rows, int64_t cols, Fp8Format format = Fp8Format::e4m3,
                  Fp8Scaling scaling = Fp8Scaling::per_tensor);
  // A value the host computed, compared like an output (e.g. an op's result, counts).
  void value(const std::string& name, double v);

  // The element type of `role` for a tensor whose last dimension is `cols` on this run.
  DType dtype_of(Role role, int64_t cols) const;
  // True when some tensor of this run is stored in bf16, or the backend rounds activations to bf16
  // values (its tolerance then includes bf16 steps).
  bool stores_bf16() const { return stores_bf16_; }

  struct Output {
    std::string name;
    std::vector<double> values;  // the window, row by row
  };
  // Every compared output's values, in allocation order; each violated guard, padding column
  // or unwritten sentinel is named in `damage`.
  std::vector<Output> collect(std::vector<std::string>& damage);

 private:
  struct Block;
  Tensor allocate(const std::string& name, Shape s, int64_t pad, DType dtype, bool compared);
  void fill_window(Block& b, const std::function<double(size_t)>& value_at);
  std::vector<std::unique_ptr<Block>> blocks_;
  std::vector<Output> host_values_;
  bool stores_bf16_ = false;
};

struct Case {
  std::string op;    // the op's method name in FLUX8_OPS ("linear")
  std::string name;  // what the case exercises, a C identifier ("odd_shape_windows")
  // Allowed normalised error: f32_terms·2⁻²⁴, plus bf16_steps·2⁻⁸ on a run that stores some tensor
  // in bf16 (each bf16 rounding of a value on its way to the output costs at most 2⁻⁹ of the
  // largest magnitude; 2⁻⁸ leaves a factor 2), plus fp8_steps·2⁻³ (an E4M3 code one step off).
  // All zero: bit for bit.
  double f32_terms = 0;
  double bf16_steps = 0;
  double fp8_steps = 0;
  std::string why;  // one line: where the tolerance comes from
  Judge judge = Judge::f64_reference;
  bool with_bf16 = true;  // meaningful on the bf16 variants (false: f32 only, e.g. f32-only ops)
  std::function<AnyOp(Run&)> build;
  // Optional, after the op: more ops whose outputs are compared (e.g. a dequantize of FP8 codes
  // that need not be bit-equal).
  std::function<void(Run&)> finish;
};

// A finite-difference gradient check in f64 on the CPU backend (tests/gradcheck.h): each named
// check compares a backward op's gradient with central differences along a random direction.
struct GradientCase {
  std::string forward, backward;  // op method names
  struct Check {
    std::string what;
    double rel_error;
    double analytic, numeric;
  };
  std::function<std::vector<Check>(Backend& cpu)> run;
};

// Registration, from the case files' static objects.
struct Cases {
  explicit Cases(std::vector<Case> cases);
  Cases(std::vector<Case> cases, std::vector<GradientCase> gradients);
};
const std::vector<Case>& all_cases();
const std::vector<GradientCase>& all_gradient_cases();

// The outcome of one case on one variant: empty when it conforms, else what failed.
std::string run_case(const Case& c, Variant v);

// Every op method name of FLUX8_OPS.
std::vector<std::string> listed_ops();

}  // namespace flux8::conformance

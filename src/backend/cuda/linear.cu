// Linear layer y = x·wᵀ + b and its backward through cuBLASLt (gemm.h). Two precisions:
// - bf16 (BackendOptions::bf16_gemm, the training default): operands rounded to bf16 (RNE) into
//   scratch, tensor-core GEMM with fp32 accumulation — what "BF16 training" means for the
//   GEMMs; the result differs from the exact product by the operand rounding (~2⁻⁹ relative per
//   operand). Activations stored in bf16 (x, y, dx, dy: Backend::activation_dtype) go to
//   cuBLASLt as they are, and y, dx come back in bf16 (rounded once from the fp32 sum); the f32
//   weight is rounded into scratch. dw, db are f32, or bf16 (grad_precision: bf16, rounded once
//   from the fp32 sums as they are stored).
// - f32: exact f32 GEMMs with fp32 compute (no TF32), the reference the tests compare with
//   (f32 activations only).
// Row-major tensors are column-major transposes, so each product is issued with the operands
// swapped: y[N,M] = x·wᵀ  <=>  yᵀ[M,N] = wᵀ·xᵀ, with the row strides as leading dimensions.
#include <cuda_bf16.h>
#include <fmt/format.h>

#include "backend/cuda/common.cuh"
#include "backend/cuda/gemm.h"

namespace flux8 {
using namespace cuda;

namespace {

// A GEMM operand as handed to cuBLASLt: pointer, leading dimension and element type.
struct Operand {
  const void* p;
  int64_t ld;
  cudaDataType_t type;
};

// x (any ld) rounded to bf16 into dst as a contiguous [rows, cols] matrix: a contiguous x
// through the shared vectorised conversion (convert.cu), a strided one row by row.
Operand bf16_operand(CudaBackend& be, const Tensor& x, __nv_bfloat16* dst) {
  const Mat X = mat(x);
  const int64_t cols = X.cols;
  if (x.contiguous())
    to_bf16(dst, X.p, X.rows * cols, be.stream());
  else
    for_each_row(be, X.rows, cols,
                 [=] __device__(int64_t r, int c) { dst[r * cols + c] = __float2bfloat16_rn(X.at(r, c)); });
  return Operand{dst, cols, CUDA_R_16BF};
}

// The operands of one call in the precision the backend runs its GEMMs in: bf16 when the
// activations are bf16 or bf16_gemm is set, else f32. bf16 tensors are used in place; f32 ones
// are rounded into copies that share one scratch allocation (carved in 256-byte pieces).
class Operands {
 public:
  Operands(CudaBackend& be, bool bf16_activations, std::initializer_list<const Tensor*> tensors)
      : be_(be), bf16_(bf16_activations || be.options().bf16_gemm) {
    if (!bf16_) return;
    size_t total = 0;
    for (const Tensor* t : tensors) total += t->defined() && t->dtype == DType::f32 ? align(t->numel() * 2) : 0;
    if (total) base_ = static_cast<char*>(be.scratch(total));
  }
  Operand get(const Tensor& t) {
    if (!bf16_) return Operand{t.data, t.ld, CUDA_R_32F};
    if (t.dtype == DType::bf16) return Operand{t.data, t.ld, CUDA_R_16BF};
    auto* dst = reinterpret_cast<__nv_bfloat16*>(base_ + used_);
    used_ += align(t.numel() * 2);
    return bf16_operand(be_, t, dst);
  }
  cudaDataType_t type() const { return bf16_ ? CUDA_R_16BF : CUDA_R_32F; }

 private:
  static size_t align(int64_t bytes) { return (static_cast<size_t>(bytes) + 255) / 256 * 256; }
  CudaBackend& be_;
  bool bf16_;
  char* base_ = nullptr;
  size_t used_ = 0;
};

cudaDataType_t cuda_type(const Tensor& t) { return t.dtype == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F; }

// The weight `w`: f32, or already bf16 (Backend::weight_operand_dtype: the model's per-step
// copy) where this call's GEMM runs on bf16 operands — Operands passes a bf16 tensor through.
void require_weight(CudaBackend& be, std::string_view op, const Tensor& w, bool bf16_activations) {
  if (!w.defined() || w.dtype == DType::f32) return;
  if (w.dtype == DType::bf16 && (bf16_activations || be.options().bf16_gemm)) return;
  fail("{}: weight 'w' is {}: expected f32{}", op, dtype_name(w.dtype),
       bf16_activations || be.options().bf16_gemm ? " or bf16" : " (bf16 weights need bf16 GEMM operands)");
}

// c[r, j] (+)= bias[j] after the product (gemm_with_bias's last resort), in the CPU's order.
template <typename T>
void add_bias(CudaBackend& be, const Tensor& c, BiasVector bias) {
  const MatOf<T> C = mat_of<T>(c);
  for_each_row(be, C.rows, C.cols, [=] __device__(int64_t r, int j) { C.set(r, j, C.get(r, j) + bias[j]); });
}

// An element of a GEMM operand stored as f32 or bf16, by the description's type.
__device__ inline float element(const void* p, cudaDataType_t t, int64_t i) {
  return t == CUDA_R_16BF ? __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]) : static_cast<const float*>(p)[i];
}

// Column-major D[m, n] = op(A)·op(B) (+ D when accumulating) (+ bias[m]), one thread per element,
// fp32 sums in k order: for a description cuBLASLt offers an algorithm for and then refuses to
// run (GemmRefused; seen for bf16 operands at k = 2). Slow, but only ever met at tiny shapes.
__device__ void plain_gemm_element(const GemmDesc& d, const void* a, const void* b, void* out, BiasVector bias,
                                   int64_t i, int64_t j) {
  float acc = 0;
  for (int64_t l = 0; l < d.k; ++l) {
    const float x = element(a, d.type_a, d.trans_a == CUBLAS_OP_N ? i + l * d.lda : l + i * d.lda);
    const float y = element(b, d.type_b, d.trans_b == CUBLAS_OP_N ? l + j * d.ldb : j + l * d.ldb);
    acc += x * y;
  }
  const int64_t o = i + j * d.ldd;
  if (d.accumulate) acc += element(out, d.type_d, o);
  if (bias) acc += bias[i];
  if (d.type_d == CUDA_R_16BF)
    static_cast<__nv_bfloat16*>(out)[o] = __float2bfloat16_rn(acc);
  else
    static_cast<float*>(out)[o] = acc;
}

__global__ void plain_gemm_kernel(GemmDesc d, const void* a, const void* b, void* out, BiasVector bias) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= d.m) return;
  for (int64_t j = blockIdx.y; j < d.n; j += gridDim.y) plain_gemm_element(d, a, b, out, bias, i, j);
}

bool is_fp8_type(cudaDataType_t t) { return t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2; }

}  // namespace

namespace cuda {

namespace {

// Runs `d` when cuBLASLt offers an algorithm for it and runs it; false when nothing ran, with the
// reason in `why` (a GemmRefused marks the description unsupported from then on).
bool try_run(Gemm& gemm, const GemmDesc& d, const GemmArgs& args, std::string& why) {
  if (!gemm.has_algorithm(d)) {
    why = gemm.supported(d);
    return false;
  }
  try {
    gemm.run(d, args);
    return true;
  } catch (const GemmRefused& refused) {
    why = refused.what();
    return false;
  }
}

// Says once per epilogue kind, on stderr, that cuBLASLt did not run it and why: the op runs its
// separate kernels instead (correct, slower).
void note_unfused(Epilogue e, const std::string& why) {
  static bool noted[3] = {};
  bool& n = noted[static_cast<size_t>(e)];
  if (e == Epilogue::none || n) return;
  n = true;
  fmt::print(stderr, "note: {}; the op runs its unfused kernels instead (noted once per epilogue)\n", why);
}

// `d` with bias[cols of c] added in its epilogue: an f32 bias as it is or (bf16 c) as a bf16 copy,
// a bf16 bias as it is; false when none of these runs (nothing ran), with the reason in `why`.
// On the H200 cuBLASLt offers no f32 bias for a bf16 D, so that variant is passed over without
// asking twice (the reason is only formatted when the last variant fails too).
bool run_with_bias_epilogue(CudaBackend& be, GemmDesc d, GemmArgs args, const Tensor& c, BiasVector bias,
                            std::string& why) {
  Gemm& gemm = be.gemm();
  d.bias = true;
  d.bias_type = bias.bf16 ? CUDA_R_16BF : CUDA_R_32F;
  args.bias = bias.p;
  const int64_t n = c.cols();
  if (bias.bf16 && !aligned16(bias.p)) {
    // A slice of a bf16 copy (linear_gelu's GELU part) may start anywhere; cuBLASLt is only
    // handed 16-byte aligned vectors, as a refusal would mark the description unsupported.
    void* aligned = be.epilogue_scratch(static_cast<size_t>(n) * 2);
    FLUX8_CUDA_CHECK(
        cudaMemcpyAsync(aligned, bias.p, static_cast<size_t>(n) * 2, cudaMemcpyDeviceToDevice, be.stream()));
    args.bias = aligned;
  }
  const bool bf16_c = c.dtype == DType::bf16;
  if (bias.bf16 || !bf16_c || gemm.has_algorithm(d)) {
    if (try_run(gemm, d, args, why)) return true;
    if (bias.bf16 || !bf16_c) return false;
  }
  d.bias_type = CUDA_R_16BF;
  if (!gemm.has_algorithm(d)) {  // the copy only for a variant on offer
    why = gemm.supported(d);
    return false;
  }
  auto* b16 = static_cast<__nv_bfloat16*>(be.epilogue_scratch(static_cast<size_t>(n) * 2));
  to_bf16(b16, static_cast<const float*>(bias.p), n, be.stream());
  args.bias = b16;
  return try_run(gemm, d, args, why);
}

}  // namespace

BiasVector bias_vector(std::string_view op, const Tensor& b, const Tensor& out) {
  if (!b.defined()) return {};
  if (!b.contiguous()) fail("{}: bias 'b' {} must be contiguous", op, b.str());
  if (b.dtype == DType::f32) return {b.data, false};
  if (b.dtype == DType::bf16 && out.dtype == DType::bf16) return {b.data, true};
  fail("{}: bias 'b' is {}: expected f32{}", op, dtype_name(b.dtype),
       out.dtype == DType::bf16 ? " or bf16" : " (a bf16 bias is only taken for a bf16 output)");
}

void gemm_with_bias(CudaBackend& be, GemmDesc d, GemmArgs args, const Tensor& c, BiasVector bias) {
  Gemm& gemm = be.gemm();
  std::string why;
  if (bias && run_with_bias_epilogue(be, d, args, c, bias, why)) return;
  try {
    gemm.run(d, args);
  } catch (const GemmRefused& refused) {
    if (is_fp8_type(d.type_a) || is_fp8_type(d.type_b)) throw;  // FP8: the caller's emulated kernel
    static bool noted = false;
    if (!noted) {
      noted = true;
      fmt::print(stderr, "{}; computed by a plain kernel instead (noted once)\n", refused.what());
    }
    const unsigned columns = static_cast<unsigned>(d.n < 65535 ? d.n : 65535);  // the kernel loops past
    plain_gemm_kernel<<<dim3(exact_blocks(d.m), columns), kThreads, 0, be.stream()>>>(d, args.a, args.b, args.d, bias);
    FLUX8_LAUNCH_CHECK(plain_gemm_kernel);
    return;
  }
  if (!bias) return;
  if (c.dtype == DType::bf16)
    add_bias<__nv_bfloat16>(be, c, bias);
  else
    add_bias<float>(be, c, bias);
}

}  // namespace cuda

namespace {

// Column sums of dy (f32 or bf16) into the bias gradient db (f32, or bf16 with bf16 gradients;
// accumulated, or overwritten).
template <typename T>
void bias_gradient(CudaBackend& be, const Tensor& dy, const Tensor& db, bool accumulate) {
  const MatOf<T> DY = mat_of<T>(dy);
  const auto value = [=] __device__(int64_t, int64_t r, int64_t c) { return double(DY.get(r, c)); };
  with_grad_storage(db, [&](auto* out) { column_sums(be, 1, DY.rows, DY.cols, value, out, DY.cols, accumulate); });
}

// The forward product y[N,M] = x·wᵀ (yᵀ = wᵀ·xᵀ column-major) and the input gradient
// dx[N,K] = dy·w (dxᵀ = w-as-colmajor[K,M]·dyᵀ), described for cuBLASLt on the call's operands.
GemmDesc fprop_desc(const Operand& W, const Operand& X, const Tensor& y, int64_t N, int64_t K, int64_t M) {
  GemmDesc d;
  d.trans_a = CUBLAS_OP_T;
  d.trans_b = CUBLAS_OP_N;
  d.m = M, d.n = N, d.k = K;
  d.lda = W.ld, d.ldb = X.ld, d.ldd = y.ld;
  d.type_a = d.type_b = W.type;
  d.type_d = cuda_type(y);
  return d;
}
GemmDesc dgrad_desc(const Operand& W, const Operand& DY, const Tensor& dx, int64_t N, int64_t K, int64_t M) {
  GemmDesc d;
  d.m = K, d.n = N, d.k = M;
  d.lda = W.ld, d.ldb = DY.ld, d.ldd = dx.ld;
  d.type_a = d.type_b = W.type;
  d.type_d = cuda_type(dx);
  return d;
}

// Whether a call's operands suit cuBLASLt's epilogues (aux matrices): 16-byte aligned and
// leading dimensions of 16-byte multiples. The heuristic assumes aligned pointers; a misaligned
// call would be refused when run and mark its description unsupported for every later call of
// the shape, so such calls take the unfused path without asking.
bool epilogue_operands_aligned(std::initializer_list<Operand> operands, std::initializer_list<const Tensor*> outputs) {
  auto ok = [](const void* p, int64_t ld, size_t elem) {
    return aligned16(p) && (static_cast<size_t>(ld) * elem) % 16 == 0;
  };
  for (const Operand& o : operands)
    if (!ok(o.p, o.ld, o.type == CUDA_R_16BF ? 2 : 4)) return false;
  for (const Tensor* t : outputs)
    if (!ok(t->data, t->ld, dtype_size(t->dtype))) return false;
  return true;
}

// y = b (or 0) for an empty product.
template <typename T>
void fill_bias(CudaBackend& be, const Tensor& y, BiasVector bias) {
  const MatOf<T> Y = mat_of<T>(y);
  for_each_row(be, Y.rows, Y.cols, [=] __device__(int64_t r, int c) { Y.set(r, c, bias[c]); });
}

}  // namespace

void CudaBackend::execute(const op::Linear& args) {
  constexpr std::string_view op = "linear";
  const bool bf16 = activations_in_bf16(op, tensor_fields(args, {"y", "x"}));
  const BiasVector bias = bias_vector(op, args.b, args.y);
  require_weight(*this, op, args.w, bf16);
  const auto [N, K, M] = ops::check(op, args);
  if (K == 0) {  // empty product: y = b (or 0)
    if (!bias)
      fill(args.y, 0.0);
    else if (bf16)
      fill_bias<__nv_bfloat16>(*this, args.y, bias);
    else
      fill_bias<float>(*this, args.y, bias);
    return;
  }
  Operands ops(*this, bf16, {&args.w, &args.x});
  const Operand W = ops.get(args.w), X = ops.get(args.x);
  const GemmDesc d = fprop_desc(W, X, args.y, N, K, M);
  gemm_with_bias(*this, d, GemmArgs{.a = W.p, .b = X.p, .d = args.y.data}, args.y, bias);
}

void CudaBackend::execute(const op::LinearBackward& args) {
  constexpr std::string_view op = "linear_backward";
  const bool bf16 = activations_in_bf16(op, tensor_fields(args, {"dx", "dy", "x"}));
  grads_in_bf16(op, tensor_fields(args, {"dw", "db"}));  // f32, or bf16 gradients (Backend::gradient_dtype)
  require_weight(*this, op, args.w, bf16);
  require_defined(op, {"dy", args.dy});
  require_rank(op, {"w", args.w}, 2);
  const int64_t N = args.dy.rows(), M = args.dy.cols(), K = args.w.shape[1];
  if (args.w.shape[0] != M)
    fail("{}: weight 'w' {} must be [{}, K] to match the output gradient 'dy' {}", op, args.w.str(), M, args.dy.str());
  const bool gemm_dx = args.dx.defined() && M > 0, gemm_dw = args.dw.defined() && N > 0;
  static const Tensor none;
  Operands ops(*this, bf16, {&args.dy, gemm_dx ? &args.w : &none, gemm_dw ? &args.x : &none});
  const Operand DY = gemm_dx || gemm_dw ? ops.get(args.dy) : Operand{};
  if (args.dx.defined()) {
    if (args.dx.rows() != N || args.dx.cols() != K)
      fail("{}: input gradient 'dx' {} must have {} rows of {} columns", op, args.dx.str(), N, K);
    if (M == 0) {
      if (!args.accumulate_dx) fill(args.dx, 0.0);
    } else {
      const Operand W = ops.get(args.w);
      GemmDesc d = dgrad_desc(W, DY, args.dx, N, K, M);
      d.accumulate = args.accumulate_dx;
      gemm_with_bias(*this, d, GemmArgs{.a = W.p, .b = DY.p, .d = args.dx.data}, args.dx, BiasVector{});
    }
  }
  if (args.dw.defined()) {
    require_shape(op, {"dw", args.dw}, args.w.shape);
    require_defined(op, {"x", args.x});
    if (args.x.rows() != N || args.x.cols() != K)
      fail("{}: input 'x' {} must have {} rows of {} columns", op, args.x.str(), N, K);
    if (N > 0) {
      // dwᵀ[K,M] += xᵀ[K,N] · dy[N,M]
      const Operand X = ops.get(args.x);
      GemmDesc d;
      d.trans_b = CUBLAS_OP_T;
      d.m = K, d.n = M, d.k = N;
      d.lda = X.ld, d.ldb = DY.ld, d.ldd = args.dw.ld;
      d.type_a = d.type_b = ops.type();
      d.type_d = cuda_type(args.dw);          // f32, or bf16: the fp32 sum rounded as it is stored (+= reads it back)
      d.accumulate = args.accumulate_params;  // beta = 0: the old contents are never read
      if (args.dw.dtype == DType::bf16 && d.type_a == CUDA_R_32F) {
        // Exact f32 GEMMs (gemm_precision: f32) have no bf16 output in cuBLASLt: the sum goes to
        // an f32 temporary (holding the old values when accumulating), then is rounded into dw.
        // (The f32 Operands use no scratch, so scratch2 is free.)
        const Tensor sum(scratch2(static_cast<size_t>(args.dw.numel()) * sizeof(float)), DType::f32, args.dw.shape);
        if (args.accumulate_params) copy(sum, args.dw);
        d.type_d = CUDA_R_32F;
        d.ldd = sum.ld;
        gemm_with_bias(*this, d, GemmArgs{.a = X.p, .b = DY.p, .d = sum.data}, sum, BiasVector{});
        copy(args.dw, sum);
      } else {
        gemm_with_bias(*this, d, GemmArgs{.a = X.p, .b = DY.p, .d = args.dw.data}, args.dw, BiasVector{});
      }
    } else if (!args.accumulate_params) {
      fill(args.dw, 0.0);
    }
  }
  if (args.db.defined()) {
    if (args.db.numel() != M || !args.db.contiguous())
      fail("{}: bias gradient 'db' {} must be a contiguous vector of {} elements", op, args.db.str(), M);
    if (bf16)
      bias_gradient<__nv_bfloat16>(*this, args.dy, args.db, args.accumulate_params);
    else
      bias_gradient<float>(*this, args.dy, args.db, args.accumulate_params);
  }
}

// Two GEMMs where the GELU covers only h's last columns: the plain part, then the GELU part with
// the epilogue (cuBLASLt applies an epilogue to the whole output).
void CudaBackend::execute(const op::LinearGelu& call) {
  constexpr std::string_view op = "linear_gelu";
  const bool bf16 = activations_in_bf16(op, tensor_fields(call, {"y", "h", "x"}));
  bias_vector(op, call.b, call.h);  // refuses a bias of another type, naming it
  require_weight(*this, op, call.w, bf16);
  const auto [N, K, M, G] = ops::check(op, call);
  const int64_t first = M - G;
  const Tensor h_gelu = call.h.cols_slice(first, G), w_gelu = call.w.rows_slice(first, G),
               b_gelu = vector_part(call.b, first, G);
  bool fused = false;
  if (K > 0 && N > 0) {
    Operands ops(*this, bf16, {&w_gelu, &call.x});
    const Operand W = ops.get(w_gelu), X = ops.get(call.x);
    if (epilogue_operands_aligned({W, X}, {&call.y, &h_gelu})) {
      GemmDesc d = fprop_desc(W, X, call.y, N, K, G);
      d.epilogue = Epilogue::gelu_aux;
      d.aux_ld = h_gelu.ld;
      const GemmArgs args{.a = W.p, .b = X.p, .d = call.y.data, .aux = h_gelu.data};
      std::string why;
      fused = call.b.defined() ? run_with_bias_epilogue(*this, d, args, call.y, bias_vector(op, b_gelu, call.y), why)
                               : try_run(gemm(), d, args, why);
      if (!fused) note_unfused(d.epilogue, why);
    }
  }
  if (fused) {
    if (first > 0)
      linear(call.h.cols_slice(0, first), call.x, call.w.rows_slice(0, first), vector_part(call.b, 0, first));
    return;
  }
  // No epilogue for this call: the Linear into h, then the GELU of the stored (rounded) values.
  linear(call.h, call.x, call.w, call.b);
  gelu_tanh(call.y, h_gelu);
}

void CudaBackend::execute(const op::LinearDgradGelu& args) {
  constexpr std::string_view op = "linear_dgrad_gelu";
  const bool bf16 = activations_in_bf16(op, tensor_fields(args, {"dx", "dh", "dy", "h"}));
  require_weight(*this, op, args.w, bf16);
  const auto [N, K, M, G] = ops::check(op, args);
  const int64_t first = K - G;
  const Tensor w_gelu = args.w.cols_slice(first, G);
  bool fused = false;
  if (N > 0 && M > 0) {
    Operands ops(*this, bf16, {&args.dy, &w_gelu});
    const Operand DY = ops.get(args.dy), W = ops.get(w_gelu);
    if (epilogue_operands_aligned({DY, W}, {&args.dh, &args.h})) {
      GemmDesc d = dgrad_desc(W, DY, args.dh, N, G, M);  // ⊙ gelu'(h) in the epilogue
      d.epilogue = Epilogue::dgelu;
      d.aux_ld = args.h.ld;
      std::string why;
      fused = try_run(gemm(), d, GemmArgs{.a = W.p, .b = DY.p, .d = args.dh.data, .aux = args.h.data}, why);
      if (!fused) note_unfused(d.epilogue, why);
    }
  }
  if (first > 0)
    linear_backward(args.dx, Tensor{}, Tensor{}, args.dy, Tensor{}, args.w.cols_slice(0, first), false, false);
  if (fused) return;
  // No epilogue: the GELU part's input gradient (rounded), then the GELU's backward in place.
  linear_backward(args.dh, Tensor{}, Tensor{}, args.dy, Tensor{}, w_gelu, false, false);
  gelu_tanh_backward(args.dh, args.dh, args.h);
}

void CudaBackend::execute(const op::BiasAdd& args) {
  constexpr std::string_view op = "bias_add";
  const bool bf16 = activations_in_bf16(op, {{"y", args.y}});
  ops::require_vector(op, {"b", args.b}, args.y.cols());
  const cuda::BiasVector bias = cuda::bias_vector(op, args.b, args.y);
  if (bf16)
    add_bias<__nv_bfloat16>(*this, args.y, bias);
  else
    add_bias<float>(*this, args.y, bias);
}

}  // namespace flux8

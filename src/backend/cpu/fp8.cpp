// FP8 casts and the TN FP8 GEMM on the CPU: the reference quantizers of src/fp8/quantize.h
// written into backend views, and GEMMs emulated exactly by dequantize + fp32 GEMM (an FP8
// product is exact in fp32, so only the summation order differs from a tensor core).
#include <algorithm>
#include <cstring>

#include "backend/cpu/common.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/op_checks.h"
#include "fp8/recipe.h"

namespace flux8 {
using namespace cpu;

namespace {

// x (any ld) as a contiguous f32 matrix, or its transpose.
std::vector<float> gather(const Tensor& x, bool transpose, const Ctx& c) {
  const int64_t R = x.rows(), C = x.cols();
  std::vector<float> out(static_cast<size_t>(R * C));
  if (!transpose) {
    parallel_for(R, c, [&](int64_t r) { std::copy_n(row<float>(x, r), C, out.data() + r * C); });
  } else {
    parallel_for(C, c, [&](int64_t j) {
      for (int64_t r = 0; r < R; ++r) out[static_cast<size_t>(j * R + r)] = row<float>(x, r)[j];
    });
  }
  return out;
}

void store(const QTensor& dst, const QuantizedTensor& q, const char* which) {
  if (dst.rows != q.rows || dst.cols != q.cols || dst.format != q.format || dst.scaling != q.scaling)
    fail("quantize: the {} output is [{}, {}] {} {}, the cast gives [{}, {}] {} {}", which, dst.rows, dst.cols,
         fp8_format_name(dst.format), fp8_scaling_name(dst.scaling), q.rows, q.cols, fp8_format_name(q.format),
         fp8_scaling_name(q.scaling));
  std::memcpy(dst.codes, q.codes.data(), q.codes.size());
  if (q.scaling == Fp8Scaling::mx_1x32)
    std::memcpy(dst.scale_e8m0, q.scale_e8m0.data(), q.scale_e8m0.size());
  else
    std::memcpy(dst.scale_inv, q.scale_inv.data(), q.scale_inv.size() * sizeof(float));
}

QuantizedTensor cast(const std::vector<float>& x, int64_t rows, int64_t cols, const Backend::Quantize& q,
                     float per_tensor_scale, CastStats* stats) {
  switch (q.scaling) {
    case Fp8Scaling::per_tensor: return quantize_per_tensor(x.data(), rows, cols, q.format, per_tensor_scale, stats);
    case Fp8Scaling::block_1x128:
    case Fp8Scaling::block_128x128:
      return quantize_blockwise(x.data(), rows, cols, q.format, q.scaling, CurrentScalingOptions{q.pow2, 0.0f}, stats);
    case Fp8Scaling::mx_1x32: return quantize_mxfp8(x.data(), rows, cols, q.format, stats);
  }
  fail("quantize: unknown scaling");
}

// decode(code) · scale_inv of the element's block, into a contiguous f32 matrix.
std::vector<float> dequantize_view(const QTensor& q, const Ctx& c) {
  std::vector<float> out(static_cast<size_t>(q.numel()));
  const int64_t br = q.scaling == Fp8Scaling::block_128x128 ? 128 : 1;
  const int64_t bc = q.scaling == Fp8Scaling::per_tensor ? std::max<int64_t>(q.cols, 1)
                     : q.scaling == Fp8Scaling::mx_1x32  ? 32
                                                         : 128;
  const int64_t scale_cols = (q.cols + bc - 1) / bc;
  parallel_for(q.rows, c, [&](int64_t r) {
    for (int64_t j = 0; j < q.cols; ++j) {
      const int64_t k = q.scaling == Fp8Scaling::per_tensor ? 0 : (r / br) * scale_cols + j / bc;
      const float s = q.scaling == Fp8Scaling::mx_1x32 ? e8m0_decode(q.scale_e8m0[k]) : q.scale_inv[k];
      out[static_cast<size_t>(r * q.cols + j)] = dequantize_value(q.codes[r * q.cols + j], s, q.format);
    }
  });
  return out;
}

}  // namespace

void CpuBackend::execute(const op::Quantize& args) {
  const bool any_copy = ops::check("quantize", args);
  ops::check_quantize_spec("quantize", args.q);
  ops::check_column_sums("quantize", args.q.column_sums, args.x.cols());
  const Ctx c = make_ctx(options_, DType::f32);
  const int64_t R = args.x.rows(), C = args.x.cols();
  if (any_copy) {
    const std::vector<float> xr = gather(args.x, false, c);
    // One scale for both copies under per-tensor scaling: the registry's (delayed) or the
    // current scale of this tensor, or of the whole tensor it is a part of.
    const float amax = tensor_amax(xr.data(), R * C);
    const float scale = args.q.delayed_scale ? *args.q.delayed_scale
                                             : current_scale(args.q.whole_amax ? *args.q.whole_amax : amax,
                                                             fp8_max(args.q.format), args.q.pow2);
    CastStats st;
    if (args.rowwise.defined()) store(args.rowwise, cast(xr, R, C, args.q, scale, &st), "rowwise");
    if (args.columnwise.defined())
      store(args.columnwise, cast(gather(args.x, true, c), C, R, args.q, scale, args.rowwise.defined() ? nullptr : &st),
            "columnwise");
    if (args.q.amax) *args.q.amax = amax_accumulate(*args.q.amax, amax);
    if (args.q.stats) args.q.stats->merge(st);
  }
  if (args.q.column_sums.defined()) {  // as linear_backward's db
    if (!args.q.column_sums_accumulate) fill(args.q.column_sums, 0.0);
    add_column_sums<float>(args.q.column_sums, args.x, c);
  }
}

void CpuBackend::execute(const op::CastAmax& args) {
  ops::check("cast_amax", args);
  const Ctx c = make_ctx(options_, DType::f32);
  Tensor x = args.in.x;
  std::vector<float> produced;  // the fused op's output, as quantize_fused produces it
  if (args.in.op != CastInput::Op::identity || args.in.head.defined()) {
    produced.resize(static_cast<size_t>(x.rows() * args.in.cols()));
    x = Tensor(produced.data(), DType::f32, args.in.shape());
    produce(x, args.in);
  }
  const std::vector<float> xr = gather(x, false, c);
  *args.amax.ptr<float>() = tensor_amax(xr.data(), static_cast<int64_t>(xr.size()));
}

void CpuBackend::execute(const op::TransposeCodes& args) {
  ops::check("transpose_codes", args);
  for (int64_t r = 0; r < args.src.rows; ++r)
    for (int64_t c = 0; c < args.src.cols; ++c)
      args.dst.codes[c * args.src.rows + r] = args.src.codes[r * args.src.cols + c];
  args.dst.scale_inv[0] = args.src.scale_inv[0];
}

void CpuBackend::execute(const op::DelayedScalingUpdate& args) {
  const auto d = ops::check("delayed_scaling_update", args);
  delayed_update_all(args.amax_history.ptr<float>(), static_cast<int>(d.n), static_cast<int>(d.L),
                     args.fp8_max.ptr<float>(), args.algo, args.margin, args.scale.ptr<float>(),
                     args.scale_inv.ptr<float>());
}

// fp32 sums whatever `sum` asks: the CPU has no faster, less precise accumulation to offer.
void CpuBackend::execute(const op::GemmFp8Tn& args) {
  constexpr std::string_view op = "gemm_fp8_tn";
  require_defined(op, {"c", args.c});
  if (args.c.dtype != DType::f32) fail("{}: output {} must be f32", op, args.c.str());
  if (!args.a.defined() || !args.b.defined() || args.a.cols != args.b.cols || args.c.rows() != args.a.rows ||
      args.c.cols() != args.b.rows)
    fail("{}: c {} = a [{}, {}] · b [{}, {}]ᵀ does not fit", op, args.c.str(), args.a.rows, args.a.cols, args.b.rows,
         args.b.cols);
  if (args.bias.defined() && (args.bias.numel() != args.b.rows || args.bias.dtype != DType::f32))
    fail("{}: bias {} must be f32[{}]", op, args.bias.str(), args.b.rows);
  const Ctx ctx = make_ctx(options_, DType::f32);
  const std::vector<float> A = dequantize_view(args.a, ctx), B = dequantize_view(args.b, ctx);
  const int64_t m = args.a.rows, n = args.b.rows, k = args.a.cols;
  parallel_gemm<float>(ctx, false, true, m, n, k, 1.0f, A.data(), k, B.data(), k, args.accumulate ? 1.0f : 0.0f,
                       args.c.ptr<float>(), args.c.ld);
  if (args.bias.defined() || ctx.round_bf16)
    parallel_for(m, ctx, [&](int64_t r) {
      float* cr = row<float>(args.c, r);
      for (int64_t j = 0; j < n; ++j)
        cr[j] = act<float>(args.bias.defined() ? cr[j] + args.bias.ptr<float>()[j] : cr[j], ctx);
    });
}

}  // namespace flux8

#include "model/linear_site.h"

#include <algorithm>
#include <exception>

#include "core/error.h"
#include "fp8/recipe.h"
#include "model/fp8_runtime.h"

namespace flux8 {

LinearSite LinearSite::bind(ParamStore& store, const std::string& prefix) {
  LinearSite s;
  s.name = prefix;
  s.store = &store;
  s.w = store.param(prefix + ".weight");
  s.dw = store.grad(prefix + ".weight");
  if (const ParamShard& w = store.layout().at(prefix + ".weight").shard; w.sharded()) s.split = w.split;
  if (store.layout().find(prefix + ".bias")) {
    s.b = store.param(prefix + ".bias");
    s.db = store.grad(prefix + ".bias");
    const ParamShard& w = store.layout().at(prefix + ".weight").shard;
    s.bias_in_forward = !(w.sharded() && w.split == ShardSplit::cols && w.rank != 0);
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

bool wgrad_in_fp8(const LinearSite& site, const Fp8Runtime* fp8) { return site.fp8 && fp8 && fp8->config().wgrad; }

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
    Backend::CastInput stored;
    stored.x = saved.full;
    be.quantize(x_row, saved.cast_t, saved.full, fp8.cast_args(site, Operand::input, stored));
    return x_row;
  }
  if (in.op == Backend::CastInput::Op::identity && !in.head.defined()) {  // a plain cast (the profiler's "quantize")
    be.quantize(x_row, saved.cast_t, in.x, fp8.cast_args(site, Operand::input, in));
    return x_row;
  }
  // The row statistics, kept for the backward (unless the gated residual before wrote them).
  if (in.op == Backend::CastInput::Op::layernorm_modulate && !in.statistics_ready)
    be.layernorm_modulate(Tensor{}, in.mean, in.rstd, in.x, in.shift, in.scale, in.eps);
  be.quantize_fused(x_row, saved.cast_t, in, fp8.cast_args(site, Operand::input, in));
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
  Backend::Quantize q = fp8.cast_args(site, Operand::grad_output, dy);
  q.column_sums = site.db;  // the bias gradient, summed in the pass that casts dy
  q.column_sums_accumulate = accumulate;
  be.quantize_fused(dy_row, dy_col, dy, q);
  if (dx.defined())
    be.gemm_fp8_tn(dx, dy_row, fp8.dgrad_weight(site), Tensor{}, accumulate_dx, Fp8Accumulation::fp32);  // dgrad
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

void site_backward_gelu(Backend& be, Fp8Runtime* fp8, LinearSite& site, Tensor dx, Tensor dh, Tensor gelu_h, Tensor dy,
                        const SavedLinearInput& saved) {
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

Fp8Format operand_format(const Fp8Config& fp8, Operand o) {
  return o == Operand::grad_output && fp8.hybrid ? Fp8Format::e5m2 : Fp8Format::e4m3;
}

Fp8Scaling operand_scaling(const Fp8Config& fp8, Operand o) {
  switch (fp8.recipe) {
    case Fp8Recipe::delayed:
    case Fp8Recipe::tensorwise: return Fp8Scaling::per_tensor;
    case Fp8Recipe::blockwise: return o == Operand::weight ? Fp8Scaling::block_128x128 : Fp8Scaling::block_1x128;
    case Fp8Recipe::mxfp8: return Fp8Scaling::mx_1x32;
  }
  return Fp8Scaling::per_tensor;
}

void plan_site_forward(Arena& scratch, const Fp8Config* fp8, int64_t rows, int64_t in_cols) {
  if (!fp8 || !fp8->enabled) return;
  const size_t mark = scratch.mark();
  allocate_qtensor(scratch, rows, in_cols, operand_format(*fp8, Operand::input), operand_scaling(*fp8, Operand::input),
                   SlotKind::workspace);
  scratch.release_to(mark);
}

void plan_site_backward(Arena& scratch, const Fp8Config* fp8, int64_t rows, int64_t out_cols) {
  if (!fp8 || !fp8->enabled) return;
  const size_t mark = scratch.mark();
  const Fp8Format f = operand_format(*fp8, Operand::grad_output);
  const Fp8Scaling sc = operand_scaling(*fp8, Operand::grad_output);
  allocate_qtensor(scratch, rows, out_cols, f, sc, SlotKind::workspace);
  if (fp8->wgrad) allocate_qtensor(scratch, out_cols, rows, f, sc, SlotKind::workspace);
  scratch.release_to(mark);
}

}  // namespace flux8

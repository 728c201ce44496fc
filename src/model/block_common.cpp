#include "model/block_common.h"

namespace flux8 {

ScaleParam ScaleParam::bind(ParamStore& store, const std::string& name) {
  return {store.device_param(name), store.grad(name), &store};
}

void bind_qk_norm(ParamStore& store, const std::string& attn, ScaleParam& q_norm, ScaleParam& k_norm) {
  q_norm = ScaleParam::bind(store, attn + "norm.query_norm.scale");
  k_norm = ScaleParam::bind(store, attn + "norm.key_norm.scale");
}

void allocate_heads_qkv(Arena& a, const BlockWidths& w, StepShape sh, DType heads, SlotKind kind, Tensor& q, Tensor& k,
                        Tensor& v) {
  const Shape shape = heads_shape(w, sh);
  q = a.alloc(heads, shape, kind);
  k = a.alloc(heads, shape, kind);
  v = a.alloc(heads, shape, kind);
}

SavedLinearInput recompute_linear_input(Backend& be, Fp8Runtime* fp8, Arena& scratch, const LinearSite& site,
                                        Tensor x) {
  SavedLinearInput s;
  if (!wgrad_in_fp8(site, fp8)) {
    s.full = x;
    return s;
  }
  s.cast_t = allocate_qtensor(scratch, x.cols(), x.rows(), fp8->format(Operand::input), fp8->scaling(Operand::input),
                              SlotKind::workspace);
  const NoFp8Recording quiet(fp8);
  Backend::CastInput in;
  in.x = x;
  be.quantize(QTensor{}, s.cast_t, x, fp8->cast_args(site, Operand::input, in));
  return s;
}

SavedLinearInput forward_linear_input(Arena& scratch, const LinearSite& site, const Fp8Runtime* fp8,
                                      const SavedLinearInput& kept, Shape shape, DType dtype) {
  if (kept.full.defined() || kept.cast_t.defined()) return kept;
  SavedLinearInput s;
  if (!wgrad_in_fp8(site, fp8)) s.full = scratch.alloc(dtype, shape, SlotKind::workspace);
  return s;
}

SavedLinearInput recompute_linear_input_of(Backend& be, Fp8Runtime* fp8, Arena& scratch, const LinearSite& site,
                                           const Backend::CastInput& in, DType dtype) {
  SavedLinearInput s;
  if (!wgrad_in_fp8(site, fp8)) {
    s.full = scratch.alloc(dtype, in.shape(), SlotKind::workspace);
    be.produce(s.full, in);
    return s;
  }
  s.cast_t = allocate_qtensor(scratch, in.cols(), in.x.rows(), fp8->format(Operand::input),
                              fp8->scaling(Operand::input), SlotKind::workspace);
  const NoFp8Recording quiet(fp8);
  be.quantize_fused(QTensor{}, s.cast_t, in, fp8->cast_args(site, Operand::input, in));
  return s;
}

void plan_recompute_linear_input(Arena& scratch, const Fp8Config* fp8, int64_t rows, int64_t cols) {
  if (!fp8 || !fp8->enabled || !fp8->wgrad) return;
  allocate_qtensor(scratch, cols, rows, operand_format(*fp8, Operand::input), operand_scaling(*fp8, Operand::input),
                   SlotKind::workspace);
}

BlockScratchPlan::BlockScratchPlan(Arena& arena, const BlockWidths& widths, StepShape shape, DType t,
                                   const Fp8Config* f, int64_t token_rows)
    : a(arena),
      fp8(f),
      modulation(f && f->modulation ? f : nullptr),
      fp8_sites(f != nullptr),
      wgrad8(f && f->wgrad),
      attention8(f && f->dot_product_attention),
      rows(token_rows),
      dtype(t),
      heads(heads_shape(widths, shape)) {}

void BlockScratchPlan::head_tensors(int n) const {
  for (int i = 0; i < n; ++i) a.alloc(dtype, heads, SlotKind::workspace);
}

void BlockScratchPlan::recomputed_input(int64_t cols) const {
  if (wgrad8)
    plan_recompute_linear_input(a, fp8, rows, cols);
  else
    tokens(cols);
}

}  // namespace flux8

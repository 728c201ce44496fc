// The attention inputs of one stream: QK-norm, RoPE and the head-major layout as one op per
// direction. The CUDA backend does each in one pass; here each is the unfused chain the model
// ran before (rmsnorm_heads → tokens_to_heads → rope, and back), through the same code, so the
// fused op and that chain agree bit for bit. The one difference is where RoPE runs: per stream,
// on its rows of the joint tensors at joint positions offset + l, instead of once over the
// joint sequence; the arithmetic of every row is the same (rotate_pairs).
#include <tuple>
#include <vector>

#include "backend/cpu/common.h"
#include "backend/cpu/cpu_backend.h"

namespace flux8 {
using namespace cpu;

namespace {

// Moves one stream between token rows and its head rows of the joint sequence, rotating on the
// way: to_heads: heads[b, h, offset + l] = rope(tokens[b, l, h·D : (h+1)·D]); else
// tokens[b, l, h·D : (h+1)·D] = rope⁻¹(heads[b, h, offset + l]). A task per head row.
template <typename T>
void rotate_between(const Tensor& heads, const Tensor& tokens, const Tensor& pe, int64_t offset, bool to_heads,
                    const Ctx& c) {
  const int64_t L = heads.shape[2], D = heads.shape[3];
  for_each_head_row<T>(heads, tokens, offset, c, [&](T* hr, T* tr, int64_t b, int64_t l) {
    const T* cs = pe.ptr<T>() + (b * L + offset + l) * D;
    if (to_heads)
      rotate_pairs<T>(hr, tr, cs, D, false, c);
    else
      rotate_pairs<T>(tr, hr, cs, D, true, c);
  });
}

}  // namespace

void CpuBackend::execute(const op::QkNormRopeToHeads& args) {
  constexpr std::string_view op = "qk_norm_rope_to_heads";
  const auto [t, c] = begin_call(options_, args);
  const auto d = ops::check(op, args);
  dispatch(t, [&]<typename T>(T) {
    // The normalised stream in token layout, and statistics nobody asked to keep.
    std::vector<T> normed(static_cast<size_t>(d.B * d.Ls * d.n * d.D)), unkept;
    const Tensor normed_t(normed.data(), t, args.q.shape);
    for (auto [heads, rstd, x, scale] : {std::tuple{args.q_heads, args.q_rstd, args.q, args.q_scale},
                                         std::tuple{args.k_heads, args.k_rstd, args.k, args.k_scale}}) {
      if (!rstd.defined()) {
        unkept.resize(static_cast<size_t>(d.B * d.Ls * d.n));
        rstd = Tensor(unkept.data(), t, Shape{d.B * d.Ls * d.n});
      }
      rmsnorm_heads(normed_t, rstd, x, scale, args.eps);
      rotate_between<T>(heads, normed_t, args.pe, args.token_offset, true, c);
    }
  });
  tokens_to_heads(args.v_heads, args.v, args.token_offset);
}

void CpuBackend::execute(const op::QkNormRopeToHeadsBackward& args) {
  constexpr std::string_view op = "qk_norm_rope_to_heads_backward";
  const auto [t, c] = begin_call(options_, args);
  const auto d = ops::check(op, args);
  dispatch(t, [&]<typename T>(T) {
    // The gradient w.r.t. the normalised (unrotated) stream, in token layout: rmsnorm_heads'
    // dy, which its backward reads for dx and again for dscale.
    std::vector<T> dnormed(static_cast<size_t>(d.B * d.Ls * d.n * d.D));
    const Tensor dnormed_t(dnormed.data(), t, args.q.shape);
    for (auto [dx, dscale, dheads, x, rstd, scale] :
         {std::tuple{args.dq, args.dq_scale, args.dq_heads, args.q, args.q_rstd, args.q_scale},
          std::tuple{args.dk, args.dk_scale, args.dk_heads, args.k, args.k_rstd, args.k_scale}}) {
      if (!dx.defined() && !dscale.defined()) continue;
      rotate_between<T>(dheads, dnormed_t, args.pe, args.token_offset, false, c);
      rmsnorm_heads_backward(dx, dscale, dnormed_t, x, rstd, scale);
    }
  });
  if (args.dv.defined()) heads_to_tokens(args.dv, args.dv_heads, args.token_offset);
}

}  // namespace flux8

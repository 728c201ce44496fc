// Pure data movement between token-major and head-major layouts and along the sequence.
// The outputs are activations, so bf16 emulation rounds them (a no-op for values that were
// already bf16, which is what the GPU would hold).
#include "backend/cpu/common.h"
#include "backend/cpu/cpu_backend.h"

namespace flux8 {
using namespace cpu;

namespace {

// Moves between tokens[b, l, h·D : (h+1)·D] and heads[b, h, offset + l, :]; parallel over
// (b, h, l), each task owning one destination row segment.
template <typename T>
void move_heads(const Tensor& heads, const Tensor& tokens, int64_t offset, bool to_heads, const Ctx& c) {
  const int64_t D = heads.shape[3];
  for_each_head_row<T>(heads, tokens, offset, c, [&](T* hr, T* tr, int64_t, int64_t) {
    T* dst = to_heads ? hr : tr;
    const T* src = to_heads ? tr : hr;
    for (int64_t d = 0; d < D; ++d) dst[d] = act<T>(src[d], c);
  });
}

// out[b, offset + l, :] <-> part[b, l, :] for l < part's length.
template <typename T>
void move_tokens(const Tensor& joint, const Tensor& part, int64_t offset, bool to_joint, const Ctx& c) {
  const int64_t B = joint.shape[0], L = joint.shape[1], C = joint.shape[2], Lp = part.shape[1];
  parallel_for(B * Lp, c, [&](int64_t i) {
    const int64_t b = i / Lp, l = i % Lp;
    T* jr = row<T>(joint, b * L + offset + l);
    T* pr = row<T>(part, b * Lp + l);
    T* dst = to_joint ? jr : pr;
    const T* src = to_joint ? pr : jr;
    for (int64_t j = 0; j < C; ++j) dst[j] = act<T>(src[j], c);
  });
}

}  // namespace

void CpuBackend::execute(const op::TokensToHeads& args) {
  const auto [t, c] = begin_call(options_, args);
  ops::check("tokens_to_heads", args);
  dispatch(t, [&]<typename T>(T) { move_heads<T>(args.heads, args.tokens, args.token_offset, true, c); });
}

void CpuBackend::execute(const op::HeadsToTokens& args) {
  const auto [t, c] = begin_call(options_, args);
  ops::check("heads_to_tokens", args);
  dispatch(t, [&]<typename T>(T) { move_heads<T>(args.heads, args.tokens, args.token_offset, false, c); });
}

void CpuBackend::execute(const op::ConcatTokens& args) {
  const auto [t, c] = begin_call(options_, args);
  require_defined("concat_tokens", {"a", args.a});
  require_defined("concat_tokens", {"b", args.b});
  ops::check("concat_tokens", args);
  dispatch(t, [&]<typename T>(T) {
    move_tokens<T>(args.out, args.a, 0, true, c);
    move_tokens<T>(args.out, args.b, args.a.shape[1], true, c);
  });
}

void CpuBackend::execute(const op::SplitTokens& args) {
  const auto [t, c] = begin_call(options_, args);
  ops::check("split_tokens", args);
  // b is the tail of the sequence: with a undefined, its offset is what b does not cover.
  const int64_t b_offset = args.in.shape[1] - (args.b.defined() ? args.b.shape[1] : 0);
  dispatch(t, [&]<typename T>(T) {
    if (args.a.defined()) move_tokens<T>(args.in, args.a, 0, false, c);
    if (args.b.defined()) move_tokens<T>(args.in, args.b, b_offset, false, c);
  });
}

}  // namespace flux8

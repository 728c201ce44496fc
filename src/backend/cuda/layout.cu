// Data movement and the small per-token ops on the device: token-major <-> head-major layout,
// the joint text+image sequence, gated residuals, RoPE and the sinusoidal timestep embedding.
// Same semantics and checks as the CPU files layout.cpp, elementwise.cpp, rope.cpp and
// embedding.cpp; tables (RoPE, timestep) are evaluated in double like the CPU backend. Tokens,
// the joint sequence, residuals and the embedding may be bf16 activations (Backend::
// activation_dtype); RoPE stays f32.
#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>

#include "backend/cuda/common.cuh"
#include "backend/cuda/fp8_heads.cuh"

namespace flux8 {
using namespace cuda;

namespace {

using bf16 = __nv_bfloat16;

// Data movement: the same type moves its bits (bf16 NaN payloads too), f32 -> bf16 rounds to
// nearest even and bf16 -> f32 widens exactly.
template <typename To, typename From>
__device__ inline void move4(To* dst, const From* src) {
  if constexpr (std::is_same_v<To, From>) {
    using Raw = std::conditional_t<sizeof(To) == 4, float4, uint2>;
    *reinterpret_cast<Raw*>(dst) = *reinterpret_cast<const Raw*>(src);
  } else {
    store4(dst, load4(src));
  }
}
// Eight elements: one 16-byte access of bf16 (the activations' type), two of f32. With 8 bytes a
// thread the layout kernels stay well below HBM bandwidth; the gated residual and the LayerNorm
// forward are not limited by their access width and keep groups of 4 (docs/PERFORMANCE.md,
// Measurements behind the kernels).
template <typename To, typename From>
__device__ inline void move8(To* dst, const From* src) {
  if constexpr (std::is_same_v<To, From> && sizeof(To) == 2) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  } else if constexpr (std::is_same_v<To, From>) {
    move4(dst, src);
    move4(dst + 4, src + 4);
  } else {
    float v[8];
    load8(src, v);
    store8(dst, v);
  }
}
template <typename To, typename From>
__device__ inline void move1(To& dst, const From& src) {
  if constexpr (std::is_same_v<To, From>)
    dst = src;
  else
    store(dst, load(src));
}

// W consecutive elements: move4 or move8.
template <int W, typename To, typename From>
__device__ inline void move_group(To* dst, const From* src) {
  if constexpr (W == 8) {
    move8(dst, src);
  } else {
    static_assert(W == 4, "groups of 4 or 8 elements");
    move4(dst, src);
  }
}

// move_heads in groups of W elements (every row of both sides aligned to W): a thread per group.
template <int W, typename TT, typename HT>
void move_head_groups(CudaBackend& be, MatOf<HT> H, MatOf<TT> T, int64_t rows, int64_t n, int64_t L, int64_t D,
                      int64_t Ls, int64_t offset, FastDivisor per_sample, bool to_heads) {
  const int Dw = static_cast<int>(D / W);
  for_each_row(be, rows, n * Dw, [=] __device__(int64_t r, int cw) {
    const int64_t b = per_sample.divide(static_cast<uint32_t>(r)), l = r - b * Ls;
    const int h = cw / Dw, d = (cw - h * Dw) * W;
    HT* hv = &H.at((b * n + h) * L + offset + l, d);
    TT* tv = &T.at(r, h * D + d);
    if (to_heads)
      move_group<W>(hv, tv);
    else
      move_group<W>(tv, hv);
  });
}

// move_tokens in groups of W elements (every row of both sides aligned to W).
template <int W, typename T>
void move_token_groups(CudaBackend& be, MatOf<T> J, MatOf<T> P, int64_t rows, int64_t L, int64_t C, int64_t Lp,
                       int64_t offset, FastDivisor per_sample, bool to_joint) {
  for_each_row(be, rows, C / W, [=] __device__(int64_t r, int jw) {
    const int64_t b = per_sample.divide(static_cast<uint32_t>(r)), l = r - b * Lp;
    T* jv = &J.at(b * L + offset + l, W * jw);
    T* pv = &P.at(r, W * jw);
    if (to_joint)
      move_group<W>(jv, pv);
    else
      move_group<W>(pv, jv);
  });
}

// Token rows of type TT <-> heads of type HT (f32/f32, f32 tokens with bf16 heads:
// Backend::attention_heads_dtype, or bf16/bf16: bf16 activations); 8 or 4 elements a thread
// where both sides are aligned for it.
template <typename TT, typename HT>
void move_heads(CudaBackend& be, const Tensor& heads, const Tensor& tokens, int64_t offset, bool to_heads) {
  const int64_t n = heads.shape[1], L = heads.shape[2], D = heads.shape[3];
  const int64_t Ls = tokens.shape[1];
  const FastDivisor per_sample = row_divisor("tokens_to_heads / heads_to_tokens", heads.shape[0] * Ls, Ls);
  const MatOf<HT> H = mat_of<HT>(heads);
  const MatOf<TT> T = mat_of<TT>(tokens);
  const int64_t rows = heads.shape[0] * Ls;
  // D % 8 == 0 or D % 4 == 0 (H's columns) where every row on both sides is aligned to it.
  if (vec8_rows(H) && vec8_rows(T))
    return move_head_groups<8>(be, H, T, rows, n, L, D, Ls, offset, per_sample, to_heads);
  if (vec4_rows(H) && vec4_rows(T))
    return move_head_groups<4>(be, H, T, rows, n, L, D, Ls, offset, per_sample, to_heads);
  // A thread per element of a token row (all heads of one token); consecutive threads walk d,
  // so both sides are read/written in runs of D.
  const int Di = static_cast<int>(D);
  for_each_row(be, rows, n * D, [=] __device__(int64_t r, int c) {
    const int64_t b = per_sample.divide(static_cast<uint32_t>(r)), l = r - b * Ls;
    const int h = c / Di, d = c - h * Di;
    HT& hv = H.at((b * n + h) * L + offset + l, d);
    TT& tv = T.at(r, c);
    if (to_heads)
      move1(hv, tv);
    else
      move1(tv, hv);
  });
}

// Checks the storage types of tokens_to_heads / heads_to_tokens and moves: heads f32 or bf16
// (attention_heads_dtype), tokens f32 or bf16 (activations), bf16 tokens with bf16 heads only
// (attention never runs on f32 heads when the activations are bf16; rounding on the way back
// would not be a layout change).
void heads_tokens(CudaBackend& be, std::string_view op, const Tensor& heads, const Tensor& tokens, int64_t offset,
                  bool to_heads) {
  const bool tokens_bf16 = activations_in_bf16(op, {{"tokens", tokens}});
  const bool h_bf16 = heads_in_bf16(op, {{"heads", heads}});
  if (tokens_bf16 && !h_bf16)
    fail("{}: tokens {} are bf16 but heads {} are f32: bf16 activations need bf16 heads", op, tokens.str(),
         heads.str());
  ops::check_heads_tokens(op, heads, tokens, offset);
  if (tokens_bf16)
    move_heads<bf16, bf16>(be, heads, tokens, offset, to_heads);
  else if (h_bf16)
    move_heads<float, bf16>(be, heads, tokens, offset, to_heads);
  else
    move_heads<float, float>(be, heads, tokens, offset, to_heads);
}

template <typename T>
void move_tokens(CudaBackend& be, const Tensor& joint, const Tensor& part, int64_t offset, bool to_joint) {
  const int64_t L = joint.shape[1], C = joint.shape[2], Lp = part.shape[1];
  const MatOf<T> J = mat_of<T>(joint), P = mat_of<T>(part);
  const FastDivisor per_sample = row_divisor("concat_tokens / split_tokens", part.shape[0] * Lp, Lp);
  const int64_t rows = part.shape[0] * Lp;
  if (vec8_rows(J) && vec8_rows(P)) return move_token_groups<8>(be, J, P, rows, L, C, Lp, offset, per_sample, to_joint);
  if (vec4_rows(J) && vec4_rows(P)) return move_token_groups<4>(be, J, P, rows, L, C, Lp, offset, per_sample, to_joint);
  for_each_row(be, rows, C, [=] __device__(int64_t r, int j) {
    const int64_t b = per_sample.divide(static_cast<uint32_t>(r)), l = r - b * Lp;
    T& jv = J.at(b * L + offset + l, j);
    T& pv = P.at(r, j);
    if (to_joint)
      jv = pv;
    else
      pv = jv;
  });
}

// out = x + gate[b] ⊙ y; out may be x (each element is read and written by one thread). One
// fused multiply-add an element, as gated_residual_stats (norms.cu) computes it.
template <typename T>
void gated_residual_as(CudaBackend& be, std::string_view op, const op::GatedResidual& a) {
  const int64_t L = a.x.shape[1], H = a.x.shape[2];
  const MatOf<T> O = mat_of<T>(a.out), X = mat_of<T>(a.x), Y = mat_of<T>(a.y), G = mat_of<T>(a.gate);
  const FastDivisor per_sample = row_divisor(op, a.x.rows(), L);
  if (vec4_rows(O) && vec4_rows(X) && vec4_rows(Y) && vec4_rows(G)) {  // 16-byte (f32) / 8-byte (bf16) accesses
    for_each_row(be, a.x.rows(), H / 4, [=] __device__(int64_t r, int q) {
      const float4 g = load4(&G.at(per_sample.divide(static_cast<uint32_t>(r)), 4 * q)), yv = load4(&Y.at(r, 4 * q));
      const float4 xv = load4(&X.at(r, 4 * q));
      store4(&O.at(r, 4 * q), make_float4(__fmaf_rn(g.x, yv.x, xv.x), __fmaf_rn(g.y, yv.y, xv.y),
                                          __fmaf_rn(g.z, yv.z, xv.z), __fmaf_rn(g.w, yv.w, xv.w)));
    });
    return;
  }
  for_each_row(be, a.x.rows(), H, [=] __device__(int64_t r, int j) {
    O.set(r, j, __fmaf_rn(G.get(per_sample.divide(static_cast<uint32_t>(r)), j), Y.get(r, j), X.get(r, j)));
  });
}

template <typename T>
void gated_residual_backward_as(CudaBackend& be, std::string_view op, const op::GatedResidualBackward& a) {
  const int64_t B = a.dx.shape[0], L = a.dx.shape[1], H = a.dx.shape[2];
  const MatOf<T> DX = mat_of<T>(a.dx);
  MatOf<T> DY{}, G{};
  if (a.dy.defined()) DY = mat_of<T>(a.dy), G = mat_of<T>(a.gate);
  if (a.dgate.defined()) {
    // One pass: the column-sum walk over (sample, row, column) also writes dy, so dx is read
    // once (column_sums visits every element exactly once).
    const MatOf<T> Y = mat_of<T>(a.y);
    if (vec4_rows(DX) && vec4_rows(Y) && (!DY.p || (vec4_rows(DY) && vec4_rows(G)))) {
      column_sums4(
          be, B, L, H,
          [=] __device__(int64_t b, int64_t l, int64_t j) {
            const int64_t r = b * L + l;
            const float4 d = load4(&DX.at(r, j)), yv = load4(&Y.at(r, j));
            if (DY.p) {
              const float4 g = load4(&G.at(b, j));
              store4(&DY.at(r, j), make_float4(g.x * d.x, g.y * d.y, g.z * d.z, g.w * d.w));
            }
            return make_float4(d.x * yv.x, d.y * yv.y, d.z * yv.z, d.w * yv.w);
          },
          a.dgate.ptr<T>(), a.dgate.ld, false);
      return;
    }
    column_sums(
        be, B, L, H,
        [=] __device__(int64_t b, int64_t l, int64_t j) {
          const float d = DX.get(b * L + l, j);
          if (DY.p) DY.set(b * L + l, j, G.get(b, j) * d);
          return d * Y.get(b * L + l, j);  // summed in f32 over a thread's 32 rows
        },
        a.dgate.ptr<T>(), a.dgate.ld, false);
  } else if (DY.p) {
    const FastDivisor per_sample = row_divisor(op, B * L, L);
    for_each_row(be, B * L, H, [=] __device__(int64_t r, int j) {
      DY.set(r, j, G.get(per_sample.divide(static_cast<uint32_t>(r)), j) * DX.get(r, j));
    });
  }
}

template <typename T>
void timestep_embedding_as(CudaBackend& be, const Tensor& out, const Tensor& t, double time_factor, double max_period) {
  const int64_t B = out.shape[0], dim = out.shape[1], half = dim / 2;
  const MatOf<T> O = mat_of<T>(out);
  const float* tv = t.ptr<float>();
  const double neg_log_period = -log(max_period);
  for_each(be, B * dim, [=] __device__(int64_t i) {
    const int64_t b = i / dim, j = i % dim;
    if (j >= 2 * half) {  // odd widths are zero-padded, as in the reference
      O.set(b, j, 0.0f);
      return;
    }
    const int64_t k = j < half ? j : j - half;
    const double arg = time_factor * static_cast<double>(tv[b]) *
                       exp(neg_log_period * static_cast<double>(k) / static_cast<double>(half));
    O.set(b, j, static_cast<float>(j < half ? cos(arg) : sin(arg)));
  });
}

// ---- FP8 heads (tokens_to_heads_fp8, heads_to_tokens_fp8) -----------------------------------
// A thread per 8 elements of a token row, as move_head_groups<8>, with the heads side FP8 codes
// (fp8_heads.cuh): written as the cast of the values the plain op would store in the heads' type
// H (a block's amax by an atomic, or with counts its partial), or read as dequantize() into H
// gives them.
struct HeadGroups {
  FastDivisor groups_per_row, per_sample;  // n·D/8 per token row; Ls rows per sample
  int64_t n, L, Ls, D, offset, groups;
  int Dw;  // D / 8
  // Group g: token row r and column c (a multiple of 8), and the flat index of its first code.
  __device__ void locate(int64_t g, int64_t& r, int& c, int64_t& code) const {
    r = groups_per_row.divide(static_cast<uint32_t>(g));
    const int cw = static_cast<int>(g - r * groups_per_row.divisor());
    const int64_t b = per_sample.divide(static_cast<uint32_t>(r)), l = r - b * Ls;
    const int h = cw / Dw;
    c = 8 * cw;
    code = ((b * n + h) * L + offset + l) * D + (c - h * D);
  }
};

template <typename TT, typename H, bool kCount>
__global__ void tokens_to_fp8_heads_kernel(MatOf<TT> tokens, HeadGroups hg, Fp8HeadsOut out) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const float s = *out.scale;
  if (blockIdx.x == 0 && threadIdx.x == 0) *out.scale_inv = scale_inverse(s);
  CastTally<kCount> tally;
  if (g < hg.groups) {  // no return: the block reduces below
    int64_t r, code;
    int c;
    hg.locate(g, r, c, code);
    float v[8];
    load8(&tokens.at(r, c), v);
    store8_fp8<H>(out, code, v, s, tally);
  }
  out.finish_block(tally);
}

template <typename TT, typename H>
__global__ void fp8_heads_to_tokens_kernel(MatOf<TT> tokens, HeadGroups hg, Fp8HeadsIn in) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= hg.groups) return;
  int64_t r, code;
  int c;
  hg.locate(g, r, c, code);
  float v[8];
  load8_dequantized<H>(in, code, v);
  store8(&tokens.at(r, c), v);
}

// The geometry of one stream's FP8-heads move, or nothing where the fused kernels do not apply
// (head dim not a multiple of 8, codes or token rows not aligned to 8 elements, an empty call,
// or more groups than 32-bit indexing takes): the caller then takes the default.
template <typename TT>
std::optional<HeadGroups> head_groups(const Tensor& tokens, const QTensor& codes, const Shape& h, int64_t offset) {
  const int64_t n = h[1], L = h[2], D = h[3], Ls = tokens.shape[1];
  const int64_t rows = h[0] * Ls, groups = rows * n * D / 8;
  if (D % 8 != 0 || !fp8_heads_vec8(codes) || !vec8_rows(mat_of<TT>(tokens)) || groups == 0 ||
      groups >= (int64_t(1) << 31))
    return std::nullopt;
  return HeadGroups{FastDivisor(static_cast<uint32_t>(n * D / 8)),
                    FastDivisor(static_cast<uint32_t>(Ls)),
                    n,
                    L,
                    Ls,
                    D,
                    offset,
                    groups,
                    static_cast<int>(D / 8)};
}

// f.template operator()<TT, H>() for the tokens' type and the heads' (attention_heads_dtype).
template <typename F>
void with_token_head_types(std::string_view op, const Tensor& tokens, DType heads, F&& f) {
  const bool tokens_bf16 = activations_in_bf16(op, {{"tokens", tokens}});
  if (tokens_bf16 && heads != DType::bf16) fail("{}: bf16 tokens need bf16 heads", op);
  if (tokens_bf16)
    f.template operator()<bf16, bf16>();
  else if (heads == DType::bf16)
    f.template operator()<float, bf16>();
  else
    f.template operator()<float, float>();
}

}  // namespace

void CudaBackend::execute(const op::TokensToHeads& args) {
  heads_tokens(*this, "tokens_to_heads", args.heads, args.tokens, args.token_offset, true);
}

void CudaBackend::execute(const op::HeadsToTokens& args) {
  heads_tokens(*this, "heads_to_tokens", args.heads, args.tokens, args.token_offset, false);
}

void CudaBackend::execute(const op::TokensToHeadsFp8& args) {
  constexpr std::string_view op = "tokens_to_heads_fp8";
  const Shape h = ops::check(op, args);
  bool done = false;
  if (args.heads.q.scaling == Fp8Scaling::per_tensor && args.heads.q.delayed_scale) {
    with_token_head_types(
        op, args.tokens, attention_heads_dtype(args.tokens.dtype, h[3]), [&]<typename TT, typename H>() {
          const auto hg = head_groups<TT>(args.tokens, args.heads.codes, h, args.token_offset);
          if (!hg) return;
          const int64_t blocks = exact_blocks(hg->groups);
          const bool count = args.heads.q.stats != nullptr;
          auto* partials =
              count ? static_cast<StatsPartial*>(scratch(static_cast<size_t>(blocks) * sizeof(StatsPartial))) : nullptr;
          const Fp8HeadsOut out = fp8_heads_out(args.heads, count, partials);
          if (count)
            tokens_to_fp8_heads_kernel<TT, H, true>
                <<<static_cast<unsigned>(blocks), kThreads, 0, stream_>>>(mat_of<TT>(args.tokens), *hg, out);
          else
            tokens_to_fp8_heads_kernel<TT, H, false>
                <<<static_cast<unsigned>(blocks), kThreads, 0, stream_>>>(mat_of<TT>(args.tokens), *hg, out);
          FLUX8_LAUNCH_CHECK(tokens_to_fp8_heads_kernel);
          if (count) total_cast_stats(partials, blocks, hg->groups * 8, args.heads.q);  // else: the amax by atomics
          done = true;
        });
  }
  if (!done) Backend::execute(args);
}

void CudaBackend::execute(const op::HeadsToTokensFp8& args) {
  constexpr std::string_view op = "heads_to_tokens_fp8";
  const Shape h = ops::check(op, args);
  bool done = false;
  with_token_head_types(op, args.tokens, attention_heads_dtype(args.tokens.dtype, h[3]),
                        [&]<typename TT, typename H>() {
                          const auto hg = head_groups<TT>(args.tokens, args.heads, h, args.token_offset);
                          if (!hg) return;
                          fp8_heads_to_tokens_kernel<TT, H><<<exact_blocks(hg->groups), kThreads, 0, stream_>>>(
                              mat_of<TT>(args.tokens), *hg, fp8_heads_in(args.heads));
                          FLUX8_LAUNCH_CHECK(fp8_heads_to_tokens_kernel);
                          done = true;
                        });
  if (!done) Backend::execute(args);
}

void CudaBackend::execute(const op::ConcatTokens& args) {
  const bool bf = activations_in_bf16(args);
  require_defined("concat_tokens", {"a", args.a});
  require_defined("concat_tokens", {"b", args.b});
  ops::check("concat_tokens", args);
  if (bf) {
    move_tokens<bf16>(*this, args.out, args.a, 0, true);
    move_tokens<bf16>(*this, args.out, args.b, args.a.shape[1], true);
  } else {
    move_tokens<float>(*this, args.out, args.a, 0, true);
    move_tokens<float>(*this, args.out, args.b, args.a.shape[1], true);
  }
}

void CudaBackend::execute(const op::SplitTokens& args) {
  const bool bf = activations_in_bf16(args);
  ops::check("split_tokens", args);
  const int64_t b_offset = args.in.shape[1] - (args.b.defined() ? args.b.shape[1] : 0);
  for (const auto& [part, offset] : {std::pair{args.a, int64_t{0}}, std::pair{args.b, b_offset}}) {
    if (!part.defined()) continue;
    if (bf)
      move_tokens<bf16>(*this, args.in, part, offset, false);
    else
      move_tokens<float>(*this, args.in, part, offset, false);
  }
}

void CudaBackend::execute(const op::GatedResidual& args) {
  constexpr std::string_view op = "gated_residual";
  const bool bf = activations_in_bf16(args);
  ops::check(op, args);
  if (bf)
    gated_residual_as<bf16>(*this, op, args);
  else
    gated_residual_as<float>(*this, op, args);
}

void CudaBackend::execute(const op::GatedResidualBackward& args) {
  constexpr std::string_view op = "gated_residual_backward";
  const bool bf = activations_in_bf16(args);
  ops::check(op, args);
  if (bf)
    gated_residual_backward_as<bf16>(*this, op, args);
  else
    gated_residual_backward_as<float>(*this, op, args);
}

// ---- RoPE -------------------------------------------------------------------------------------

namespace {
constexpr int kMaxAxes = 8;
struct Axes {
  int count;
  int dim[kMaxAxes];
};
}  // namespace

void CudaBackend::execute(const op::RopeTable& args) {
  constexpr std::string_view op = "rope_table";
  require_f32(args);
  require_rank(op, {"ids", args.ids}, 3);
  const int64_t B = args.ids.shape[0], L = args.ids.shape[1];
  if (args.axes_dim.size() > kMaxAxes) fail("{}: at most {} position axes, got {}", op, kMaxAxes, args.axes_dim.size());
  Axes axes{static_cast<int>(args.axes_dim.size()), {}};
  int64_t pairs = 0;
  for (size_t i = 0; i < args.axes_dim.size(); ++i) {
    const int d = args.axes_dim[i];
    if (d <= 0 || d % 2 != 0) fail("{}: every axis width must be positive and even, got {}", op, d);
    axes.dim[i] = d;
    pairs += d / 2;
  }
  if (args.ids.shape[2] != static_cast<int64_t>(args.axes_dim.size()))
    fail("{}: ids {} must have one position per axis ({} axes)", op, args.ids.str(), args.axes_dim.size());
  require_shape(op, {"pe", args.pe}, Shape{B, L, pairs, 2});
  if (!args.pe.contiguous()) fail("{}: table 'pe' {} must be contiguous", op, args.pe.str());
  const Mat I = mat(args.ids);
  float* out = args.pe.ptr<float>();
  for_each(*this, B * L * pairs, [=] __device__(int64_t idx) {
    const int64_t r = idx / pairs;
    int p = static_cast<int>(idx % pairs), axis = 0;
    while (p >= axes.dim[axis] / 2) p -= axes.dim[axis++] / 2;
    const int d = axes.dim[axis];
    const double omega = 1.0 / pow(args.theta, 2.0 * p / d);
    const double angle = static_cast<double>(I.at(r, axis)) * omega;
    out[2 * idx] = static_cast<float>(cos(angle));
    out[2 * idx + 1] = static_cast<float>(sin(angle));
  });
}

void CudaBackend::execute(const op::Rope& args) {
  constexpr std::string_view op = "rope";
  require_f32(args);
  require_rank(op, {"x", args.x}, 4);
  const int64_t B = args.x.shape[0], n = args.x.shape[1], L = args.x.shape[2], D = args.x.shape[3];
  if (D % 2 != 0) fail("{}: head dim of x {} must be even", op, args.x.str());
  require_shape(op, {"pe", args.pe}, Shape{B, L, D / 2, 2});
  if (!args.pe.contiguous()) fail("{}: table 'pe' {} must be contiguous", op, args.pe.str());
  const Mat X = mat(args.x);
  const float* table = args.pe.ptr<float>();
  const int64_t half = D / 2;
  for_each_row(*this, B * n * L, half, [=] __device__(int64_t r, int p) {
    const int64_t b = r / (n * L), l = r % L;
    const float* cs = table + (b * L + l) * D;
    const float co = cs[2 * p], si = args.inverse ? -cs[2 * p + 1] : cs[2 * p + 1];
    const float x0 = X.at(r, 2 * p), x1 = X.at(r, 2 * p + 1);
    X.at(r, 2 * p) = co * x0 - si * x1;
    X.at(r, 2 * p + 1) = si * x0 + co * x1;
  });
}

void CudaBackend::execute(const op::TimestepEmbedding& args) {
  constexpr std::string_view op = "timestep_embedding";
  require_rank(op, {"out", args.out}, 2);
  const bool bf = activations_in_bf16(op, tensor_fields(args, {"out"}));
  require_vector(op, {"t", args.t}, args.out.shape[0]);
  require_f32(op, tensor_fields(args, {"t"}));  // t is an input of the model, not an activation
  if (bf)
    timestep_embedding_as<bf16>(*this, args.out, args.t, args.time_factor, args.max_period);
  else
    timestep_embedding_as<float>(*this, args.out, args.t, args.time_factor, args.max_period);
}

}  // namespace flux8

// Data movement and the small per-token ops on the device: token-major <-> head-major layout,
// the joint text+image sequence, gated residuals, RoPE and the sinusoidal timestep embedding.
// Same semantics and checks as the CPU files layout.cpp, elementwise.cpp, rope.cpp and
// embedding.cpp; tables (RoPE, timestep) are evaluated in double like the CPU backend.
#include <cstdint>

#include "backend/cuda/common.cuh"

namespace flux8 {
using namespace cuda;

namespace {

// bf16 heads (Backend::attention_heads_dtype) against f32 tokens: values rounded to nearest
// even on the way in, widened exactly on the way out; 4 elements a thread where aligned.
void move_heads_bf16(CudaBackend& be, const Tensor& heads, const Tensor& tokens, int64_t offset, bool to_heads,
                     const FastDivisor& per_sample) {
  const int64_t n = heads.shape[1], L = heads.shape[2], D = heads.shape[3], Ls = tokens.shape[1], hld = heads.ld;
  auto* hp = static_cast<__nv_bfloat16*>(heads.data);
  const Mat T = mat(tokens);
  if (D % 4 == 0 && hld % 4 == 0 && reinterpret_cast<uintptr_t>(hp) % 8 == 0 && quads(T)) {
    const int Dq = static_cast<int>(D / 4);
    for_each_row(be, heads.shape[0] * Ls, n * Dq, [=] __device__(int64_t r, int cq) {
      const int64_t b = per_sample.divide(static_cast<uint32_t>(r)), l = r - b * Ls;
      const int h = cq / Dq, d = (cq - h * Dq) * 4;
      auto* hv = reinterpret_cast<__nv_bfloat162*>(hp + ((b * n + h) * L + offset + l) * hld + d);
      float4& tv = quad(T, r, h * D + d);
      if (to_heads) {
        hv[0] = __floats2bfloat162_rn(tv.x, tv.y);
        hv[1] = __floats2bfloat162_rn(tv.z, tv.w);
      } else {
        const float2 a = __bfloat1622float2(hv[0]), c = __bfloat1622float2(hv[1]);
        tv = make_float4(a.x, a.y, c.x, c.y);
      }
    });
    return;
  }
  const int Di = static_cast<int>(D);
  for_each_row(be, heads.shape[0] * Ls, n * D, [=] __device__(int64_t r, int c) {
    const int64_t b = per_sample.divide(static_cast<uint32_t>(r)), l = r - b * Ls;
    const int h = c / Di, d = c - h * Di;
    __nv_bfloat16& hv = hp[((b * n + h) * L + offset + l) * hld + d];
    float& tv = T.at(r, c);
    if (to_heads) hv = __float2bfloat16_rn(tv); else tv = __bfloat162float(hv);
  });
}

void move_heads(CudaBackend& be, const Tensor& heads, const Tensor& tokens, int64_t offset, bool to_heads) {
  const int64_t n = heads.shape[1], L = heads.shape[2], D = heads.shape[3];
  const int64_t Ls = tokens.shape[1];
  const FastDivisor per_sample = row_divisor("tokens_to_heads / heads_to_tokens", heads.shape[0] * Ls, Ls);
  if (heads.dtype == DType::bf16) return move_heads_bf16(be, heads, tokens, offset, to_heads, per_sample);
  const Mat H = mat(heads), T = mat(tokens);
  if (D % 4 == 0 && quads(H) && quads(T)) {
    const int Dq = static_cast<int>(D / 4);
    for_each_row(be, heads.shape[0] * Ls, n * Dq, [=] __device__(int64_t r, int cq) {
      const int64_t b = per_sample.divide(static_cast<uint32_t>(r)), l = r - b * Ls;
      const int h = cq / Dq, d = (cq - h * Dq) * 4;
      float4& hv = quad(H, (b * n + h) * L + offset + l, d);
      float4& tv = quad(T, r, h * D + d);
      if (to_heads) hv = tv; else tv = hv;
    });
    return;
  }
  // A thread per element of a token row (all heads of one token); consecutive threads walk d,
  // so both sides are read/written in runs of D.
  const int Di = static_cast<int>(D);
  for_each_row(be, heads.shape[0] * Ls, n * D, [=] __device__(int64_t r, int c) {
    const int64_t b = per_sample.divide(static_cast<uint32_t>(r)), l = r - b * Ls;
    const int h = c / Di, d = c - h * Di;
    float& hv = H.at((b * n + h) * L + offset + l, d);
    float& tv = T.at(r, c);
    if (to_heads) hv = tv; else tv = hv;
  });
}

void move_tokens(CudaBackend& be, const Tensor& joint, const Tensor& part, int64_t offset, bool to_joint) {
  const int64_t L = joint.shape[1], C = joint.shape[2], Lp = part.shape[1];
  const Mat J = mat(joint), P = mat(part);
  const FastDivisor per_sample = row_divisor("concat_tokens / split_tokens", part.shape[0] * Lp, Lp);
  if (quads(J) && quads(P)) {
    for_each_row(be, part.shape[0] * Lp, C / 4, [=] __device__(int64_t r, int jq) {
      const int64_t b = per_sample.divide(static_cast<uint32_t>(r)), l = r - b * Lp;
      float4& jv = quad(J, b * L + offset + l, 4 * jq);
      float4& pv = quad(P, r, 4 * jq);
      if (to_joint) jv = pv; else pv = jv;
    });
    return;
  }
  for_each_row(be, part.shape[0] * Lp, C, [=] __device__(int64_t r, int j) {
    const int64_t b = per_sample.divide(static_cast<uint32_t>(r)), l = r - b * Lp;
    float& jv = J.at(b * L + offset + l, j);
    float& pv = P.at(r, j);
    if (to_joint) jv = pv; else pv = jv;
  });
}

}  // namespace

void CudaBackend::tokens_to_heads(Tensor heads, Tensor tokens, int64_t token_offset) {
  require_f32("tokens_to_heads", {{"tokens", tokens}});
  heads_in_bf16("tokens_to_heads", {{"heads", heads}});
  ops::check_heads_tokens("tokens_to_heads", heads, tokens, token_offset);
  move_heads(*this, heads, tokens, token_offset, true);
}

void CudaBackend::heads_to_tokens(Tensor tokens, Tensor heads, int64_t token_offset) {
  require_f32("heads_to_tokens", {{"tokens", tokens}});
  heads_in_bf16("heads_to_tokens", {{"heads", heads}});
  ops::check_heads_tokens("heads_to_tokens", heads, tokens, token_offset);
  move_heads(*this, heads, tokens, token_offset, false);
}

void CudaBackend::concat_tokens(Tensor out, Tensor a, Tensor b) {
  require_f32("concat_tokens", {{"out", out}, {"a", a}, {"b", b}});
  require_defined("concat_tokens", {"a", a});
  require_defined("concat_tokens", {"b", b});
  ops::check_joint("concat_tokens", {"out", out}, a, b);
  move_tokens(*this, out, a, 0, true);
  move_tokens(*this, out, b, a.shape[1], true);
}

void CudaBackend::split_tokens(Tensor a, Tensor b, Tensor in) {
  require_f32("split_tokens", {{"a", a}, {"b", b}, {"in", in}});
  ops::check_joint("split_tokens", {"in", in}, a, b);
  const int64_t b_offset = in.shape[1] - (b.defined() ? b.shape[1] : 0);
  if (a.defined()) move_tokens(*this, in, a, 0, false);
  if (b.defined()) move_tokens(*this, in, b, b_offset, false);
}

void CudaBackend::gated_residual(Tensor x, Tensor y, Tensor gate) {
  constexpr std::string_view op = "gated_residual";
  require_f32(op, {{"x", x}, {"y", y}, {"gate", gate}});
  require_rank(op, {"x", x}, 3);
  require_shape(op, {"y", y}, x.shape);
  require_shape(op, {"gate", gate}, Shape{x.shape[0], x.shape[2]});
  const int64_t L = x.shape[1], H = x.shape[2];
  const Mat X = mat(x), Y = mat(y), G = mat(gate);
  const FastDivisor per_sample = row_divisor(op, x.rows(), L);
  if (quads(X) && quads(Y) && quads(G)) {  // 16-byte loads and stores
    for_each_row(*this, x.rows(), H / 4, [=] __device__(int64_t r, int q) {
      const float4 g = quad(G, per_sample.divide(static_cast<uint32_t>(r)), 4 * q), yv = quad(Y, r, 4 * q);
      float4& xv = quad(X, r, 4 * q);
      xv = make_float4(xv.x + g.x * yv.x, xv.y + g.y * yv.y, xv.z + g.z * yv.z, xv.w + g.w * yv.w);
    });
    return;
  }
  for_each_row(*this, x.rows(), H, [=] __device__(int64_t r, int j) {
    X.at(r, j) = X.at(r, j) + G.at(per_sample.divide(static_cast<uint32_t>(r)), j) * Y.at(r, j);
  });
}

void CudaBackend::gated_residual_backward(Tensor dy, Tensor dgate, Tensor dx, Tensor y, Tensor gate) {
  constexpr std::string_view op = "gated_residual_backward";
  require_f32(op, {{"dy", dy}, {"dgate", dgate}, {"dx", dx}, {"y", y}, {"gate", gate}});
  require_rank(op, {"dx", dx}, 3);
  const int64_t B = dx.shape[0], L = dx.shape[1], H = dx.shape[2];
  const Mat DX = mat(dx);
  Mat DY{}, G{};
  if (dy.defined()) {
    require_shape(op, {"dy", dy}, dx.shape);
    require_shape(op, {"gate", gate}, Shape{B, H});
    DY = mat(dy), G = mat(gate);
  }
  if (dgate.defined()) {
    require_shape(op, {"y", y}, dx.shape);
    require_shape(op, {"dgate", dgate}, Shape{B, H});
    // One pass: the column-sum walk over (sample, row, column) also writes dy, so dx is read
    // once (column_sums visits every element exactly once).
    const Mat Y = mat(y);
    column_sums(
        *this, B, L, H,
        [=] __device__(int64_t b, int64_t l, int64_t j) {
          const float d = DX.at(b * L + l, j);
          if (DY.p) DY.at(b * L + l, j) = G.at(b, j) * d;
          return double(d) * Y.at(b * L + l, j);
        },
        dgate.ptr<float>(), dgate.ld, false);
  } else if (DY.p) {
    const FastDivisor per_sample = row_divisor(op, B * L, L);
    for_each_row(*this, B * L, H, [=] __device__(int64_t r, int j) {
      DY.at(r, j) = G.at(per_sample.divide(static_cast<uint32_t>(r)), j) * DX.at(r, j);
    });
  }
}

// ---- RoPE -------------------------------------------------------------------------------------

namespace {
constexpr int kMaxAxes = 8;
struct Axes {
  int count;
  int dim[kMaxAxes];
};
}  // namespace

void CudaBackend::rope_table(Tensor pe, Tensor ids, std::span<const int> axes_dim, double theta) {
  constexpr std::string_view op = "rope_table";
  require_f32(op, {{"pe", pe}, {"ids", ids}});
  require_rank(op, {"ids", ids}, 3);
  const int64_t B = ids.shape[0], L = ids.shape[1];
  if (axes_dim.size() > kMaxAxes) fail("{}: at most {} position axes, got {}", op, kMaxAxes, axes_dim.size());
  Axes axes{static_cast<int>(axes_dim.size()), {}};
  int64_t pairs = 0;
  for (size_t i = 0; i < axes_dim.size(); ++i) {
    const int d = axes_dim[i];
    if (d <= 0 || d % 2 != 0) fail("{}: every axis width must be positive and even, got {}", op, d);
    axes.dim[i] = d;
    pairs += d / 2;
  }
  if (ids.shape[2] != static_cast<int64_t>(axes_dim.size()))
    fail("{}: ids {} must have one position per axis ({} axes)", op, ids.str(), axes_dim.size());
  require_shape(op, {"pe", pe}, Shape{B, L, pairs, 2});
  if (!pe.contiguous()) fail("{}: table 'pe' {} must be contiguous", op, pe.str());
  const Mat I = mat(ids);
  float* out = pe.ptr<float>();
  for_each(*this, B * L * pairs, [=] __device__(int64_t idx) {
    const int64_t r = idx / pairs;
    int p = static_cast<int>(idx % pairs), axis = 0;
    while (p >= axes.dim[axis] / 2) p -= axes.dim[axis++] / 2;
    const int d = axes.dim[axis];
    const double omega = 1.0 / pow(theta, 2.0 * p / d);
    const double angle = static_cast<double>(I.at(r, axis)) * omega;
    out[2 * idx] = static_cast<float>(cos(angle));
    out[2 * idx + 1] = static_cast<float>(sin(angle));
  });
}

void CudaBackend::rope(Tensor x, Tensor pe, bool inverse) {
  constexpr std::string_view op = "rope";
  require_f32(op, {{"x", x}, {"pe", pe}});
  require_rank(op, {"x", x}, 4);
  const int64_t B = x.shape[0], n = x.shape[1], L = x.shape[2], D = x.shape[3];
  if (D % 2 != 0) fail("{}: head dim of x {} must be even", op, x.str());
  require_shape(op, {"pe", pe}, Shape{B, L, D / 2, 2});
  if (!pe.contiguous()) fail("{}: table 'pe' {} must be contiguous", op, pe.str());
  const Mat X = mat(x);
  const float* table = pe.ptr<float>();
  const int64_t half = D / 2;
  for_each_row(*this, B * n * L, half, [=] __device__(int64_t r, int p) {
    const int64_t b = r / (n * L), l = r % L;
    const float* cs = table + (b * L + l) * D;
    const float co = cs[2 * p], si = inverse ? -cs[2 * p + 1] : cs[2 * p + 1];
    const float x0 = X.at(r, 2 * p), x1 = X.at(r, 2 * p + 1);
    X.at(r, 2 * p) = co * x0 - si * x1;
    X.at(r, 2 * p + 1) = si * x0 + co * x1;
  });
}

void CudaBackend::timestep_embedding(Tensor out, Tensor t, double time_factor, double max_period) {
  constexpr std::string_view op = "timestep_embedding";
  require_f32(op, {{"out", out}, {"t", t}});
  require_rank(op, {"out", out}, 2);
  const int64_t B = out.shape[0], dim = out.shape[1], half = dim / 2;
  require_vector(op, {"t", t}, B);
  const Mat O = mat(out);
  const float* tv = t.ptr<float>();
  const double neg_log_period = -log(max_period);
  for_each(*this, B * dim, [=] __device__(int64_t i) {
    const int64_t b = i / dim, j = i % dim;
    if (j >= 2 * half) {  // odd widths are zero-padded, as in the reference
      O.at(b, j) = 0.0f;
      return;
    }
    const int64_t k = j < half ? j : j - half;
    const double arg = time_factor * static_cast<double>(tv[b]) *
                       exp(neg_log_period * static_cast<double>(k) / static_cast<double>(half));
    O.at(b, j) = static_cast<float>(j < half ? cos(arg) : sin(arg));
  });
}

}  // namespace flux8

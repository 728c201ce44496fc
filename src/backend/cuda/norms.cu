// Modulated LayerNorm (adaLN) and the per-head RMSNorm of QK-norm on the device. As on the CPU
// (src/backend/cpu/norms.cpp): row statistics are accumulated in double (two-pass variance),
// mean/rstd are stored as f32 and both passes normalise with the stored values. One block per
// LayerNorm row, one warp per RMSNorm head segment; every sum has a fixed order. LayerNorm's
// activations may be bf16 (Backend::activation_dtype; statistics stay f32), RMSNorm's are f32.
#include <type_traits>

#include "backend/cuda/common.cuh"
#include "backend/cuda/pointwise.cuh"

namespace flux8 {
using namespace cuda;

namespace {

// Sum over the 32 lanes of a warp (xor butterfly: the same order on every run).
__device__ inline double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Activations (x, y, dy, dx, shift, scale, dshift, dscale) of element type T: f32 or bf16
// (widened on load; computed in f32/f64 as for f32; rounded to nearest even on store).
template <typename T>
__global__ void layernorm_modulate_kernel(MatOf<T> y, float* mean, float* rstd, MatOf<T> x, MatOf<T> shift,
                                          MatOf<T> scale, int64_t L, double eps) {
  __shared__ double sh[kThreads];
  const int64_t r = blockIdx.x, H = x.cols, b = r / L;
  double s = 0;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) s += x.get(r, j);
  const double mu = block_sum(s, sh) / static_cast<double>(H);
  double sq = 0;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    const double d = x.get(r, j) - mu;
    sq += d * d;
  }
  sq = block_sum(sq, sh);
  const float mu_t = static_cast<float>(mu);
  const float rs_t = static_cast<float>(1.0 / sqrt(sq / static_cast<double>(H) + eps));
  if (threadIdx.x == 0) {
    mean[r] = mu_t;
    rstd[r] = rs_t;
  }
  if (!y.p) return;  // statistics only (a fused cast makes y)
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x)
    y.set(r, j, layernorm_modulate_value(x.get(r, j), mu_t, rs_t, shift.get(b, j), scale.get(b, j)));
}

template <typename T>
__global__ void layernorm_modulate_dx_kernel(MatOf<T> dx, MatOf<T> dy, MatOf<T> x, const float* mean,
                                             const float* rstd, MatOf<T> scale, int64_t L, bool accumulate) {
  __shared__ double sh[kThreads];
  const int64_t r = blockIdx.x, H = x.cols, b = r / L;
  const double mu = mean[r], rs = rstd[r];
  double sg = 0, sgx = 0;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    const double g = dy.get(r, j) * (1.0 + scale.get(b, j));
    sg += g;
    sgx += g * ((x.get(r, j) - mu) * rs);
  }
  const double mean_g = block_sum(sg, sh) / static_cast<double>(H);
  const double mean_gx = block_sum(sgx, sh) / static_cast<double>(H);
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    const double g = dy.get(r, j) * (1.0 + scale.get(b, j));
    const float v = static_cast<float>(rs * (g - mean_g - (x.get(r, j) - mu) * rs * mean_gx));
    dx.set(r, j, accumulate ? dx.get(r, j) + v : v);
  }
}

// kV consecutive elements of row r from column j as f32: kV = 1 one element, kV = 4 one
// 8-byte access of four bf16 (the caller checked the alignment).
template <int kV, typename T>
__device__ inline void load_vec(const MatOf<T>& m, int64_t r, int64_t j, float* v) {
  if constexpr (kV == 1) {
    v[0] = m.get(r, j);
  } else {
    static_assert(kV == 4 && sizeof(T) == 2, "4-wide access is for bf16 rows");
    const float4 q = load4(&m.at(r, j));
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  }
}
template <int kV, typename T>
__device__ inline void store_vec(const MatOf<T>& m, int64_t r, int64_t j, const float* v) {
  if constexpr (kV == 1) {
    m.set(r, j, v[0]);
  } else {
    static_assert(kV == 4 && sizeof(T) == 2, "4-wide access is for bf16 rows");
    store4(&m.at(r, j), make_float4(v[0], v[1], v[2], v[3]));
  }
}

// The whole LayerNorm backward in one pass over dy and x: a block takes `rows` rows of one
// sample (grid: chunks x samples). Thread t holds the column groups g = t, t + kLnThreads, ...
// (kGroups of them, in registers; 512 threads for wide rows keep f32 rows at 6 columns a thread
// for Flux's 3072), each kV consecutive columns from kV·g: kV = 1 for f32 rows (coalesced
// 4-byte accesses) and bf16 rows that are not 8-byte aligned, kV = 4 for the others (8-byte
// accesses: a warp then moves 256 bytes per load, as a warp of f32 columns moves 128). Per row
// it forms dx like layernorm_modulate_dx_kernel (the two row sums by warp butterflies and a
// fixed-order sum of the warps), and it accumulates the columns' dshift = Σ dy and dscale =
// Σ dy·x̂ over its rows, written as per-chunk partials that are then added in chunk order. The
// three-pass version read dy three times and x twice.
template <typename T, int kV, int kLnThreads, int kGroups>
__global__ void __launch_bounds__(kLnThreads) layernorm_modulate_backward_kernel(
    MatOf<T> dx, MatOf<T> dy, MatOf<T> x, const float* mean, const float* rstd, MatOf<T> scale, int64_t L,
    int64_t rows, bool accumulate, double* shift_partial, double* scale_partial, int64_t chunks) {
  constexpr int kLnWarps = kLnThreads / 32, kCols = kV * kGroups;
  __shared__ double sums[2][kLnWarps][2];  // double-buffered by row parity: one barrier a row
  const int64_t b = blockIdx.y, chunk = blockIdx.x, H = x.cols;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t begin = b * L + chunk * rows, end = b * L + (chunk + 1) * rows < (b + 1) * L
                                                        ? b * L + (chunk + 1) * rows
                                                        : (b + 1) * L;
  // Column k of this thread: element k % kV of group k / kV. With kV = 4, H is a multiple of 4,
  // so a group is wholly inside the row or wholly past its end.
  const auto column = [](int k) { return (threadIdx.x + int64_t(k / kV) * kLnThreads) * kV + k % kV; };
  double one_plus[kCols], acc_shift[kCols], acc_scale[kCols];
#pragma unroll
  for (int k = 0; k < kCols; ++k) {
    const int64_t j = column(k);
    one_plus[k] = j < H ? 1.0 + scale.get(b, j) : 0.0;
    acc_shift[k] = acc_scale[k] = 0.0;
  }
  int parity = 0;
  for (int64_t r = begin; r < end; ++r, parity ^= 1) {
    const double mu = mean[r], rs = rstd[r];
    float dyv[kCols], xv[kCols];
#pragma unroll
    for (int k = 0; k < kCols; k += kV) {
      const int64_t j = column(k);
      if (j < H) {
        load_vec<kV>(dy, r, j, dyv + k);
        load_vec<kV>(x, r, j, xv + k);
      } else {
#pragma unroll
        for (int e = 0; e < kV; ++e) dyv[k + e] = xv[k + e] = 0.0f;
      }
    }
    double sg = 0, sgx = 0;
#pragma unroll
    for (int k = 0; k < kCols; ++k) {
      const double g = dyv[k] * one_plus[k], xhat = (xv[k] - mu) * rs;
      sg += g;
      sgx += g * xhat;
      acc_shift[k] += dyv[k];
      acc_scale[k] += double(dyv[k]) * xhat;
    }
    for (int o = 16; o > 0; o >>= 1) {
      sg += __shfl_xor_sync(0xffffffffu, sg, o);
      sgx += __shfl_xor_sync(0xffffffffu, sgx, o);
    }
    if (lane == 0) sums[parity][warp][0] = sg, sums[parity][warp][1] = sgx;
    __syncthreads();
    double tg = 0, tgx = 0;
    for (int w = 0; w < kLnWarps; ++w) tg += sums[parity][w][0], tgx += sums[parity][w][1];
    const double mean_g = tg / static_cast<double>(H), mean_gx = tgx / static_cast<double>(H);
    if (!dx.p) continue;
#pragma unroll
    for (int k = 0; k < kCols; k += kV) {
      const int64_t j = column(k);
      if (j >= H) continue;
      float v[kV], old[kV];
      if (accumulate) load_vec<kV>(dx, r, j, old);
#pragma unroll
      for (int e = 0; e < kV; ++e) {
        const double g = dyv[k + e] * one_plus[k + e];
        v[e] = static_cast<float>(rs * (g - mean_g - (xv[k + e] - mu) * rs * mean_gx));
        if (accumulate) v[e] = old[e] + v[e];
      }
      store_vec<kV>(dx, r, j, v);
    }
  }
  const int64_t base = (b * chunks + chunk) * H;
#pragma unroll
  for (int k = 0; k < kCols; ++k) {
    const int64_t j = column(k);
    if (j >= H) continue;
    if (shift_partial) shift_partial[base + j] = acc_shift[k];
    if (scale_partial) scale_partial[base + j] = acc_scale[k];
  }
}

// Rows of one sample per block of the one-pass backward: up to 32 (fewer partials to write and
// add), but few enough that the grid has ~2 blocks per SM of an H100/H200 (132 SMs) when B·L is
// small (the text stream of a double block: B·512 rows gave B·16 blocks). A function of the
// shape only, so the order of the dshift/dscale sums, and their bits, are the same on every run
// and every GPU; from B·L = 32·264 rows on it is 32, the split before.
constexpr int64_t kLnMaxRows = 32, kLnTargetBlocks = 2 * 132;
int64_t ln_rows_per_block(int64_t B, int64_t L) {
  const int64_t r = B * L / kLnTargetBlocks;
  return r < 1 ? 1 : (r > kLnMaxRows ? kLnMaxRows : r);
}

__global__ void rmsnorm_heads_kernel(Mat y, float* rstd, Mat x, const float* scale, int64_t D, int64_t n,
                                     int64_t segments, double eps) {
  const int64_t seg = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (seg >= segments) return;  // whole warps leave together (segments are warp-aligned)
  const int64_t r = seg / n, off = (seg % n) * D;
  double sq = 0;
  for (int64_t d = lane; d < D; d += 32) {
    const double v = x.at(r, off + d);
    sq += v * v;
  }
  sq = warp_sum(sq);
  const float rs = static_cast<float>(1.0 / sqrt(sq / static_cast<double>(D) + eps));
  if (lane == 0) rstd[seg] = rs;
  for (int64_t d = lane; d < D; d += 32) y.at(r, off + d) = x.at(r, off + d) * rs * scale[d];
}

__global__ void rmsnorm_heads_dx_kernel(Mat dx, Mat dy, Mat x, const float* rstd, const float* scale, int64_t D,
                                        int64_t n, int64_t segments) {
  const int64_t seg = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (seg >= segments) return;
  const int64_t r = seg / n, off = (seg % n) * D;
  const double rs = rstd[seg];
  double s = 0;
  for (int64_t d = lane; d < D; d += 32)
    s += static_cast<double>(dy.at(r, off + d)) * scale[d] * x.at(r, off + d) * rs;
  const double mean_gx = warp_sum(s) / static_cast<double>(D);
  for (int64_t d = lane; d < D; d += 32) {
    const double g = static_cast<double>(dy.at(r, off + d)) * scale[d];
    dx.at(r, off + d) = static_cast<float>(rs * (g - x.at(r, off + d) * rs * mean_gx));
  }
}

template <typename T>
void layernorm_modulate_as(CudaBackend& be, const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                           const Tensor& shift, const Tensor& scale, int64_t rows, int64_t L, double eps) {
  layernorm_modulate_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, be.stream()>>>(
      mat_of_or_null<T>(y), mean.ptr<float>(), rstd.ptr<float>(), mat_of<T>(x), mat_of<T>(shift), mat_of<T>(scale),
      L, eps);
  FLUX8_LAUNCH_CHECK(layernorm_modulate_kernel);
}

// The one-pass backward (H ≤ 4096, B ≤ 65535), for activations of type T.
template <typename T>
void layernorm_modulate_backward_one_pass(CudaBackend& be, const Tensor& dx, const Tensor& dshift,
                                          const Tensor& dscale, const Tensor& dy, const Tensor& x, const Tensor& mean,
                                          const Tensor& rstd, const Tensor& scale, bool accumulate_dx, int64_t B,
                                          int64_t L, int64_t H) {
  const int64_t rows = ln_rows_per_block(B, L), chunks = (L + rows - 1) / rows;
  const size_t partial_bytes = static_cast<size_t>(2 * B * chunks * H) * sizeof(double);
  double* partial = dshift.defined() || dscale.defined() ? static_cast<double*>(be.reduction_scratch(partial_bytes))
                                                         : nullptr;
  double* shift_partial = dshift.defined() ? partial : nullptr;
  double* scale_partial = dscale.defined() ? partial + B * chunks * H : nullptr;
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(B));
  const MatOf<T> DX = mat_of_or_null<T>(dx), DY = mat_of<T>(dy), X = mat_of<T>(x), S = mat_of<T>(scale);
  const float *mu = mean.ptr<float>(), *rs = rstd.ptr<float>();
#define FLUX8_LN_BACKWARD(V, THREADS, GROUPS)                                               \
  layernorm_modulate_backward_kernel<T, V, THREADS, GROUPS><<<grid, THREADS, 0, be.stream()>>>( \
      DX, DY, X, mu, rs, S, L, rows, accumulate_dx, shift_partial, scale_partial, chunks)
  // bf16 rows in 8-byte groups of 4 where every row start is 8-byte aligned (H and ld multiples
  // of 4): at most 4 (8) columns a thread, as the f32 variants below hold 4 to 8.
  bool launched = false;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (vec4_rows(DY) && vec4_rows(X) && (!DX.p || vec4_rows(DX))) {
      if (H <= 512) FLUX8_LN_BACKWARD(4, 128, 1);
      else if (H <= 1024) FLUX8_LN_BACKWARD(4, 256, 1);
      else if (H <= 2048) FLUX8_LN_BACKWARD(4, 512, 1);
      else if (H <= 3072) FLUX8_LN_BACKWARD(4, 768, 1);
      else FLUX8_LN_BACKWARD(4, 512, 2);
      launched = true;
    }
  }
  if (!launched) {  // one column at a time: f32 rows, and bf16 rows not in aligned groups
    if (H <= 256) FLUX8_LN_BACKWARD(1, 256, 1);
    else if (H <= 512) FLUX8_LN_BACKWARD(1, 256, 2);
    else if (H <= 1024) FLUX8_LN_BACKWARD(1, 256, 4);
    else if (H <= 2048) FLUX8_LN_BACKWARD(1, 512, 4);
    else if (H <= 3072) FLUX8_LN_BACKWARD(1, 512, 6);
    else FLUX8_LN_BACKWARD(1, 512, 8);
  }
#undef FLUX8_LN_BACKWARD
  FLUX8_LAUNCH_CHECK(layernorm_modulate_backward_kernel);
  if (shift_partial) column_partials_total(be, B, H, chunks, shift_partial, dshift.ptr<T>(), dshift.ld, false);
  if (scale_partial) column_partials_total(be, B, H, chunks, scale_partial, dscale.ptr<T>(), dscale.ld, false);
}

// Rows wider than 4096 columns: dx one block per row, the column sums in their own passes.
template <typename T>
void layernorm_modulate_backward_passes(CudaBackend& be, const Tensor& dx, const Tensor& dshift, const Tensor& dscale,
                                        const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                                        const Tensor& scale, bool accumulate_dx, int64_t B, int64_t L, int64_t H) {
  if (dx.defined() && B * L > 0) {
    layernorm_modulate_dx_kernel<T><<<static_cast<unsigned>(B * L), kThreads, 0, be.stream()>>>(
        mat_of<T>(dx), mat_of<T>(dy), mat_of<T>(x), mean.ptr<float>(), rstd.ptr<float>(), mat_of<T>(scale), L,
        accumulate_dx);
    FLUX8_LAUNCH_CHECK(layernorm_modulate_dx_kernel);
  }
  const MatOf<T> DY = mat_of<T>(dy), X = mat_of<T>(x);
  const float *mu = mean.ptr<float>(), *rs = rstd.ptr<float>();
  if (dshift.defined())
    column_sums(
        be, B, L, H, [=] __device__(int64_t b, int64_t l, int64_t j) { return double(DY.get(b * L + l, j)); },
        dshift.ptr<T>(), dshift.ld, false);
  if (dscale.defined())
    column_sums(
        be, B, L, H,
        [=] __device__(int64_t b, int64_t l, int64_t j) {
          const int64_t r = b * L + l;
          return double(DY.get(r, j)) * ((double(X.get(r, j)) - mu[r]) * rs[r]);
        },
        dscale.ptr<T>(), dscale.ld, false);
}

}  // namespace

void CudaBackend::layernorm_modulate(Tensor y, Tensor mean, Tensor rstd, Tensor x, Tensor shift, Tensor scale,
                                     double eps) {
  constexpr std::string_view op = "layernorm_modulate";
  const bool bf = activations_in_bf16(op, {{"y", y}, {"x", x}, {"shift", shift}, {"scale", scale}});
  const auto [B, L, H] = ops::check_layernorm_modulate(op, y, mean, rstd, x, shift, scale);
  require_f32(op, {{"mean", mean}, {"rstd", rstd}});  // statistics: f32 whatever the activations
  if (B * L == 0) return;
  if (bf)
    layernorm_modulate_as<__nv_bfloat16>(*this, y, mean, rstd, x, shift, scale, B * L, L, eps);
  else
    layernorm_modulate_as<float>(*this, y, mean, rstd, x, shift, scale, B * L, L, eps);
}

void CudaBackend::layernorm_modulate_backward(Tensor dx, Tensor dshift, Tensor dscale, Tensor dy, Tensor x,
                                              Tensor mean, Tensor rstd, Tensor scale, bool accumulate_dx) {
  constexpr std::string_view op = "layernorm_modulate_backward";
  const bool bf = activations_in_bf16(
      op, {{"dx", dx}, {"dshift", dshift}, {"dscale", dscale}, {"dy", dy}, {"x", x}, {"scale", scale}});
  const auto [B, L, H] = ops::check_layernorm_modulate_backward(op, dy, x, mean, rstd);
  require_f32(op, {{"mean", mean}, {"rstd", rstd}});  // statistics: f32 whatever the activations
  if (dx.defined()) require_shape(op, {"dx", dx}, x.shape);
  if (dshift.defined()) require_shape(op, {"dshift", dshift}, Shape{B, H});
  if (dscale.defined()) require_shape(op, {"dscale", dscale}, Shape{B, H});
  if (!dx.defined() && !dshift.defined() && !dscale.defined()) return;
  if (B * L > 0 && H > 0 && H <= 4096 && B <= 65535 && scale.defined()) {
    require_shape(op, {"scale", scale}, Shape{B, H});
    if (bf)
      layernorm_modulate_backward_one_pass<__nv_bfloat16>(*this, dx, dshift, dscale, dy, x, mean, rstd, scale,
                                                          accumulate_dx, B, L, H);
    else
      layernorm_modulate_backward_one_pass<float>(*this, dx, dshift, dscale, dy, x, mean, rstd, scale, accumulate_dx,
                                                  B, L, H);
    return;
  }
  if (dx.defined() && B * L > 0) require_shape(op, {"scale", scale}, Shape{B, H});
  if (bf)
    layernorm_modulate_backward_passes<__nv_bfloat16>(*this, dx, dshift, dscale, dy, x, mean, rstd, scale,
                                                      accumulate_dx, B, L, H);
  else
    layernorm_modulate_backward_passes<float>(*this, dx, dshift, dscale, dy, x, mean, rstd, scale, accumulate_dx, B,
                                              L, H);
}

void CudaBackend::rmsnorm_heads(Tensor y, Tensor rstd, Tensor x, Tensor scale, double eps) {
  constexpr std::string_view op = "rmsnorm_heads";
  require_f32(op, {{"y", y}, {"rstd", rstd}, {"x", x}, {"scale", scale}});
  const int64_t D = ops::rmsnorm_head_dim(op, x, scale), rows = x.rows(), n = x.cols() / D;
  require_same_matrix(op, {"y", y}, {"x", x});
  require_vector(op, {"rstd", rstd}, rows * n);
  const int64_t segments = rows * n;
  if (segments == 0) return;
  rmsnorm_heads_kernel<<<exact_blocks(segments * 32), kThreads, 0, stream_>>>(mat(y), rstd.ptr<float>(), mat(x),
                                                                            scale.ptr<float>(), D, n, segments, eps);
  FLUX8_LAUNCH_CHECK(rmsnorm_heads_kernel);
}

void CudaBackend::rmsnorm_heads_backward(Tensor dx, Tensor dscale, Tensor dy, Tensor x, Tensor rstd, Tensor scale) {
  constexpr std::string_view op = "rmsnorm_heads_backward";
  require_f32(op, {{"dx", dx}, {"dscale", dscale}, {"dy", dy}, {"x", x}, {"rstd", rstd}, {"scale", scale}});
  const int64_t D = ops::rmsnorm_head_dim(op, x, scale), rows = x.rows(), n = x.cols() / D;
  require_same_matrix(op, {"dy", dy}, {"x", x});
  require_vector(op, {"rstd", rstd}, rows * n);
  const int64_t segments = rows * n;
  if (dx.defined() && segments > 0) {
    require_same_matrix(op, {"dx", dx}, {"x", x});
    rmsnorm_heads_dx_kernel<<<exact_blocks(segments * 32), kThreads, 0, stream_>>>(
        mat(dx), mat(dy), mat(x), rstd.ptr<float>(), scale.ptr<float>(), D, n, segments);
    FLUX8_LAUNCH_CHECK(rmsnorm_heads_dx_kernel);
  }
  if (dscale.defined()) {
    require_vector(op, {"dscale", dscale}, D);
    const Mat DY = mat(dy), X = mat(x);
    const float* rs = rstd.ptr<float>();
    column_sums(
        *this, 1, segments, D,
        [=] __device__(int64_t, int64_t i, int64_t d) {
          const int64_t r = i / n, off = (i % n) * D;
          return double(DY.at(r, off + d)) * X.at(r, off + d) * rs[i];
        },
        dscale.ptr<float>(), D, true);
  }
}

}  // namespace flux8

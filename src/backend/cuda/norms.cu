// Modulated LayerNorm (adaLN) and the per-head RMSNorm of QK-norm on the device. As on the CPU
// (src/backend/cpu/norms.cpp): row statistics are accumulated in double (two-pass variance),
// mean/rstd are stored as f32 and both passes normalise with the stored values. One block per
// LayerNorm row, one warp per RMSNorm head segment; every sum has a fixed order.
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

__global__ void layernorm_modulate_kernel(Mat y, float* mean, float* rstd, Mat x, Mat shift, Mat scale, int64_t L,
                                          double eps) {
  __shared__ double sh[kThreads];
  const int64_t r = blockIdx.x, H = x.cols, b = r / L;
  double s = 0;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) s += x.at(r, j);
  const double mu = block_sum(s, sh) / static_cast<double>(H);
  double sq = 0;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    const double d = x.at(r, j) - mu;
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
    y.at(r, j) = layernorm_modulate_value(x.at(r, j), mu_t, rs_t, shift.at(b, j), scale.at(b, j));
}

__global__ void layernorm_modulate_dx_kernel(Mat dx, Mat dy, Mat x, const float* mean, const float* rstd, Mat scale,
                                             int64_t L, bool accumulate) {
  __shared__ double sh[kThreads];
  const int64_t r = blockIdx.x, H = x.cols, b = r / L;
  const double mu = mean[r], rs = rstd[r];
  double sg = 0, sgx = 0;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    const double g = dy.at(r, j) * (1.0 + scale.at(b, j));
    sg += g;
    sgx += g * ((x.at(r, j) - mu) * rs);
  }
  const double mean_g = block_sum(sg, sh) / static_cast<double>(H);
  const double mean_gx = block_sum(sgx, sh) / static_cast<double>(H);
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
    const double g = dy.at(r, j) * (1.0 + scale.at(b, j));
    const float v = static_cast<float>(rs * (g - mean_g - (x.at(r, j) - mu) * rs * mean_gx));
    dx.at(r, j) = accumulate ? dx.at(r, j) + v : v;
  }
}

// The whole LayerNorm backward in one pass over dy and x: a block takes kLnRows rows of one
// sample (grid: chunks x samples), thread t the columns t, t + kThreads, ... (kCols of them,
// in registers; 512 threads for wide rows keep them at 6 a thread for Flux's 3072). Per row it forms dx like layernorm_modulate_dx_kernel (the two row sums by warp
// butterflies and a fixed-order sum of the 8 warps), and it accumulates the columns' dshift =
// Σ dy and dscale = Σ dy·x̂ over its rows, written as per-chunk partials that
// column_partials_total_kernel adds in chunk order. The three-pass version read dy three times
// and x twice.
constexpr int kLnRows = 32;
template <int kLnThreads, int kCols>
__global__ void __launch_bounds__(kLnThreads) layernorm_modulate_backward_kernel(
    Mat dx, Mat dy, Mat x, const float* mean, const float* rstd, Mat scale, int64_t L, bool accumulate,
    double* shift_partial, double* scale_partial, int64_t chunks) {
  constexpr int kLnWarps = kLnThreads / 32;
  __shared__ double sums[2][kLnWarps][2];  // double-buffered by row parity: one barrier a row
  const int64_t b = blockIdx.y, chunk = blockIdx.x, H = x.cols;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t begin = b * L + chunk * kLnRows, end = b * L + (chunk + 1) * kLnRows < (b + 1) * L
                                                           ? b * L + (chunk + 1) * kLnRows
                                                           : (b + 1) * L;
  double one_plus[kCols], acc_shift[kCols], acc_scale[kCols];
#pragma unroll
  for (int k = 0; k < kCols; ++k) {
    const int64_t j = threadIdx.x + int64_t(k) * kLnThreads;
    one_plus[k] = j < H ? 1.0 + scale.at(b, j) : 0.0;
    acc_shift[k] = acc_scale[k] = 0.0;
  }
  int parity = 0;
  for (int64_t r = begin; r < end; ++r, parity ^= 1) {
    const double mu = mean[r], rs = rstd[r];
    float dyv[kCols], xv[kCols];
    double sg = 0, sgx = 0;
#pragma unroll
    for (int k = 0; k < kCols; ++k) {
      const int64_t j = threadIdx.x + int64_t(k) * kLnThreads;
      dyv[k] = j < H ? dy.at(r, j) : 0.0f;
      xv[k] = j < H ? x.at(r, j) : 0.0f;
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
#pragma unroll
    for (int k = 0; k < kCols; ++k) {
      const int64_t j = threadIdx.x + int64_t(k) * kLnThreads;
      if (j >= H) continue;
      const double g = dyv[k] * one_plus[k];
      const float v = static_cast<float>(rs * (g - mean_g - (xv[k] - mu) * rs * mean_gx));
      if (dx.p) dx.at(r, j) = accumulate ? dx.at(r, j) + v : v;
    }
  }
  const int64_t base = (b * chunks + chunk) * H;
#pragma unroll
  for (int k = 0; k < kCols; ++k) {
    const int64_t j = threadIdx.x + int64_t(k) * kLnThreads;
    if (j >= H) continue;
    if (shift_partial) shift_partial[base + j] = acc_shift[k];
    if (scale_partial) scale_partial[base + j] = acc_scale[k];
  }
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

}  // namespace

void CudaBackend::layernorm_modulate(Tensor y, Tensor mean, Tensor rstd, Tensor x, Tensor shift, Tensor scale,
                                     double eps) {
  constexpr std::string_view op = "layernorm_modulate";
  require_f32(op, {{"y", y}, {"mean", mean}, {"rstd", rstd}, {"x", x}, {"shift", shift}, {"scale", scale}});
  const auto [B, L, H] = ops::check_layernorm_modulate(op, y, mean, rstd, x, shift, scale);
  if (B * L == 0) return;
  layernorm_modulate_kernel<<<static_cast<unsigned>(B * L), kThreads, 0, stream_>>>(
      mat_or_null(y), mean.ptr<float>(), rstd.ptr<float>(), mat(x), mat(shift), mat(scale), L, eps);
  FLUX8_LAUNCH_CHECK(layernorm_modulate_kernel);
}

void CudaBackend::layernorm_modulate_backward(Tensor dx, Tensor dshift, Tensor dscale, Tensor dy, Tensor x,
                                              Tensor mean, Tensor rstd, Tensor scale, bool accumulate_dx) {
  constexpr std::string_view op = "layernorm_modulate_backward";
  require_f32(op, {{"dx", dx},
                   {"dshift", dshift},
                   {"dscale", dscale},
                   {"dy", dy},
                   {"x", x},
                   {"mean", mean},
                   {"rstd", rstd},
                   {"scale", scale}});
  const auto [B, L, H] = ops::check_layernorm_modulate_backward(op, dy, x, mean, rstd);
  if (dx.defined()) require_shape(op, {"dx", dx}, x.shape);
  if (dshift.defined()) require_shape(op, {"dshift", dshift}, Shape{B, H});
  if (dscale.defined()) require_shape(op, {"dscale", dscale}, Shape{B, H});
  if (!dx.defined() && !dshift.defined() && !dscale.defined()) return;
  if (B * L > 0 && H > 0 && H <= 4096 && B <= 65535 && scale.defined()) {
    require_shape(op, {"scale", scale}, Shape{B, H});
    const int64_t chunks = (L + kLnRows - 1) / kLnRows;
    double* partial = dshift.defined() || dscale.defined() ? static_cast<double*>(reduction_scratch(
                                                                 static_cast<size_t>(2 * B * chunks * H) * sizeof(double)))
                                                           : nullptr;
    double* shift_partial = dshift.defined() ? partial : nullptr;
    double* scale_partial = dscale.defined() ? partial + B * chunks * H : nullptr;
    const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(B));
    const Mat DX = mat_or_null(dx), DY = mat(dy), X = mat(x), S = mat(scale);
    const float *mu = mean.ptr<float>(), *rs = rstd.ptr<float>();
#define FLUX8_LN_BACKWARD(T, C)                                                                                 \
  layernorm_modulate_backward_kernel<T, C><<<grid, T, 0, stream_>>>(DX, DY, X, mu, rs, S, L, accumulate_dx, \
                                                                    shift_partial, scale_partial, chunks)
    if (H <= 256) FLUX8_LN_BACKWARD(256, 1);
    else if (H <= 512) FLUX8_LN_BACKWARD(256, 2);
    else if (H <= 1024) FLUX8_LN_BACKWARD(256, 4);
    else if (H <= 2048) FLUX8_LN_BACKWARD(512, 4);
    else if (H <= 3072) FLUX8_LN_BACKWARD(512, 6);
    else FLUX8_LN_BACKWARD(512, 8);
#undef FLUX8_LN_BACKWARD
    FLUX8_LAUNCH_CHECK(layernorm_modulate_backward_kernel);
    for (const auto& [out, part] : {std::pair{dshift, shift_partial}, std::pair{dscale, scale_partial}}) {
      if (!part) continue;
      column_partials_total_kernel<<<blocks_for(B * H), kThreads, 0, stream_>>>(B, H, chunks, part, out.ptr<float>(),
                                                                               out.ld, false);
      FLUX8_LAUNCH_CHECK(column_partials_total_kernel);
    }
    return;
  }
  // Rows wider than 4096 columns: dx one block per row, the column sums in their own passes.
  if (dx.defined() && B * L > 0) {
    require_shape(op, {"dx", dx}, x.shape);
    require_shape(op, {"scale", scale}, Shape{B, H});
    layernorm_modulate_dx_kernel<<<static_cast<unsigned>(B * L), kThreads, 0, stream_>>>(
        mat(dx), mat(dy), mat(x), mean.ptr<float>(), rstd.ptr<float>(), mat(scale), L, accumulate_dx);
    FLUX8_LAUNCH_CHECK(layernorm_modulate_dx_kernel);
  }
  const Mat DY = mat(dy), X = mat(x);
  const float *mu = mean.ptr<float>(), *rs = rstd.ptr<float>();
  if (dshift.defined()) {
    require_shape(op, {"dshift", dshift}, Shape{B, H});
    column_sums(*this, B, L, H, [=] __device__(int64_t b, int64_t l, int64_t j) { return double(DY.at(b * L + l, j)); },
                dshift.ptr<float>(), dshift.ld, false);
  }
  if (dscale.defined()) {
    require_shape(op, {"dscale", dscale}, Shape{B, H});
    column_sums(
        *this, B, L, H,
        [=] __device__(int64_t b, int64_t l, int64_t j) {
          const int64_t r = b * L + l;
          return double(DY.at(r, j)) * ((double(X.at(r, j)) - mu[r]) * rs[r]);
        },
        dscale.ptr<float>(), dscale.ld, false);
  }
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

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

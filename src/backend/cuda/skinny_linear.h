#pragma once
// Linears over a handful of rows: the per-sample Linears of a Flux step (each block's
// modulation, the timestep / vector / guidance embedders, the final layer's modulation) see
// one row per sample, so with a batch of 2 (W2) cuBLASLt's tensor-core tiles, 64 or more rows
// tall, are almost empty and its kernels read the weight at ~2 TB/s and write the f32 weight
// gradient at ~2.8 TB/s (FLUX8_GEMM_PROFILE on an H200), the 3072x3072 ones at under 1 TB/s.
// Each weight element meets at most kSkinnyRows rows, so the three products are bound by the
// weight-sized operand alone; these kernels stream it once, 16 bytes per access, on CUDA cores
// with fp32 sums (the bf16 GEMM mode's precision: bf16 operands, fp32 accumulation).
// With more rows the products turn compute-bound on CUDA cores (32 rows: 32 FMAs per weight
// element, as slow as cuBLASLt at W1's batch of 32), so cuBLASLt keeps them.
#include <cuda_bf16.h>

#include <cstdint>

#include "core/tensor.h"

namespace flux8 {
class CudaBackend;
}

namespace flux8::cuda {

constexpr int64_t kSkinnyRows = 8;

// A row-major bf16 operand (the bf16 GEMM mode's operands, linear.cu's Operands).
struct Bf16Rows {
  const __nv_bfloat16* p;
  int64_t ld;
};

// y[N, M] = x[N, K]·w[M, K]ᵀ (+ bias[M], f32): each output rounded once from the fp32 sum plus
// the bias. y bf16 or f32, any row stride. 1 ≤ N ≤ kSkinnyRows.
void skinny_fprop(CudaBackend& be, Bf16Rows x, Bf16Rows w, const float* bias, const Tensor& y, int64_t N, int64_t K,
                  int64_t M);
// dx[N, K] = (dx +) dy[N, M]·w[M, K], the sum over M in a fixed order (per-block partial sums,
// then one pass adding them): the same bits on every run.
void skinny_dgrad(CudaBackend& be, Bf16Rows dy, Bf16Rows w, const Tensor& dx, int64_t N, int64_t K, int64_t M,
                  bool accumulate);
// dw[M, K] (f32) = (dw +) dy[N, M]ᵀ·x[N, K]; without accumulate dw is only written.
void skinny_wgrad(CudaBackend& be, Bf16Rows dy, Bf16Rows x, const Tensor& dw, int64_t N, int64_t K, int64_t M,
                  bool accumulate);

// Whether Linears may take these kernels: FLUX8_LINEAR_SKINNY=0 keeps every Linear on cuBLASLt
// (an A/B switch, read at each call; an empty value counts as unset).
bool skinny_enabled();

// Products these kernels have run in this process (each of the three counts one): tests check
// that the per-sample Linears take them.
int64_t skinny_products();

}  // namespace flux8::cuda

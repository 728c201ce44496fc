#pragma once
// An FP8 tensor on a backend: one byte per element plus the scales of its scaling blocks, as
// a view (memory belongs to an arena or a cache). `rows x cols` is the layout of the codes:
// a columnwise ("transposed") copy of x [N, K] is a QTensor of [K, N] — Hopper FP8 GEMMs are
// TN-only, so each GEMM operand is stored with its reduction dimension contiguous.
#include <cstdint>

#include "fp8/format.h"
#include "fp8/quantize.h"

namespace flux8 {

struct QTensor {
  uint8_t* codes = nullptr;  // rows x cols, row-major
  int64_t rows = 0, cols = 0;
  Fp8Format format = Fp8Format::e4m3;
  Fp8Scaling scaling = Fp8Scaling::per_tensor;
  float* scale_inv = nullptr;     // per_tensor [1]; block_1x128 [rows, ceil(cols/128)];
                                  // block_128x128 [ceil(rows/128), ceil(cols/128)]
  uint8_t* scale_e8m0 = nullptr;  // mx_1x32 [rows, ceil(cols/32)]

  bool defined() const { return codes != nullptr; }
  int64_t numel() const { return rows * cols; }
  // Number of scales of this shape and scaling (f32 scale_inv, or E8M0 bytes for MX).
  static int64_t scale_count(Fp8Scaling s, int64_t rows, int64_t cols) {
    switch (s) {
      case Fp8Scaling::per_tensor: return 1;
      case Fp8Scaling::block_1x128: return rows * ((cols + 127) / 128);
      case Fp8Scaling::block_128x128: return ((rows + 127) / 128) * ((cols + 127) / 128);
      case Fp8Scaling::mx_1x32: return rows * ((cols + 31) / 32);
    }
    return 0;
  }
};

// How an FP8 GEMM adds up its products (Backend::gemm_fp8_tn).
// - fp32: every partial sum in fp32. On Hopper the FP8 MMA instruction keeps only ~14
//   significant bits of its own k-slice (DeepSeek-V3 report §3.3.2); cuBLASLt's split
//   accumulation then adds each slice into an fp32 accumulator. The gradient GEMMs always.
// - fast: the backend may keep the running sum in the tensor cores' accumulator across slices
//   (cuBLASLt's FAST_ACCUM: no fp32 promotion, ~14 bits throughout) — Transformer Engine's fprop
//   GEMMs and torchao's output GEMM do; it makes the forward GEMMs faster (docs/PERFORMANCE.md).
//   Per-tensor scales only: block-scaled GEMMs promote each 128-wide block by construction and
//   take fp32. The CPU backend sums in fp32 either way.
enum class Fp8Accumulation : uint8_t { fp32, fast };

// Rows [begin, begin + count) of q as a QTensor of their own: the codes and scales from `begin`
// on. Any `begin` for per-tensor scales and per-row blocks (1x128, 1x32); a multiple of 128 for
// 128x128 blocks, whose scales cover 128 rows each.
inline QTensor rows_of(const QTensor& q, int64_t begin, int64_t count) {
  QTensor s = q;
  s.rows = count;
  s.codes = q.codes + begin * q.cols;
  const int64_t per_row = QTensor::scale_count(q.scaling, 1, q.cols);  // scales of one row
  switch (q.scaling) {
    case Fp8Scaling::per_tensor: break;
    case Fp8Scaling::block_1x128: s.scale_inv = q.scale_inv + begin * per_row; break;
    case Fp8Scaling::block_128x128: s.scale_inv = q.scale_inv + (begin / 128) * per_row; break;
    case Fp8Scaling::mx_1x32: s.scale_e8m0 = q.scale_e8m0 + begin * per_row; break;
  }
  return s;
}

}  // namespace flux8

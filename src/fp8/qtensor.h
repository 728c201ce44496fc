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

}  // namespace flux8

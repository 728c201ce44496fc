#include "fp8/quantize.h"

#include <algorithm>

#include "core/error.h"

namespace flux8 {

const char* fp8_scaling_name(Fp8Scaling s) {
  switch (s) {
    case Fp8Scaling::per_tensor: return "per_tensor";
    case Fp8Scaling::block_1x128: return "block_1x128";
    case Fp8Scaling::block_128x128: return "block_128x128";
    case Fp8Scaling::mx_1x32: return "mx_1x32";
  }
  return "?";
}

int64_t QuantizedTensor::block_rows() const {
  switch (scaling) {
    case Fp8Scaling::per_tensor: return std::max<int64_t>(rows, 1);
    case Fp8Scaling::block_128x128: return 128;
    default: return 1;
  }
}

int64_t QuantizedTensor::block_cols() const {
  switch (scaling) {
    case Fp8Scaling::per_tensor: return std::max<int64_t>(cols, 1);
    case Fp8Scaling::mx_1x32: return 32;
    default: return 128;
  }
}

float QuantizedTensor::scale_inv_at(int64_t r, int64_t c) const {
  const size_t k = size_t((r / block_rows()) * scale_cols() + c / block_cols());
  return scaling == Fp8Scaling::mx_1x32 ? e8m0_decode(scale_e8m0[k]) : scale_inv[k];
}

namespace {

// Below this many elements a cast runs on one thread: waking the OpenMP team costs more.
constexpr int64_t kParallelMin = int64_t(1) << 15;

// Casts n elements with one scale and counts what happened to them (CastStats in meta.h).
void cast_span(const float* x, uint8_t* q, int64_t n, float scale, Fp8Format fmt, CastStats& st) {
  const float bound = fp8_saturation_bound(fmt);
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const uint8_t code = quantize_value(v, scale, fmt);
    q[i] = code;
    st.amax = amax_accumulate(st.amax, v);
    if (v != 0.0f) {  // NaN != 0 holds: NaN counts as non-zero, but is neither saturated nor flushed
      ++st.nonzero;
      if (f32_abs(v * scale) > bound)
        ++st.saturated;
      else if (!f32_is_nan(v) && (code & 0x7fu) == 0)
        ++st.flushed;
    }
  }
  st.elements += n;
}

float span_amax(const float* x, int64_t n) {
  float a = 0.0f;
  for (int64_t i = 0; i < n; ++i) a = amax_accumulate(a, x[i]);
  return a;
}

void check_shape(const char* what, int64_t rows, int64_t cols) {
  if (rows < 0 || cols < 0) fail("{}: shape [{}, {}] is negative", what, rows, cols);
}

QuantizedTensor make(Fp8Scaling s, Fp8Format fmt, int64_t rows, int64_t cols) {
  QuantizedTensor q;
  q.scaling = s;
  q.format = fmt;
  q.rows = rows;
  q.cols = cols;
  q.codes.resize(size_t(rows * cols));
  return q;
}

}  // namespace

float tensor_amax(const float* x, int64_t n) {
  float a = 0.0f;
#pragma omp parallel for reduction(max : a) schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) a = amax_accumulate(a, x[i]);
  return a;
}

QuantizedTensor quantize_per_tensor(const float* x, int64_t rows, int64_t cols, Fp8Format fmt, float scale,
                                    CastStats* stats) {
  check_shape("quantize_per_tensor", rows, cols);
  QuantizedTensor q = make(Fp8Scaling::per_tensor, fmt, rows, cols);
  q.scale_inv = {scale_inverse(scale)};
  CastStats total;
#pragma omp parallel if (rows * cols >= kParallelMin)
  {
    CastStats local;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) cast_span(x + r * cols, q.codes.data() + r * cols, cols, scale, fmt, local);
#pragma omp critical
    total.merge(local);
  }
  if (stats) *stats = total;
  return q;
}

QuantizedTensor quantize_delayed(const float* x, int64_t rows, int64_t cols, Fp8Format fmt, Fp8MetaRegistry& reg,
                                 int slot) {
  CastStats st;
  QuantizedTensor q = quantize_per_tensor(x, rows, cols, fmt, reg.scale(slot), &st);
  q.scale_inv = {reg.scale_inv(slot)};
  reg.record_cast(slot, st);
  return q;
}

QuantizedTensor quantize_tensorwise(const float* x, int64_t rows, int64_t cols, Fp8Format fmt,
                                    CurrentScalingOptions opt, CastStats* stats) {
  const float amax = tensor_amax(x, rows * cols);
  return quantize_per_tensor(x, rows, cols, fmt, current_scale(amax, fp8_max(fmt), opt.pow2, opt.amax_epsilon), stats);
}

QuantizedTensor quantize_blockwise(const float* x, int64_t rows, int64_t cols, Fp8Format fmt, Fp8Scaling blocks,
                                   CurrentScalingOptions opt, CastStats* stats) {
  check_shape("quantize_blockwise", rows, cols);
  if (blocks != Fp8Scaling::block_1x128 && blocks != Fp8Scaling::block_128x128)
    fail("quantize_blockwise: scaling {} is not a block shape (block_1x128 or block_128x128)",
         fp8_scaling_name(blocks));
  QuantizedTensor q = make(blocks, fmt, rows, cols);
  const int64_t br = q.block_rows(), nbr = (rows + br - 1) / br, nbc = q.scale_cols();
  q.scale_inv.resize(size_t(nbr * nbc));
  const float fmax = fp8_max(fmt);
  CastStats total;
#pragma omp parallel if (rows * cols >= kParallelMin)
  {
    CastStats local;
#pragma omp for collapse(2) schedule(static)
    for (int64_t bi = 0; bi < nbr; ++bi)
      for (int64_t bj = 0; bj < nbc; ++bj) {
        const int64_t r0 = bi * br, r1 = std::min(rows, r0 + br);
        const int64_t c0 = bj * 128, n = std::min(cols, c0 + 128) - c0;
        float amax = 0.0f;
        for (int64_t r = r0; r < r1; ++r) amax = std::max(amax, span_amax(x + r * cols + c0, n));
        const float scale = current_scale(amax, fmax, opt.pow2, opt.amax_epsilon);
        q.scale_inv[size_t(bi * nbc + bj)] = scale_inverse(scale);
        for (int64_t r = r0; r < r1; ++r)
          cast_span(x + r * cols + c0, q.codes.data() + r * cols + c0, n, scale, fmt, local);
      }
#pragma omp critical
    total.merge(local);
  }
  if (stats) *stats = total;
  return q;
}

QuantizedTensor quantize_mxfp8(const float* x, int64_t rows, int64_t cols, Fp8Format fmt, CastStats* stats) {
  check_shape("quantize_mxfp8", rows, cols);
  QuantizedTensor q = make(Fp8Scaling::mx_1x32, fmt, rows, cols);
  const int64_t nbc = q.scale_cols();
  q.scale_e8m0.resize(size_t(rows * nbc));
  const float fmax = fp8_max(fmt);
  CastStats total;
#pragma omp parallel if (rows * cols >= kParallelMin)
  {
    CastStats local;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t bj = 0; bj < nbc; ++bj) {
        const int64_t c0 = bj * 32, n = std::min(cols, c0 + 32) - c0;
        const float* xb = x + r * cols + c0;
        const uint8_t e = e8m0_scale_for_amax(span_amax(xb, n), fmax);
        q.scale_e8m0[size_t(r * nbc + bj)] = e;
        cast_span(xb, q.codes.data() + r * cols + c0, n, mx_scale(e), fmt, local);
      }
#pragma omp critical
    total.merge(local);
  }
  if (stats) *stats = total;
  return q;
}

void dequantize(const QuantizedTensor& q, float* out) {
  const int64_t cols = q.cols, bc = q.block_cols(), br = q.block_rows(), nbc = q.scale_cols();
  const bool mx = q.scaling == Fp8Scaling::mx_1x32;
#pragma omp parallel for schedule(static) if (q.rows * cols >= kParallelMin)
  for (int64_t r = 0; r < q.rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const size_t k = size_t((r / br) * nbc + c / bc);
      const float s_inv = mx ? e8m0_decode(q.scale_e8m0[k]) : q.scale_inv[k];
      out[r * cols + c] = dequantize_value(q.codes[size_t(r * cols + c)], s_inv, q.format);
    }
}

std::vector<float> dequantize(const QuantizedTensor& q) {
  std::vector<float> out(size_t(q.rows * q.cols));
  dequantize(q, out.data());
  return out;
}

}  // namespace flux8

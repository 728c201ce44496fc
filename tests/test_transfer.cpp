// Host <-> backend copies with conversion (backend/transfer.h): the pieces a checkpoint streams
// to disk (download_as) and the values it loads back (upload_f32), for every stored type.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "backend/backend.h"
#include "backend/transfer.h"
#include "backend_buffer.h"
#include "core/dtype.h"
#include "core/rng.h"

namespace flux8 {
namespace {

using Buffer = testing::BackendBuffer;

// Values with bits below bf16's and f32's precision, so every rounding shows.
std::vector<double> values(size_t n) {
  std::vector<double> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = rng_normal(7, 1, i) * (1.0 + 1e-12 * static_cast<double>(i));
  return v;
}

TEST(Transfer, DownloadAsConvertsAnyPieceOfEveryType) {
  auto be = make_backend("cpu");
  const int64_t n = 1037;
  const std::vector<double> v = values(static_cast<size_t>(n));
  std::vector<uint8_t> scratch;
  for (DType src : {DType::f32, DType::f64, DType::bf16}) {
    Buffer b(*be, src, n);
    from_host(*be, b.t, v);
    const std::vector<double> stored = to_host(*be, b.t);  // what the tensor holds
    for (DType dst : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
      const size_t first = 101, count = 517;
      std::vector<uint8_t> got(count * dtype_size(dst));
      download_as(*be, b.t, first, count, dst, got.data(), scratch);
      for (size_t i = 0; i < count; ++i) {
        const double x = stored[first + i];
        const float xf = static_cast<float>(x);
        const uint8_t* p = got.data() + i * dtype_size(dst);
        if (dst == DType::f64) {
          double d;
          std::memcpy(&d, p, 8);
          // The same type is copied as it is; others widen from f32.
          ASSERT_EQ(d, src == DType::f64 ? x : static_cast<double>(xf)) << dtype_name(src) << " " << i;
        } else if (dst == DType::f32) {
          float f;
          std::memcpy(&f, p, 4);
          ASSERT_EQ(f, xf) << dtype_name(src) << " " << i;
        } else {
          uint16_t h;
          std::memcpy(&h, p, 2);
          ASSERT_EQ(h, dst == DType::bf16 ? f32_to_bf16_bits(xf) : f32_to_f16_bits(xf))
              << dtype_name(src) << " -> " << dtype_name(dst) << " " << i;
        }
      }
    }
  }
}

TEST(Transfer, UploadF32RoundsIntoEveryType) {
  auto be = make_backend("cpu");
  const int64_t n = 777;
  const std::vector<double> v = values(static_cast<size_t>(n));
  std::vector<float> f(v.begin(), v.end());
  std::vector<uint8_t> scratch;
  for (DType dst : {DType::f32, DType::f64, DType::bf16}) {
    Buffer b(*be, dst, n);
    upload_f32(*be, b.t, f.data(), scratch);
    const std::vector<double> got = to_host(*be, b.t);
    for (size_t i = 0; i < f.size(); ++i)
      ASSERT_EQ(got[i], dst == DType::bf16 ? static_cast<double>(round_to_bf16(f[i])) : static_cast<double>(f[i]))
          << dtype_name(dst) << " " << i;
  }
}

}  // namespace
}  // namespace flux8

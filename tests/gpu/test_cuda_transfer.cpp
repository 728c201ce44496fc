// The checkpoint's streamed copies (backend/transfer.h) from and to device memory: download_as
// of any piece and upload_f32 give the CPU backend's bytes exactly.
#include <gtest/gtest.h>

#include <vector>

#include "backend/transfer.h"
#include "core/rng.h"
#include "gpu_test_util.h"
#include "backend_buffer.h"

namespace flux8 {
namespace {

using testing::cpu;
using testing::gpu;

using Buffer = testing::BackendBuffer;

TEST(CudaTransfer, StreamedCopiesEqualTheCpuBackends) {
  FLUX8_REQUIRE_GPU();
  const int64_t n = (int64_t{9} << 20) + 13;  // 9 Mi elements: larger than one staging chunk
  std::vector<float> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = rng_normal(3, 2, i) * 1.0009765625f;
  std::vector<uint8_t> scratch;
  for (DType stored : {DType::f32, DType::bf16}) {
    Buffer d(gpu(), stored, n), h(cpu(), stored, n);
    upload_f32(gpu(), d.t, v.data(), scratch);
    upload_f32(cpu(), h.t, v.data(), scratch);
    EXPECT_EQ(to_host(gpu(), d.t), to_host(cpu(), h.t)) << dtype_name(stored);
    for (DType file : {DType::f32, DType::bf16, DType::f16}) {
      const size_t first = 4097, count = static_cast<size_t>(n) - 2 * first;
      std::vector<uint8_t> a(count * dtype_size(file)), b(a.size());
      download_as(gpu(), d.t, first, count, file, a.data(), scratch);
      download_as(cpu(), h.t, first, count, file, b.data(), scratch);
      EXPECT_TRUE(a == b) << dtype_name(stored) << " -> " << dtype_name(file);
    }
  }
}

}  // namespace
}  // namespace flux8

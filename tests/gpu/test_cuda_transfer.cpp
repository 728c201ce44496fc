// The checkpoint's streamed copies (backend/transfer.h) from and to device memory: download_as
// of any piece and upload_f32 give the CPU backend's bytes exactly; large downloads arrive whole.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "backend/transfer.h"
#include "backend_buffer.h"
#include "core/rng.h"
#include "gpu_test_util.h"

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

// download() moves large copies through pinned chunks of 8 MiB, the next one's copy in flight
// while the last is copied out (a checkpoint's host snapshot): every size around the direct
// copy's limit and the chunks' edges, from odd device offsets, arrives byte for byte.
TEST(CudaTransfer, StagedDownloadsOfEverySizeArriveWhole) {
  FLUX8_REQUIRE_GPU();
  const size_t MiB = size_t{1} << 20, most = 24 * MiB + 7;
  std::vector<uint8_t> bytes(most + 64);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(rng_normal(5, 1, i) * 64.0f);
  void* d = gpu().allocate(bytes.size());
  gpu().upload(d, bytes.data(), bytes.size());
  for (const size_t n : {4 * MiB - 1, 4 * MiB, 8 * MiB - 1, 8 * MiB, 8 * MiB + 1, 16 * MiB + 5, most})
    for (const size_t offset : {size_t{0}, size_t{3}, size_t{64}}) {
      std::vector<uint8_t> out(n + 2, 0xA5);  // the guard bytes must stay
      gpu().download(out.data() + 1, static_cast<const uint8_t*>(d) + offset, n);
      EXPECT_TRUE(std::equal(out.begin() + 1, out.end() - 1, bytes.begin() + static_cast<std::ptrdiff_t>(offset)))
          << n << " bytes from offset " << offset;
      EXPECT_EQ(out.front(), 0xA5);
      EXPECT_EQ(out.back(), 0xA5);
    }
  gpu().release(d);
}

}  // namespace
}  // namespace flux8

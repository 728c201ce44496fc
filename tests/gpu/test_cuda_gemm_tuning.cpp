// GEMM algorithm choice on the device: FLUX8_GEMM_AUTOTUNE (time cuBLASLt's candidates per
// shape, cache the choice on disk) and FLUX8_GEMM_BACKEND (pin FP8 GEMMs to cuBLASLt or to the
// emulated kernel). Results must not depend on either beyond summation order.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/gemm.h"
#include "core/error.h"
#include "gpu_test_util.h"

namespace flux8::testing {
namespace {

// Sets an environment variable for one scope (the previous value restored after).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) had_ = true, old_ = old;
    ::setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (had_)
      ::setenv(name_, old_.c_str(), 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

int count_lines(const std::string& path) {
  std::ifstream f(path);
  int n = 0;
  for (std::string line; std::getline(f, line);) n += !line.empty();
  return n;
}

// The first backend times the candidates of each shape and writes one cache line per shape; a
// second backend (a later run) takes every choice from the file and times nothing. Both give
// the untuned backend's results up to summation order (bf16 operands: 5e-3 as LinearBf16Gemm).
TEST(CudaGemmTuning, AutotuneTimesOnceThenReadsTheCache) {
  FLUX8_REQUIRE_GPU();
  const std::string cache =
      (std::filesystem::temp_directory_path() / ("flux8_autotune_test_" + std::to_string(::getpid()) + ".tsv"))
          .string();
  std::filesystem::remove(cache);
  ScopedEnv on("FLUX8_GEMM_AUTOTUNE", "1"), path("FLUX8_GEMM_AUTOTUNE_CACHE", cache);
  BackendOptions o;
  o.bf16_gemm = true;
  const int64_t N = 256, K = 512, M = 384;
  Pair x({N, K}), w({M, K}), b({M}), y({N, M}), dy({N, M}), dx({N, K}), dw({M, K}), db({M});
  x.randn(1), w.randn(2, 0.1), b.randn(3), dy.randn(4);
  auto step = [&](Backend& be) {
    be.linear(y.dev, x.dev, w.dev, b.dev);
    be.linear_backward(dx.dev, dw.dev, db.dev, dy.dev, x.dev, w.dev, false, true);
    be.synchronize();
    return std::pair{y.down(), dx.down()};
  };
  std::pair<std::vector<float>, std::vector<float>> reference;
  {
    ScopedEnv off("FLUX8_GEMM_AUTOTUNE", "");  // empty = unset: no tuning
    auto plain = make_cuda_backend(o);
    EXPECT_FALSE(dynamic_cast<CudaBackend&>(*plain).gemm().autotuning());
    reference = step(*plain);
  }
  {
    auto be = make_cuda_backend(o);
    cuda::Gemm& g = dynamic_cast<CudaBackend&>(*be).gemm();
    ASSERT_TRUE(g.autotuning());
    const auto [yt, dxt] = step(*be);
    EXPECT_LE(rel_l2(yt, reference.first), 5e-3);
    EXPECT_LE(rel_l2(dxt, reference.second), 5e-3);
    EXPECT_GE(g.tuned_here() + g.tuned_from_cache(), 3);  // fprop, dgrad, wgrad
    EXPECT_EQ(g.tuned_from_cache(), 0);
  }
  const int lines = count_lines(cache);
  EXPECT_GE(lines, 1) << cache;
  {
    auto be = make_cuda_backend(o);
    cuda::Gemm& g = dynamic_cast<CudaBackend&>(*be).gemm();
    const auto [yt, dxt] = step(*be);
    EXPECT_LE(rel_l2(yt, reference.first), 5e-3);
    EXPECT_EQ(g.tuned_here(), 0) << "every choice should come from " << cache;
    EXPECT_EQ(count_lines(cache), lines);
  }
  std::filesystem::remove(cache);
  ScopedEnv bad("FLUX8_GEMM_AUTOTUNE", "maybe");
  EXPECT_THROW(make_cuda_backend(o), Error);
}

// FLUX8_GEMM_PROFILE=1: each description's calls, device time and FLOPs, summed without
// changing the results; a bad value is refused by name.
TEST(CudaGemmTuning, ProfileSumsDeviceTimePerDescription) {
  FLUX8_REQUIRE_GPU();
  BackendOptions o;
  o.bf16_gemm = true;
  const int64_t N = 256, K = 512, M = 384;
  Pair x({N, K}), w({M, K}), b({M}), y({N, M});
  x.randn(1), w.randn(2, 0.1), b.randn(3);
  std::vector<float> reference;
  {
    auto plain = make_cuda_backend(o);
    EXPECT_FALSE(dynamic_cast<CudaBackend&>(*plain).gemm().profiling());
    plain->linear(y.dev, x.dev, w.dev, b.dev);
    plain->synchronize();  // y.down() reads through gpu(), whose stream is not ordered after this backend's
    reference = y.down();
  }
  ScopedEnv on("FLUX8_GEMM_PROFILE", "1");
  auto be = make_cuda_backend(o);
  cuda::Gemm& g = dynamic_cast<CudaBackend&>(*be).gemm();
  ASSERT_TRUE(g.profiling());
  for (int i = 0; i < 4; ++i) be->linear(y.dev, x.dev, w.dev, b.dev);  // the first is not timed
  be->synchronize();
  EXPECT_EQ(y.down(), reference);
  const std::vector<cuda::GemmTiming> rows = g.profile();
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].calls, 3);
  EXPECT_GT(rows[0].ms, 0.0);
  EXPECT_DOUBLE_EQ(rows[0].flops, 3 * 2.0 * N * M * K);
  EXPECT_NE(rows[0].desc.find("k=512"), std::string::npos) << rows[0].desc;
  be->linear(y.dev, x.dev, w.dev, b.dev);  // totals keep growing after a read
  const std::vector<cuda::GemmTiming> later = g.profile();
  ASSERT_EQ(later.size(), 1u);
  EXPECT_EQ(later[0].calls, 4);
  ScopedEnv bad("FLUX8_GEMM_PROFILE", "yes please");
  try {
    make_cuda_backend(o);
    ADD_FAILURE() << "FLUX8_GEMM_PROFILE='yes please' was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("FLUX8_GEMM_PROFILE"), std::string::npos) << e.what();
  }
}

// The emulated pin gives the dequantize + fp32 result (the CPU's, up to summation order, 1e-5)
// where cuBLASLt would run on the tensor cores; the cuBLASLt pin makes an unsupported product
// (odd k) an error instead of a silent fallback; an empty value is the default.
TEST(CudaGemmTuning, BackendPinChoosesThePath) {
  FLUX8_REQUIRE_GPU();
  const int64_t m = 64, n = 96, k = 128;
  auto cast = [](int64_t rows, int64_t cols, uint64_t seed, std::vector<uint8_t>& codes, float& scale_inv) {
    Buf<float> x(Shape{rows, cols});
    x.randn(seed);
    QTensor q;
    q.rows = rows, q.cols = cols, q.format = Fp8Format::e4m3, q.scaling = Fp8Scaling::per_tensor;
    codes.assign(static_cast<size_t>(rows * cols), 0);
    q.codes = codes.data();
    q.scale_inv = &scale_inv;
    Backend::Quantize args;
    cpu().quantize(q, QTensor{}, x.t, args);
    return q;
  };
  std::vector<uint8_t> ca, cb;
  float sa = 0, sb = 0;
  const QTensor ha = cast(m, k, 1, ca, sa), hb = cast(n, k, 2, cb, sb);
  auto to_device = [](const QTensor& h) {
    QTensor d = h;
    d.codes = static_cast<uint8_t*>(gpu().allocate(static_cast<size_t>(h.rows * h.cols)));
    d.scale_inv = static_cast<float*>(gpu().allocate(sizeof(float)));
    gpu().upload(d.codes, h.codes, static_cast<size_t>(h.rows * h.cols));
    gpu().upload(d.scale_inv, h.scale_inv, sizeof(float));
    return d;
  };
  const QTensor da = to_device(ha), db = to_device(hb);
  Pair c({m, n});
  cpu().gemm_fp8_tn(c.host.t, ha, hb, Tensor{}, false, Fp8Accumulation::fp32);
  {
    ScopedEnv pin("FLUX8_GEMM_BACKEND", "emulated");
    gpu().gemm_fp8_tn(c.dev, da, db, Tensor{}, false, Fp8Accumulation::fp32);
    EXPECT_LE(gpu_vs_cpu(c), 1e-5);
  }
  {
    ScopedEnv pin("FLUX8_GEMM_BACKEND", "");
    gpu().gemm_fp8_tn(c.dev, da, db, Tensor{}, false, Fp8Accumulation::fp32);
    EXPECT_LE(gpu_vs_cpu(c), 5e-4);  // cuBLASLt on the tensor cores (test_cuda_fp8.cpp's tolerance)
  }
  {
    ScopedEnv pin("FLUX8_GEMM_BACKEND", "cublaslt");
    QTensor oa = da, ob = db;  // k = 120: not a multiple of 16, no cuBLASLt kernel
    oa.cols = ob.cols = 120;
    Pair c2({m, n});
    EXPECT_THROW(gpu().gemm_fp8_tn(c2.dev, oa, ob, Tensor{}, false, Fp8Accumulation::fp32), Error);
  }
  {
    ScopedEnv pin("FLUX8_GEMM_BACKEND", "fast");
    EXPECT_THROW(gpu().gemm_fp8_tn(c.dev, da, db, Tensor{}, false, Fp8Accumulation::fp32), Error);
  }
  for (const QTensor* q : {&da, &db}) {
    gpu().release(q->codes);
    gpu().release(q->scale_inv);
  }
}

}  // namespace
}  // namespace flux8::testing

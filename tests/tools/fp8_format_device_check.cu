// Device = host for src/fp8/format.h: every f32 bit pattern (2^32) is encoded to E4M3, E5M2 and
// E8M0 and used as an MX amax, every bf16 through fp8_encode_bf16, every code decoded, on the GPU
// and on the CPU, and the results must be identical. Built with the CUDA backend as
// flux8_fp8_device_check and run by CTest (label gpu; exit 77 = skipped without a GPU). To
// show that no FTZ / approximate-division setting changes a result, build it by hand with
// fast math too:
//   nvcc -std=c++20 -O2 -arch=native -Isrc -Xcompiler -fopenmp --use_fast_math \
//        tests/tools/fp8_format_device_check.cu -o /tmp/fp8_check && /tmp/fp8_check
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "fp8/format.h"

using namespace flux8;

namespace {

constexpr uint64_t kChunk = 1ull << 28;

__global__ void encode_kernel(uint64_t base, uint8_t* e4, uint8_t* e5, uint8_t* e8, uint8_t* mx) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < kChunk;
       i += uint64_t(gridDim.x) * blockDim.x) {
    const float x = __uint_as_float(static_cast<uint32_t>(base + i));
    e4[i] = fp8_encode(x, Fp8Format::e4m3);
    e5[i] = fp8_encode(x, Fp8Format::e5m2);
    e8[i] = e8m0_encode(x);
    mx[i] = e8m0_scale_for_amax(x, kE4M3Max);
  }
}

__global__ void small_kernel(uint8_t* bf4, uint8_t* bf5, uint32_t* dec) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < 65536) {
    bf4[i] = fp8_encode_bf16(static_cast<uint16_t>(i), Fp8Format::e4m3);
    bf5[i] = fp8_encode_bf16(static_cast<uint16_t>(i), Fp8Format::e5m2);
  }
  if (i < 256) {
    const auto v = static_cast<uint8_t>(i);
    dec[i] = __float_as_uint(fp8_decode(v, Fp8Format::e4m3));
    dec[256 + i] = __float_as_uint(fp8_decode(v, Fp8Format::e5m2));
    dec[512 + i] = __float_as_uint(e8m0_decode(v));
  }
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

#define CHECK_CUDA(x)                                                                   \
  do {                                                                                  \
    cudaError_t err_ = (x);                                                             \
    if (err_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(err_)); \
      return 1;                                                                         \
    }                                                                                   \
  } while (0)

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;  // CTest SKIP_RETURN_CODE
  }
  uint8_t* d;
  CHECK_CUDA(cudaMalloc(&d, 4 * kChunk));
  std::vector<uint8_t> h(4 * kChunk);
  long long mismatches[4] = {0, 0, 0, 0};
  for (uint64_t base = 0; base < (1ull << 32); base += kChunk) {
    encode_kernel<<<4096, 256>>>(base, d, d + kChunk, d + 2 * kChunk, d + 3 * kChunk);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaMemcpy(h.data(), d, 4 * kChunk, cudaMemcpyDeviceToHost));
    long long m0 = 0, m1 = 0, m2 = 0, m3 = 0;
#pragma omp parallel for reduction(+ : m0, m1, m2, m3)
    for (long long i = 0; i < static_cast<long long>(kChunk); ++i) {
      float x;
      const uint32_t u = static_cast<uint32_t>(base + i);
      std::memcpy(&x, &u, 4);
      m0 += h[i] != fp8_encode(x, Fp8Format::e4m3);
      m1 += h[kChunk + i] != fp8_encode(x, Fp8Format::e5m2);
      m2 += h[2 * kChunk + i] != e8m0_encode(x);
      m3 += h[3 * kChunk + i] != e8m0_scale_for_amax(x, kE4M3Max);
    }
    mismatches[0] += m0, mismatches[1] += m1, mismatches[2] += m2, mismatches[3] += m3;
  }
  std::printf("all 2^32 f32: mismatches e4m3 %lld, e5m2 %lld, e8m0 %lld, mx scale %lld\n", mismatches[0], mismatches[1],
              mismatches[2], mismatches[3]);
  uint8_t* dbf;
  uint32_t* ddec;
  CHECK_CUDA(cudaMalloc(&dbf, 2 * 65536));
  CHECK_CUDA(cudaMalloc(&ddec, 4 * 768));
  small_kernel<<<256, 256>>>(dbf, dbf + 65536, ddec);
  std::vector<uint8_t> bf(2 * 65536);
  std::vector<uint32_t> dec(768);
  CHECK_CUDA(cudaMemcpy(bf.data(), dbf, bf.size(), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(dec.data(), ddec, 4 * dec.size(), cudaMemcpyDeviceToHost));
  long long mbf = 0, mdec = 0;
  for (int i = 0; i < 65536; ++i) {
    mbf += bf[i] != fp8_encode_bf16(static_cast<uint16_t>(i), Fp8Format::e4m3);
    mbf += bf[65536 + i] != fp8_encode_bf16(static_cast<uint16_t>(i), Fp8Format::e5m2);
  }
  for (int i = 0; i < 256; ++i) {
    const auto v = static_cast<uint8_t>(i);
    mdec += dec[i] != bits(fp8_decode(v, Fp8Format::e4m3));
    mdec += dec[256 + i] != bits(fp8_decode(v, Fp8Format::e5m2));
    mdec += dec[512 + i] != bits(e8m0_decode(v));
  }
  std::printf("bf16 path mismatches %lld, decode mismatches %lld\n", mbf, mdec);
  const long long total = mismatches[0] + mismatches[1] + mismatches[2] + mismatches[3] + mbf + mdec;
  std::printf(total == 0 ? "device == host\n" : "DEVICE != HOST\n");
  return total == 0 ? 0 : 1;
}

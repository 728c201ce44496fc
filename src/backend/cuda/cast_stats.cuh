#pragma once
// The statistics of a per-tensor FP8 cast on the device: what every block of a casting kernel
// saw (amax and the telemetry counts of cast_span() in src/fp8/quantize.cpp): where counts are
// wanted one partial per block, totalled in order by CudaBackend::total_cast_stats (fp8.cu), else
// the amax alone by one atomic per block (CastTally::finish_block). Shared by the cast kernels
// (fp8.cu) and the kernels that write FP8 heads in place of a separate cast (qk_norm_rope.cu,
// layout.cu).
#include <cstdint>

#include "backend/cuda/fp8_encode.cuh"

namespace flux8::cuda {

// What one block's cast saw (the element count is known on the host).
struct StatsPartial {
  float amax;
  uint32_t nonzero, saturated, flushed;
};
struct StatsTotal {
  float amax;
  unsigned long long nonzero, saturated, flushed;
};

// One thread's share of a cast: the amax as the bit pattern of a non-negative float (the integer
// max of |v| bits orders non-negative floats and +inf as the floats do; NaN is skipped, as
// amax_accumulate drops it) and, with kCount, the counts.
template <bool kCount>
struct CastTally {
  uint32_t amax_bits = 0;
  uint32_t nonzero = 0, saturated = 0, flushed = 0;

  // v cast with scale s to `code` in format f.
  __device__ void add(float v, float s, uint32_t code, Fp8Format f) {
    if (!f32_is_nan(v)) amax_bits = amax_bits > (f32_bits(v) & 0x7FFFFFFFu) ? amax_bits : (f32_bits(v) & 0x7FFFFFFFu);
    if constexpr (kCount) {
      if (v != 0.0f) {  // NaN is non-zero
        ++nonzero;
        if (f32_abs(v * s) > fp8_saturation_bound(f))
          ++saturated;
        else if (!f32_is_nan(v) && (code & 0x7Fu) == 0)
          ++flushed;
      }
    }
  }

  // The block's partial into *out: warp sums, then the warps in order by thread 0 (a fixed
  // order: the counts are exact integers anyway). Every thread of the block calls it; blocks of
  // at most 32 warps.
  __device__ void write_block_partial(StatsPartial* out) const {
    __shared__ uint32_t red[4][32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = (blockDim.x + 31) / 32;
    const uint32_t m = __reduce_max_sync(0xffffffffu, amax_bits);
    uint32_t c[3] = {nonzero, saturated, flushed};
    if constexpr (kCount)
      for (uint32_t& x : c) x = __reduce_add_sync(0xffffffffu, x);
    if (lane == 0) red[0][warp] = m, red[1][warp] = c[0], red[2][warp] = c[1], red[3][warp] = c[2];
    __syncthreads();
    if (threadIdx.x == 0) {
      StatsPartial p{0.0f, 0, 0, 0};
      uint32_t bits = 0;
      for (int w = 0; w < warps; ++w) {
        bits = bits > red[0][w] ? bits : red[0][w];
        p.nonzero += red[1][w];
        p.saturated += red[2][w];
        p.flushed += red[3][w];
      }
      p.amax = __uint_as_float(bits);
      *out = p;
    }
    __syncthreads();  // red may be reused by the next tally's call
  }

  // The block's amax max-accumulated into *target by one atomic, where no counts are wanted:
  // cheaper than a partial per block and a totalling kernel (tens of µs a tensor of 12k partials). The bit patterns of
  // non-negative floats order as the floats do, and amax targets hold non-negative, non-NaN values (amax_accumulate
  // never stores NaN, staging starts at +0), so an integer atomicMax is the float max. Every thread of the block calls
  // it.
  __device__ void max_block_amax_into(float* target) const {
    __shared__ uint32_t red[32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = (blockDim.x + 31) / 32;
    const uint32_t m = __reduce_max_sync(0xffffffffu, amax_bits);
    if (lane == 0) red[warp] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t bits = 0;
      for (int w = 0; w < warps; ++w) bits = bits > red[w] ? bits : red[w];
      if (bits != 0) atomicMax(reinterpret_cast<unsigned int*>(target), bits);
    }
    __syncthreads();
  }

  // The block's share of a cast's statistics: its partial into partials[blockIdx.x] where counts
  // are wanted (partials given: a report step, totalled after the kernel), else the amax alone
  // into *amax by one atomic (when given). Every thread of the block calls it.
  __device__ void finish_block(StatsPartial* partials, float* amax) const {
    if (partials)
      write_block_partial(partials + blockIdx.x);
    else if (amax)
      max_block_amax_into(amax);
  }
};

}  // namespace flux8::cuda

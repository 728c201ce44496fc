#pragma once
// Element types. f32 is the CPU backend's working type; f64 exists so the CPU backend can run
// the whole model in double precision for finite-difference gradient checks; bf16/f16 are
// storage types (checkpoints, GPU activations). FP8 formats live in src/fp8/.
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#if defined(__CUDACC__)
#define FLUX8_HD __host__ __device__
#else
#define FLUX8_HD
#endif

namespace flux8 {

enum class DType : uint8_t { f32, f64, bf16, f16, u8 };  // u8: FP8 codes (format kept beside them)

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);  // "f32", "bf16", ...

// bf16 <-> f32. Round to nearest even; NaN stays a (quiet) NaN.
FLUX8_HD inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
FLUX8_HD inline float bf16_bits_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// The value a bf16 store then load would give: used to emulate the GPU's bf16 activations.
FLUX8_HD inline float round_to_bf16(float f) { return bf16_bits_to_f32(f32_to_bf16_bits(f)); }

// IEEE half <-> f32 (round to nearest even, overflow to inf).
uint16_t f32_to_f16_bits(float f);
float f16_bits_to_f32(uint16_t h);

// f stored as element i of dst, an array of type t (f32; f64 widened; bf16/f16 rounded to
// nearest even); any other t is the caller's error. For files written in a chosen type.
inline void store_f32_as(float f, DType t, void* dst, size_t i) {
  auto* p = static_cast<uint8_t*>(dst);
  if (t == DType::f32) {
    std::memcpy(p + 4 * i, &f, 4);
  } else if (t == DType::f64) {
    const double d = f;
    std::memcpy(p + 8 * i, &d, 8);
  } else {
    const uint16_t b = t == DType::bf16 ? f32_to_bf16_bits(f) : f32_to_f16_bits(f);
    std::memcpy(p + 2 * i, &b, 2);
  }
}

// `count` elements of src (f32, f64 or bf16) stored into dst as `dst_dtype` (f32, f64, bf16 or
// f16) through f32, as store_f32_as does (f64 narrowed, bf16 widened exactly), over the CPU's
// threads for large counts; a plain copy when the types match. download_as's conversion, and
// checkpoints' and weights files' conversions on the host.
void convert_elements(const void* src, DType src_dtype, size_t count, DType dst_dtype, void* dst);

}  // namespace flux8

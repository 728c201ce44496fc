#pragma once
// FP8 element formats and their conversions to and from f32/bf16 (docs/FP8.md, Formats), header-only
// and FLUX8_HD so that CUDA kernels and the CPU reference run the very same bit arithmetic.
//
//   E4M3 (float8_e4m3fn): bias 7, no inf, NaN = S.1111.111, max 448, min subnormal 2^-9.
//   E5M2 (float8_e5m2):   bias 15, IEEE-like (inf = S.11111.00), max 57344, min subnormal 2^-16.
//   E8M0 (float8_e8m0fnu, MX block scales): 2^(v-127), v = 0..254; 0xFF = NaN; no zero, no sign.
//
// fp8_encode (Transformer Engine's cast semantics, bit-exact with ml_dtypes on clip(x,-max,max)):
//   round to nearest, ties to even, on the exact input value (subnormal results included);
//   |x| >= max (±inf included) saturates to ±max; values below half the smallest subnormal
//   become ±0 (a tie at exactly half goes to the even code, 0); -0 stays -0 (0x80);
//   NaN -> NaN with the input's sign: E4M3 0x7F/0xFF, E5M2 the quiet NaN 0x7E/0xFE (any
//   payload; ml_dtypes keeps some NaN payload bits, so NaNs are compared as "is NaN").
// fp8_decode is exact (every FP8 value is an f32); NaN codes decode to a quiet f32 NaN with the
// code's sign, E5M2 ±inf to ±inf.
//
// Everything is integer arithmetic on bit patterns: no float rounding mode, FTZ or fast-math
// setting can change a result, and the f32 and bf16 entry points share one implementation
// parameterised by the source mantissa width (bf16 is f32 with 16 fewer mantissa bits).
#include <cstdint>
#include <optional>
#include <string_view>

#include "core/dtype.h"  // FLUX8_HD

namespace flux8 {

enum class Fp8Format : uint8_t { e4m3, e5m2 };

inline constexpr float kE4M3Max = 448.0f, kE5M2Max = 57344.0f;

FLUX8_HD constexpr float fp8_max(Fp8Format f) { return f == Fp8Format::e4m3 ? kE4M3Max : kE5M2Max; }

FLUX8_HD constexpr const char* fp8_format_name(Fp8Format f) { return f == Fp8Format::e4m3 ? "e4m3" : "e5m2"; }

// Config values "e4m3" / "e5m2" (exact, lower case); anything else -> nullopt (host only).
constexpr std::optional<Fp8Format> parse_fp8_format(std::string_view s) {
  if (s == "e4m3") return Fp8Format::e4m3;
  if (s == "e5m2") return Fp8Format::e5m2;
  return std::nullopt;
}

namespace fp8_detail {

// Bit casts without memcpy (device: intrinsics; host: the compiler builtin behind std::bit_cast).
#if defined(__CUDA_ARCH__)
FLUX8_HD inline uint32_t bits_of(float x) { return __float_as_uint(x); }
FLUX8_HD inline float float_of(uint32_t u) { return __uint_as_float(u); }
#else
FLUX8_HD inline uint32_t bits_of(float x) { return __builtin_bit_cast(uint32_t, x); }
FLUX8_HD inline float float_of(uint32_t u) { return __builtin_bit_cast(float, u); }
#endif

// Format parameters: M mantissa bits, exponent bias B, largest finite magnitude code, NaN code.
struct Fp8Params {
  int mant_bits, bias;
  uint32_t max_code, nan_code;
};
FLUX8_HD constexpr Fp8Params params(Fp8Format f) {
  return f == Fp8Format::e4m3 ? Fp8Params{3, 7, 0x7Eu, 0x7Fu} : Fp8Params{2, 15, 0x7Bu, 0x7Eu};
}

// Encodes a binary float with an 8-bit exponent of bias 127 (f32: src_mant = 23; bf16: 7) given
// as its bit pattern. `max_abs_bits` is fp8_max in the same source layout.
template <int src_mant>
FLUX8_HD inline uint8_t encode_bits(uint32_t bits, Fp8Params p, uint32_t max_abs_bits) {
  constexpr int sign_shift = src_mant + 8;
  constexpr uint32_t abs_mask = (1u << sign_shift) - 1u;
  constexpr uint32_t inf_bits = 0xFFu << src_mant;
  const uint32_t sign = (bits >> sign_shift) << 7;
  const uint32_t a = bits & abs_mask;
  if (a > inf_bits) return static_cast<uint8_t>(sign | p.nan_code);
  if (a >= max_abs_bits) return static_cast<uint8_t>(sign | p.max_code);  // saturate, inf too
  const int e = static_cast<int>(a >> src_mant);                          // biased source exponent (0: zero/subnormal)
  const int min_normal_e = 127 - p.bias + 1;                              // source exponent of FP8's smallest normal
  const int shift = src_mant - p.mant_bits;
  uint32_t q, rem, half;
  if (e >= min_normal_e) {
    // FP8 normal: drop `shift` mantissa bits and rebias; a carry out of the mantissa bumps the
    // exponent, which is the correct rounding up to the next binade (never past max: a < max).
    q = a >> shift;
    rem = a & ((1u << shift) - 1u);
    half = 1u << (shift - 1);
    q -= static_cast<uint32_t>(127 - p.bias) << p.mant_bits;
  } else {
    // FP8 subnormal or zero: code = RNE(x / 2^(1-B-M)) with x = mant * 2^(max(e,1)-127-src_mant).
    const uint32_t mant = (a & ((1u << src_mant) - 1u)) | (e > 0 ? 1u << src_mant : 0u);
    const int s = shift + min_normal_e - (e > 0 ? e : 1);     // >= shift + 1
    if (s > src_mant + 1) return static_cast<uint8_t>(sign);  // x < half the min subnormal
    q = mant >> s;
    rem = mant & ((1u << s) - 1u);
    half = 1u << (s - 1);
  }
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint8_t>(sign | q);
}

// A positive finite f32 as (biased exponent, 24-bit significand with its leading 1 at bit 23);
// subnormals are normalised (exponent <= 0).
FLUX8_HD inline void split_positive(uint32_t b, int& exp, uint32_t& sig) {
  exp = static_cast<int>(b >> 23);
  sig = b & 0x7FFFFFu;
  if (exp != 0) {
    sig |= 0x800000u;
    return;
  }
  exp = 1;
  while (!(sig & 0x800000u)) {
    sig <<= 1;
    --exp;
  }
}

FLUX8_HD constexpr uint32_t max_f32_bits(Fp8Format f) {
  return f == Fp8Format::e4m3 ? 0x43E00000u : 0x47600000u;  // 448.0f, 57344.0f
}

}  // namespace fp8_detail

FLUX8_HD inline uint8_t fp8_encode(float x, Fp8Format f) {
  return fp8_detail::encode_bits<23>(fp8_detail::bits_of(x), fp8_detail::params(f), fp8_detail::max_f32_bits(f));
}
// Same result as fp8_encode(bf16_bits_to_f32(b), f), computed on the 16-bit pattern.
FLUX8_HD inline uint8_t fp8_encode_bf16(uint16_t bf16_bits, Fp8Format f) {
  return fp8_detail::encode_bits<7>(bf16_bits, fp8_detail::params(f), fp8_detail::max_f32_bits(f) >> 16);
}

FLUX8_HD inline float fp8_decode(uint8_t v, Fp8Format f) {
  const fp8_detail::Fp8Params p = fp8_detail::params(f);
  const uint32_t sign = static_cast<uint32_t>(v >> 7) << 31;
  const uint32_t a = v & 0x7Fu;
  const uint32_t e = a >> p.mant_bits, m = a & ((1u << p.mant_bits) - 1u);
  const uint32_t e_all_ones = (1u << (7 - p.mant_bits)) - 1u;
  if (f == Fp8Format::e4m3 ? a == 0x7Fu : e == e_all_ones)
    return fp8_detail::float_of(sign | (f == Fp8Format::e5m2 && m == 0 ? 0x7F800000u : 0x7FC00000u));
  if (e == 0) {
    // Subnormal m * 2^(1-B-M): an exact product of a small integer and a normal power of two.
    const float ulp = fp8_detail::float_of(static_cast<uint32_t>(127 + 1 - p.bias - p.mant_bits) << 23);
    const float mag = static_cast<float>(m) * ulp;
    return fp8_detail::float_of(sign | fp8_detail::bits_of(mag));
  }
  return fp8_detail::float_of(sign | ((e + 127 - p.bias) << 23) | (m << (23 - p.mant_bits)));
}

FLUX8_HD inline uint8_t e4m3_encode(float x) { return fp8_encode(x, Fp8Format::e4m3); }
FLUX8_HD inline uint8_t e5m2_encode(float x) { return fp8_encode(x, Fp8Format::e5m2); }
FLUX8_HD inline float e4m3_decode(uint8_t v) { return fp8_decode(v, Fp8Format::e4m3); }
FLUX8_HD inline float e5m2_decode(uint8_t v) { return fp8_decode(v, Fp8Format::e5m2); }

// ---- E8M0 -------------------------------------------------------------------------------------

// 2^(v-127). v = 0 is 2^-127, an f32 subnormal (0x00400000): code that runs with flush-to-zero
// sees it as 0 once it does arithmetic on it.
FLUX8_HD inline float e8m0_decode(uint8_t v) {
  if (v == 0xFFu) return fp8_detail::float_of(0x7FC00000u);
  if (v == 0) return fp8_detail::float_of(0x00400000u);
  return fp8_detail::float_of(static_cast<uint32_t>(v) << 23);
}

// The generic f32 -> E8M0 conversion, bit-exact with ml_dtypes' float8_e8m0fnu cast on every
// f32 input (checked exhaustively over all 2^32 patterns with ml_dtypes 0.7.0):
//   x rounds to the nearest power of two in linear terms, ties (x = 1.5·2^k) rounding UP, not
//   to even. For a normal x = 2^(E-127)·1.m that is E, plus 1 when the mantissa is >= 1/2;
//     a result past 2^127 (x >= 1.5·2^127) is NaN (0xFF) — E8M0 has no inf, this cast does not
//     saturate;
//   f32 subnormals follow the same rule: x < 1.5·2^-127 (0x00600000) -> 0 (2^-127, the smallest
//     code, so every tinier x lands there too), 1.5·2^-127 <= x < 2^-126 -> 1 (2^-126).
//     ml_dtypes before 0.7 sent every subnormal above 2^-127 up to 2^-126; 0.7 rounds them to
//     nearest like the normals, and so does flux8 (the uniform rule);
//   +-0, negatives, +-inf and NaN -> 0xFF (no zero, no sign, no inf in E8M0).
// MX scales do not use this: see e8m0_scale_for_amax.
FLUX8_HD inline uint8_t e8m0_encode(float x) {
  const uint32_t b = fp8_detail::bits_of(x);
  if (b == 0 || b >= 0x7F800000u) return 0xFFu;  // +0, +inf, NaN and every negative
  const uint32_t e = b >> 23;
  if (e == 0) return b >= 0x00600000u ? 1u : 0u;
  const uint32_t v = e + ((b >> 22) & 1u);
  return v > 254u ? 0xFFu : static_cast<uint8_t>(v);
}

// MX block scale (OCP MX, docs/FP8.md: exponent of amax/fp8_max rounded up): the E8M0 code of
// 2^e with e = ceil(log2(amax / fp8_max_value)), the smallest e with amax / 2^e <= fp8_max_value,
// computed exactly from the two exponents and mantissas (no rounded division). Then:
//   e clamped to [-127, 127]: below, 2^-127 still satisfies the bound; above, the block's
//     largest elements saturate in the cast;
//   amax == 0 (a block of zeros) -> 2^0 (code 127): any scale encodes zeros, and 2^0 keeps the
//     dequantisation scale and its inverse normal numbers (TE would give 2^-127, a subnormal
//     that flush-to-zero code turns into 0 and whose inverse it turns into inf);
//   amax NaN or inf -> 0xFF (NaN scale: the block is unrepresentable);
//   the sign of amax is ignored; fp8_max_value must be positive and finite, else 0xFF.
FLUX8_HD inline uint8_t e8m0_scale_for_amax(float amax, float fp8_max_value) {
  const uint32_t a = fp8_detail::bits_of(amax) & 0x7FFFFFFFu;
  const uint32_t m = fp8_detail::bits_of(fp8_max_value);
  if (a >= 0x7F800000u || m == 0 || m >= 0x7F800000u) return 0xFFu;  // also m negative
  if (a == 0) return 127u;
  int ea, em;
  uint32_t sa, sm;
  fp8_detail::split_positive(a, ea, sa);
  fp8_detail::split_positive(m, em, sm);
  // amax <= fp8_max·2^e  <=>  sa·2^ea <= sm·2^(em+e)  <=>  e >= ea - em + (sa > sm).
  int e = ea - em + (sa > sm ? 1 : 0);
  if (e < -127) e = -127;
  if (e > 127) e = 127;
  return static_cast<uint8_t>(e + 127);
}

}  // namespace flux8

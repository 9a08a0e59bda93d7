// Scalar helpers the C++ CPU kernels share: dtype <-> fp32 conversions and a vectorizable e^x.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace tsukimi_kernels {

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x.x) << 16); }

// float -> the dtype, rounding to nearest even; for bf16 branch-free (so the loops vectorize), NaN kept a NaN.
template <typename scalar_t>
inline scalar_t from_float(float x) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const uint32_t bits = __builtin_bit_cast(uint32_t, x);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return c10::BFloat16(static_cast<uint16_t>((bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded),
                         c10::BFloat16::from_bits());
  } else {
    return static_cast<scalar_t>(x);
  }
}

// e^x, x below -87 taken as -87 (e^x ~ 0), above 88 infinity (as expf overflows): x = k ln2 + r with |r| <= ln2 / 2,
// e^r by its Taylor polynomial to degree 7 (relative error below 1e-7), 2^k through the exponent bits. Branch-free
// (k rounded by adding and subtracting 1.5 * 2^23, not std::floor), so the loops calling it vectorize.
inline float exp_clamped(float x_in) {
  const float x = std::min(std::max(x_in, -87.0f), 88.0f);
  constexpr float kRound = 12582912.0f;
  const float k = (x * 1.44269504088896341f + kRound) - kRound;
  const float r = (x - k * 0.693145751953125f) - k * 1.428606765330187045e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float result = p * __builtin_bit_cast(float, (static_cast<int32_t>(k) + 127) << 23);
  return x_in > 88.0f ? std::numeric_limits<float>::infinity() : result;
}

}  // namespace tsukimi_kernels

// float16 / bfloat16 <-> float32 conversions for the user-defined MPI ops.
//
// MPI has no 16-bit floating point types, so mpijax reduces them with
// MPI_Op_create'd functions that widen each pair of operands to float,
// combine, and round back to nearest-even. Written out by hand (rather than
// _Float16) so the build does not depend on compiler support for it.
#ifndef MPIJAX_FFI_HALF_H_
#define MPIJAX_FFI_HALF_H_

#include <cstdint>
#include <cstring>

namespace mpijax::detail {

inline float BitsToFloat(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint32_t FloatToBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

inline float Bf16ToFloat(uint16_t h) { return BitsToFloat(uint32_t{h} << 16); }

inline uint16_t FloatToBf16(float f) {
  uint32_t bits = FloatToBits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it quiet and a NaN.
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);  // nearest-even
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

inline float F16ToFloat(uint16_t h) {
  uint32_t sign = uint32_t{h & 0x8000u} << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) {  // inf / nan
    return BitsToFloat(sign | 0x7f800000u | (mant << 13));
  }
  if (exp == 0) {
    if (mant == 0) return BitsToFloat(sign);
    // Subnormal: value = mant * 2^-24.
    float f = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return sign ? -f : f;
  }
  return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t FloatToF16(float f) {
  uint32_t bits = FloatToBits(f);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // nan
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to inf (>= 65520)
  if (abs < 0x38800000u) {                        // below 2^-14: subnormal or 0
    // Round abs * 2^24 to nearest-even integer.
    float scaled = BitsToFloat(abs) * 16777216.0f;
    uint32_t mant = static_cast<uint32_t>(scaled);
    float rem = scaled - static_cast<float>(mant);
    if (rem > 0.5f || (rem == 0.5f && (mant & 1u))) ++mant;
    return sign | static_cast<uint16_t>(mant);
  }
  // Normal: rebias exponent, round mantissa from 23 to 10 bits, nearest-even.
  uint32_t v = abs - 0x38000000u;  // exponent bias 127 -> 15
  uint32_t round = 0xfffu + ((v >> 13) & 1u);
  v += round;
  return sign | static_cast<uint16_t>(v >> 13);
}

}  // namespace mpijax::detail

#endif  // MPIJAX_FFI_HALF_H_

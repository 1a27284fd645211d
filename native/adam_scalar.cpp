// Portable Adam kernel: any x86-64 (or other) CPU, and the tails of the
// vector kernels. Conversions are done in integer arithmetic so that they
// round exactly as torch's Tensor.to(bfloat16 / float16) does.
#include "adam_loop.h"
#include "float_bits.h"

namespace offload_native {
namespace {

// Round to nearest even; NaN becomes 0xffff, as torch's vectorised conversion writes it.
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffff;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// IEEE binary16, round to nearest even, overflow to infinity.
inline uint16_t float_to_f16(float f) {
  const uint32_t u = bits_of(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00 | static_cast<uint16_t>((a & 0x7fffffu) >> 13);  // NaN: quiet, payload kept (as F16C)
  if (a >= 0x477ff000u) return sign | 0x7c00;    // >= 65520 rounds to infinity
  if (a < 0x38800000u) {                         // below 2^-14: subnormal half
    if (a <= 0x33000000u) return sign;           // <= 2^-25 rounds to zero
    const uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    const int shift = 126 - static_cast<int>(a >> 23);  // 14..24
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return sign | static_cast<uint16_t>(q);
  }
  uint32_t h = (((a >> 23) - 112u) << 10) | ((a & 0x7fffffu) >> 13);
  const uint32_t rem = a & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry bumps the exponent
  return sign | static_cast<uint16_t>(h);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-08f;  // exact: mant * 2^-24
    return float_of(bits_of(mag) | sign);
  }
  if (exp == 31) return float_of(sign | 0x7f800000u | (mant << 13));
  return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
}

struct Scalar {
  using Vec = float;
  static constexpr int64_t kWidth = 1;
  static constexpr bool kStochastic = true;
  // Note [stochastic rounding]
  static Vec round_stochastic(Vec x, uint32_t key, uint32_t index) {
    const uint32_t u = bits_of(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return x;
    return float_of((u + (mix32(key ^ mix32(index)) & 0xffffu)) & 0xffff0000u);
  }
  static Vec set1(float x) { return x; }
  static Vec load(const float* p) { return *p; }
  static Vec load_grad(const float* p) { return *p; }
  static Vec load_grad(const BF16* p) { return float_of(static_cast<uint32_t>(p->bits) << 16); }
  static Vec load_grad(const F16* p) { return f16_to_float(p->bits); }
  static void store(float* p, Vec x) { *p = x; }
  template <bool kStream>
  static void store_out(BF16* p, Vec x) { p->bits = float_to_bf16(x); }
  template <bool kStream>
  static void store_out(F16* p, Vec x) { p->bits = float_to_f16(x); }
  static void fence() {}
  static Vec add(Vec a, Vec b) { return a + b; }
  static Vec sub(Vec a, Vec b) { return a - b; }
  static Vec mul(Vec a, Vec b) { return a * b; }
  static Vec div(Vec a, Vec b) { return a / b; }
  static Vec sqrt(Vec a) { return __builtin_sqrtf(a); }
};

}  // namespace

void adam_range_scalar(const AdamBuffers& b, const AdamConsts& c, int64_t begin, int64_t end) {
  adam_dispatch<Scalar>(b, c, begin, end);
}

}  // namespace offload_native

// The codes of Note [8-bit moments].
#include "moment_codec.h"

#include <algorithm>
#include <cfloat>
#include <cmath>

#include "float_bits.h"

namespace offload_native {
namespace {

// Branch-free and table-free, so that the loops below vectorize.
struct Code {
  int mantissa_bits;
  int32_t top;  // the largest code, standing for 1.0
  int32_t base() const { return (127 << mantissa_bits) - top; }
  float value(int32_t c) const {
    const float v = float_of(static_cast<uint32_t>(c + base()) << (23 - mantissa_bits));
    return c == 0 ? 0.0f : v;
  }
  // r >= 0 (or NaN, which lands on top): its nearest code, at least `lowest`.
  int32_t of(float r, int32_t lowest) const {
    const int shift = 23 - mantissa_bits;
    const int32_t bits = static_cast<int32_t>(bits_of(r) & 0x7fffffffu);
    const int32_t k = (bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) >> shift;
    return std::min(std::max(k - base(), lowest), top);
  }
};

constexpr Code kMoment{3, 127};
constexpr Code kRoot{4, 255};

// The block's scale: its largest |x|, NaN if it holds a NaN. The bits of
// floats without their sign order as the floats do, NaN above all, so an
// integer maximum finds it (and vectorizes, where a float one may not).
float block_scale(const float* x, int64_t len) {
  uint32_t largest = 0;
  for (int64_t j = 0; j < len; ++j) largest = std::max(largest, bits_of(x[j]) & 0x7fffffffu);
  return float_of(largest);
}

float inverse(float scale) { return scale >= FLT_MIN ? 1.0f / scale : 0.0f; }

}  // namespace

// Plain loops the compiler vectorizes; target_clones builds them for each ISA
// and picks the clone at load time, as the CPU allows.
#define OFFLOAD_CODEC_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

OFFLOAD_CODEC_CLONES void decode_moments(const uint8_t* m_codes, float m_scale, const uint8_t* s_codes, float s_scale, int64_t len,
                    float* exp_avg, float* exp_avg_sq) {
  for (int64_t j = 0; j < len; ++j) {
    const uint32_t m = bits_of(m_scale * kMoment.value(m_codes[j] & 0x7f));
    exp_avg[j] = float_of(m ^ (static_cast<uint32_t>(m_codes[j] & 0x80) << 24));
    const float s = s_scale * kRoot.value(s_codes[j]);
    exp_avg_sq[j] = s * s;
  }
}

OFFLOAD_CODEC_CLONES void encode_moments(const float* exp_avg, float* exp_avg_sq, int64_t len, uint8_t* m_codes, float* m_scale,
                    uint8_t* s_codes, float* s_scale) {
  *m_scale = block_scale(exp_avg, len);
  const float m_inv = inverse(*m_scale);
  for (int64_t j = 0; j < len; ++j) {
    const uint32_t sign = (bits_of(exp_avg[j]) >> 31) << 7;
    m_codes[j] = static_cast<uint8_t>(sign | kMoment.of(std::fabs(exp_avg[j]) * m_inv, 0));
  }
  for (int64_t j = 0; j < len; ++j) exp_avg_sq[j] = __builtin_sqrtf(exp_avg_sq[j]);
  *s_scale = block_scale(exp_avg_sq, len);
  const float s_inv = inverse(*s_scale);
  for (int64_t j = 0; j < len; ++j) {
    const float s = exp_avg_sq[j];
    const int32_t code = kRoot.of(s * s_inv, 1);
    const int32_t positive = static_cast<int32_t>(bits_of(s)) > 0;  // s > 0, or NaN
    s_codes[j] = static_cast<uint8_t>(code & -positive);
  }
}

}  // namespace offload_native

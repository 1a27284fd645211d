// CRC-32C by folding, written once and instantiated per ISA: V supplies the
// register type and its operations; see crc_fold_avx512.cpp, crc_fold_avx2.cpp.
// Internal linkage throughout, as in adam_loop.h: each is compiled for its
// own target.
//
// Note [folding]
// Read as a polynomial over GF(2), the data's CRC register is its remainder
// modulo P (times x^32), so any part of it may be replaced by something
// congruent. A 128-bit lane A that lies d bits before lane B becomes
// A_hi x^(d+64) + A_lo x^d, with both powers reduced modulo P to 32 bits, and
// is added into B: a lane less, same remainder. Four registers of lanes
// (sixteen lanes with AVX-512, eight with AVX2) are folded a whole stride
// ahead at once, then into each other, then one register ahead over the whole
// registers left, then the lanes of that register into each other and one lane
// ahead over the whole lanes left, leaving one lane X before a tail of r < 16
// bytes; the register of X followed by the tail is the register of the data,
// which the crc32 instruction finishes. In the bit-reflected order of the data, lane
// bit i holds x^(127-i): a 64-bit half times the constant (x^(e-1) mod P) << 32
// lands on the lane's bits of x^e times it, the missing x coming from the
// carry-less product's one-bit offset.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "crc32c.h"

namespace offload_native {
namespace {

// The multipliers that fold a lane d bits ahead: of its low half (its high powers) and of its high half.
inline __m128i fold_key(uint64_t d) {
  return _mm_set_epi64x(static_cast<int64_t>(static_cast<uint64_t>(crc32c_x_pow(d - 1)) << 32),
                        static_cast<int64_t>(static_cast<uint64_t>(crc32c_x_pow(d + 63)) << 32));
}

inline __m128i fold_lane(__m128i a, __m128i key, __m128i next) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(a, key, 0x00), _mm_clmulepi64_si128(a, key, 0x11)), next);
}

template <class V>
uint32_t fold_crc(const uint8_t* p, size_t n, uint32_t reg) {
  using Vec = typename V::Vec;
  constexpr size_t kBytes = sizeof(Vec);
  static const __m128i stride_key = fold_key(4 * 8 * kBytes), register_key = fold_key(8 * kBytes),
                       lane_key = fold_key(128);
  const Vec stride = V::broadcast(stride_key), one = V::broadcast(register_key);
  Vec a0 = V::with_register(V::load(p), reg), a1 = V::load(p + kBytes), a2 = V::load(p + 2 * kBytes),
      a3 = V::load(p + 3 * kBytes);
  for (p += 4 * kBytes, n -= 4 * kBytes; n >= 4 * kBytes; p += 4 * kBytes, n -= 4 * kBytes) {
    a0 = V::fold(a0, stride, V::load(p));
    a1 = V::fold(a1, stride, V::load(p + kBytes));
    a2 = V::fold(a2, stride, V::load(p + 2 * kBytes));
    a3 = V::fold(a3, stride, V::load(p + 3 * kBytes));
  }
  a3 = V::fold(V::fold(V::fold(a0, one, a1), one, a2), one, a3);
  for (; n >= kBytes; p += kBytes, n -= kBytes) a3 = V::fold(a3, one, V::load(p));
  __m128i x = V::fold_lanes(a3, lane_key);
  for (; n >= 16; p += 16, n -= 16) x = fold_lane(x, lane_key, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  uint64_t c = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(x)));
  c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(x, 1)));
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
  }
  auto c32 = static_cast<uint32_t>(c);
  for (; n > 0; ++p, --n) c32 = _mm_crc32_u8(c32, *p);
  return c32;
}

}  // namespace
}  // namespace offload_native

// CRC-32C folding with 256-bit registers (Note [folding] in crc_fold.h), for
// x86-64 CPUs with AVX2 and VPCLMULQDQ but no AVX-512 (AMD Zen 3). Compiled
// for that target only; crc32c.cpp calls it after checking the CPU at run time.
#pragma GCC target("avx2,vpclmulqdq,pclmul,sse4.2")
#include "crc_fold.h"

namespace offload_native {
namespace {

struct Avx2 {
  using Vec = __m256i;
  static Vec load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static Vec broadcast(__m128i lane) { return _mm256_broadcastsi128_si256(lane); }
  static Vec with_register(Vec a, uint32_t reg) {
    return _mm256_xor_si256(a, _mm256_zextsi128_si256(_mm_cvtsi32_si128(static_cast<int>(reg))));
  }
  static Vec fold(Vec a, Vec key, Vec next) {
    return _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128(a, key, 0x00),
                                             _mm256_clmulepi64_epi128(a, key, 0x11)), next);
  }
  static __m128i fold_lanes(Vec a, __m128i lane_key) {
    return fold_lane(_mm256_castsi256_si128(a), lane_key, _mm256_extracti128_si256(a, 1));
  }
};

}  // namespace

uint32_t crc_fold_avx2(const uint8_t* p, size_t n, uint32_t reg) { return fold_crc<Avx2>(p, n, reg); }

}  // namespace offload_native

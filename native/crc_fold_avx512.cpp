// CRC-32C folding with 512-bit registers (Note [folding] in crc_fold.h), for
// x86-64 CPUs with AVX-512F and VPCLMULQDQ. Compiled for that target only;
// crc32c.cpp calls it after checking the CPU at run time.
#pragma GCC target("avx512f,vpclmulqdq,pclmul,sse4.2")
#include "crc_fold.h"

namespace offload_native {
namespace {

struct Avx512 {
  using Vec = __m512i;
  static Vec load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static Vec broadcast(__m128i lane) { return _mm512_broadcast_i32x4(lane); }
  static Vec with_register(Vec a, uint32_t reg) {
    return _mm512_xor_si512(a, _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(reg))));
  }
  static Vec fold(Vec a, Vec key, Vec next) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a, key, 0x00), _mm512_clmulepi64_epi128(a, key, 0x11),
                                     next, 0x96);  // a ^ b ^ c
  }
  static __m128i fold_lanes(Vec a, __m128i lane_key) {
    __m128i x = fold_lane(_mm512_extracti32x4_epi32(a, 0), lane_key, _mm512_extracti32x4_epi32(a, 1));
    x = fold_lane(x, lane_key, _mm512_extracti32x4_epi32(a, 2));
    return fold_lane(x, lane_key, _mm512_extracti32x4_epi32(a, 3));
  }
};

}  // namespace

uint32_t crc_fold_avx512(const uint8_t* p, size_t n, uint32_t reg) { return fold_crc<Avx512>(p, n, reg); }

}  // namespace offload_native

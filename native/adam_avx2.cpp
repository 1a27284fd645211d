// AVX2 Adam kernel (8 lanes), for x86-64 CPUs with AVX2 and F16C. Compiled for
// that target only; adam.cpp calls it after checking the CPU at run time.
#pragma GCC target("avx2,f16c")
#include <immintrin.h>

#include "adam_loop.h"

namespace offload_native {
namespace {

struct Avx2 {
  using Vec = __m256;
  static constexpr int64_t kWidth = kAvx2Width;
  static constexpr bool kStochastic = true;
  static __m256i mix32(__m256i x) {  // Note [stochastic rounding], per lane
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846ca68bu)));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  }
  static Vec round_stochastic(Vec x, uint32_t key, uint32_t index) {
    const __m256i lanes = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(index)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i noise = _mm256_and_si256(mix32(_mm256_xor_si256(_mm256_set1_epi32(static_cast<int>(key)), mix32(lanes))),
                                           _mm256_set1_epi32(0xffff));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_castps_si256(x), noise),
                                       _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  // NaN stays NaN
  }
  static Vec set1(float x) { return _mm256_set1_ps(x); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static Vec load_grad(const float* p) { return _mm256_loadu_ps(p); }
  static Vec load_grad(const BF16* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static Vec load_grad(const F16* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(float* p, Vec x) { _mm256_storeu_ps(p, x); }
  template <bool kStream>
  static void put(void* p, __m128i x) {
    if constexpr (kStream) _mm_stream_si128(static_cast<__m128i*>(p), x);
    else _mm_storeu_si128(static_cast<__m128i*>(p), x);
  }
  static void fence() { _mm_sfence(); }
  template <bool kStream>
  static void store_out(BF16* p, Vec x) {
    // Round to nearest even in integers; NaN lanes become 0xffff (see adam_scalar.cpp).
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xffff), _mm256_castps_si256(is_nan));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
    put<kStream>(p, _mm256_castsi256_si128(packed));
  }
  template <bool kStream>
  static void store_out(F16* p, Vec x) {
    put<kStream>(p, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  static Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
  static Vec sqrt(Vec a) { return _mm256_sqrt_ps(a); }
};

}  // namespace

void adam_range_avx2(const AdamBuffers& b, const AdamConsts& c, int64_t begin, int64_t end) {
  adam_dispatch<Avx2>(b, c, begin, end);
}

}  // namespace offload_native

// AVX-512 Adam kernel (16 lanes), for x86-64 CPUs with AVX-512F. Compiled for
// that target only; adam.cpp calls it after checking the CPU at run time.
#pragma GCC target("avx512f")
#include <immintrin.h>

#include "adam_loop.h"

namespace offload_native {
namespace {

struct Avx512 {
  using Vec = __m512;
  static constexpr int64_t kWidth = kAvx512Width;
  static constexpr bool kStochastic = false;  // bf16 master weights run on the AVX2 kernel (adam.cpp)
  static Vec set1(float x) { return _mm512_set1_ps(x); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec load_grad(const float* p) { return _mm512_loadu_ps(p); }
  static Vec load_grad(const BF16* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static Vec load_grad(const F16* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, Vec x) { _mm512_storeu_ps(p, x); }
  template <bool kStream>
  static void put(void* p, __m256i x) {
    if constexpr (kStream) _mm256_stream_si256(static_cast<__m256i*>(p), x);
    else _mm256_storeu_si256(static_cast<__m256i*>(p), x);
  }
  static void fence() { _mm_sfence(); }
  template <bool kStream>
  static void store_out(BF16* p, Vec x) {
    // Round to nearest even in integers; NaN lanes become 0xffff (see adam_scalar.cpp).
    // Not vcvtneps2bf16: it flushes denormal inputs to zero, torch does not.
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(is_nan, r, _mm512_set1_epi32(0xffff));
    put<kStream>(p, _mm512_cvtepi32_epi16(r));
  }
  template <bool kStream>
  static void store_out(F16* p, Vec x) {
    put<kStream>(p, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  static Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
  static Vec sqrt(Vec a) { return _mm512_sqrt_ps(a); }
};

}  // namespace

void adam_range_avx512(const AdamBuffers& b, const AdamConsts& c, int64_t begin, int64_t end) {
  adam_dispatch<Avx512>(b, c, begin, end);
}

}  // namespace offload_native

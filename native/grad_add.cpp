// Note [adding a gradient part]
// dst (float32) += src (bfloat16 or float16), element by element, in
// one pass at memory speed: the owned gradient taking a micro-batch's part
// under accumulation (offload/optim/grad_add.py). Each result is one float32
// addition of two floats (a 16-bit value widens to float exactly), as
// PyTorch's dst.add_(src) computes it, so that call is the fallback, bit for
// bit. PyTorch widens a bfloat16 operand element by element on a generic
// path: its mixed add took about 5x the time of this pass on 2 Zen 2 cores,
// which runs as fast as a float32 add (benchmarks/grad_add.py).
#include <immintrin.h>

#include <cstdint>

#include "errors.h"
#include "float_bits.h"
#include "parallel.h"

using offload_native::bits_of;
using offload_native::fail;
using offload_native::float_of;

namespace {

// IEEE half to float, exactly: normal numbers and Inf/NaN move their exponent
// and mantissa into place and rebias; zeros and subnormals are their mantissa
// times 2^-24, exact in float. Written without branches so that it could
// vectorise; GCC 12 does not (1.5x PyTorch's speed only), hence F16C below.
inline float half_to_float(uint16_t h) {
  const uint32_t em = static_cast<uint32_t>(h) & 0x7fffu;
  uint32_t bits = (em << 13) + (uint32_t{127 - 15} << 23);
  bits = em >= 0x7c00u ? bits + (uint32_t{128 - 16} << 23) : bits;
  const float magnitude = em < 0x0400u ? static_cast<float>(em) * 0x1p-24f : float_of(bits);
  return float_of(bits_of(magnitude) | ((static_cast<uint32_t>(h) & 0x8000u) << 16));
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void add_bf16(float* dst, const uint16_t* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += float_of(static_cast<uint32_t>(src[i]) << 16);
}

void add_f16_scalar(float* dst, const uint16_t* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += half_to_float(src[i]);
}

// The F16C instruction widens 8 halves at once.
__attribute__((target("avx2,f16c")))
void add_f16_f16c(float* dst, const uint16_t* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 part = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(dst + i), part));
  }
  add_f16_scalar(dst + i, src + i, n - i);
}

void add_f16(float* dst, const uint16_t* src, int64_t n) {
  static const bool f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  (f16c ? add_f16_f16c : add_f16_scalar)(dst, src, n);
}

}  // namespace

// dtype of src: 1 bfloat16, 2 float16 (as the Adam kernel's codes); a float32
// part is PyTorch's own add, which runs at memory speed.
OFFLOAD_API int offload_grad_add(float* dst, const uint16_t* src, int dtype, int64_t n, int threads) {
  if (n < 0 || threads < 0) return fail("grad_add: n and threads must be >= 0");
  if (n > 0 && (dst == nullptr || src == nullptr)) return fail("grad_add: null pointer");
  if (dtype != 1 && dtype != 2) return fail("grad_add: dtype must be 1 (bfloat16) or 2 (float16), got %d", dtype);
  // 64 KiB of float32 per thread at least; ranges aligned to a cache line of it.
  offload_native::parallel_ranges(n, threads, int64_t{1} << 14, 16, [&](int64_t begin, int64_t end) {
    (dtype == 1 ? add_bf16 : add_f16)(dst + begin, src + begin, end - begin);
  });
  return 0;
}

// STREAM-style memory bandwidth probes (McCalpin's copy and triad), so that the
// Adam benchmark can state its speed as a fraction of what this machine's
// memory delivers in the same run. Timing is done by the caller.
//
// Stores are non-temporal (SSE2, present on every x86-64 CPU): a plain
// store to a line not in cache first reads it (write-allocate), so STREAM's
// byte count (one read + one write for copy) would understate the traffic and
// the probe would report less than the memory delivers.
#include <emmintrin.h>

#include <cstdint>

#include "errors.h"
#include "parallel.h"
#include "stream_store.h"

using offload_native::fail;

namespace {

// Big enough that each thread streams well past its caches.
constexpr int64_t kMinPerThread = 1 << 15;

int check(const char* what, const float* dst, const float* src, int64_t n, int threads) {
  if (n < 0) return fail("%s: n must be >= 0", what);
  if (threads < 0) return fail("%s: threads must be >= 0", what);
  if (n > 0 && (dst == nullptr || src == nullptr)) return fail("%s: null pointer", what);
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0) return fail("%s: destination must be 16-byte aligned", what);
  return 0;
}

}  // namespace

OFFLOAD_API int offload_stream_copy(float* dst, const float* src, int64_t n, int threads) {
  if (check("stream_copy", dst, src, n, threads) != 0) return -1;
  offload_native::parallel_ranges(n, threads, kMinPerThread, 4, [=](int64_t begin, int64_t end) {
    offload_native::stream_copy_bytes(dst + begin, src + begin, (end - begin) * sizeof(float));
    _mm_sfence();
  });
  return 0;
}

OFFLOAD_API int offload_stream_triad(float* a, const float* b, const float* c, float scalar, int64_t n, int threads) {
  if (check("stream_triad", a, b, n, threads) != 0 || check("stream_triad", a, c, n, threads) != 0) return -1;
  const __m128 s = _mm_set1_ps(scalar);
  offload_native::parallel_ranges(n, threads, kMinPerThread, 4, [=](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + 4 <= end; i += 4)
      _mm_stream_ps(a + i, _mm_add_ps(_mm_loadu_ps(b + i), _mm_mul_ps(s, _mm_loadu_ps(c + i))));
    for (; i < end; ++i) a[i] = b[i] + scalar * c[i];
    _mm_sfence();
  });
  return 0;
}

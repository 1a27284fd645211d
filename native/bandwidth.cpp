// STREAM-style memory bandwidth probes (McCalpin's copy and triad), so that the
// Adam benchmark can state its speed as a fraction of what this machine's
// memory delivers in the same run. Timing is done by the caller.
//
// Stores are non-temporal (SSE movntps, present on every x86-64 CPU): a plain
// store to a line not in cache first reads it (write-allocate), so STREAM's
// byte count (one read + one write for copy) would understate the traffic and
// the probe would report less than the memory delivers.
#include <emmintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "errors.h"

using offload_native::fail;

namespace {

constexpr int64_t kMinPerThread = 1 << 16;

int check(const char* what, const float* dst, int64_t n, int threads) {
  if (n < 0) return fail("%s: n must be >= 0", what);
  if (threads < 0) return fail("%s: threads must be >= 0", what);
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0) return fail("%s: destination must be 16-byte aligned", what);
  return 0;
}

// Runs body(begin, end) over [0, n) split into one range per thread, each a multiple of 4 floats.
template <class Body>
void split(int64_t n, int threads, Body body) {
  if (threads == 0) threads = omp_get_max_threads();
  const int team = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, n / kMinPerThread)));
#pragma omp parallel num_threads(team)
  {
    const int64_t nt = omp_get_num_threads();
    const int64_t per = ((n + nt - 1) / nt + 3) / 4 * 4;
    const int64_t begin = std::min(n, omp_get_thread_num() * per);
    body(begin, std::min(n, begin + per));
  }
  _mm_sfence();
}

}  // namespace

OFFLOAD_API int offload_stream_copy(float* dst, const float* src, int64_t n, int threads) {
  if (check("stream_copy", dst, n, threads) != 0) return -1;
  split(n, threads, [=](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + 4 <= end; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
    for (; i < end; ++i) dst[i] = src[i];
  });
  return 0;
}

OFFLOAD_API int offload_stream_triad(float* a, const float* b, const float* c, float scalar, int64_t n, int threads) {
  if (check("stream_triad", a, n, threads) != 0) return -1;
  const __m128 s = _mm_set1_ps(scalar);
  split(n, threads, [=](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + 4 <= end; i += 4)
      _mm_stream_ps(a + i, _mm_add_ps(_mm_loadu_ps(b + i), _mm_mul_ps(s, _mm_loadu_ps(c + i))));
    for (; i < end; ++i) a[i] = b[i] + scalar * c[i];
  });
  return 0;
}

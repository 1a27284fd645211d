// STREAM-style memory bandwidth probes (McCalpin's copy and triad), so that the
// Adam benchmark can state its speed as a fraction of what this machine's
// memory delivers in the same run. Timing is done by the caller.
#include <omp.h>

#include <cstdint>

#include "errors.h"

using offload_native::fail;

namespace {

int check(const char* what, int64_t n, int threads) {
  if (n < 0) return fail("%s: n must be >= 0", what);
  if (threads < 0) return fail("%s: threads must be >= 0", what);
  return 0;
}

}  // namespace

OFFLOAD_API int offload_stream_copy(float* dst, const float* src, int64_t n, int threads) {
  if (check("stream_copy", n, threads) != 0) return -1;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : omp_get_max_threads())
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
  return 0;
}

OFFLOAD_API int offload_stream_triad(float* a, const float* b, const float* c, float scalar, int64_t n, int threads) {
  if (check("stream_triad", n, threads) != 0) return -1;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : omp_get_max_threads())
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + scalar * c[i];
  return 0;
}

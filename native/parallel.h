// Splitting one pass over n elements across an OpenMP team.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace offload_native {

// Calls body(begin, end) on contiguous ranges covering [0, n), one per thread.
// Ranges start on multiples of `align` elements; no thread gets fewer than
// `min_per_thread` elements (waking a thread for less costs more than it saves).
// threads == 0 means OpenMP's default team size.
template <class Body>
void parallel_ranges(int64_t n, int threads, int64_t min_per_thread, int64_t align, Body body) {
  if (threads <= 0) threads = omp_get_max_threads();
  threads = std::min(threads, omp_get_thread_limit());
  const int team = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, n / min_per_thread)));
  if (team == 1) {
    body(int64_t{0}, n);
    return;
  }
#pragma omp parallel num_threads(team)
  {
    const int64_t nt = omp_get_num_threads();
    const int64_t per = ((n + nt - 1) / nt + align - 1) / align * align;
    const int64_t begin = std::min(n, omp_get_thread_num() * per);
    body(begin, std::min(n, begin + per));
  }
}

}  // namespace offload_native

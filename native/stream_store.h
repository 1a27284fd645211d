// Copying into memory that nothing will read soon.
#pragma once

#include <emmintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace offload_native {
namespace {

// Copies n bytes with non-temporal stores wherever dst is 16-byte aligned: the
// destination's lines are neither read for ownership nor kept in cache, so the
// copy costs memory only its writes, and evicts nothing the caller is using.
// The stores are weakly ordered: call _mm_sfence() before another thread may
// read dst. (SSE2, which every x86-64 CPU has: no dispatch.)
inline void stream_copy_bytes(void* dst, const void* src, size_t n) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  const size_t head = std::min(n, (16 - reinterpret_cast<uintptr_t>(d) % 16) % 16);
  std::memcpy(d, s, head);
  size_t i = head;
  for (; i + 16 <= n; i += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
  std::memcpy(d + i, s + i, n - i);
}

}  // namespace
}  // namespace offload_native

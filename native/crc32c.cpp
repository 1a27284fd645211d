// CRC-32C: on long buffers by carry-less multiplication (VPCLMULQDQ) with
// AVX-512 or AVX2 when the CPU has it, else with the SSE4.2 crc32 instruction
// when it has that, else by a slice-by-8 table. All give the same value.
#include "crc32c.h"

#include <nmmintrin.h>
#include <time.h>

#include <atomic>
#include <cstring>

#include "errors.h"

namespace offload_native {
namespace {

constexpr uint32_t kPolyReflected = 0x82f63b78u;
constexpr size_t kStreamMin = 1024;  // shorter chains are not worth joining

struct Tables {
  uint32_t t[8][256];
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kPolyReflected & (0u - (c & 1u)));
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xffu];
  }
};

const Tables& tables() {
  static const Tables instance;
  return instance;
}

uint32_t crc_table(const uint8_t* p, size_t n, uint32_t crc) {
  const auto& t = tables().t;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    word ^= crc;
    crc = t[7][word & 0xff] ^ t[6][(word >> 8) & 0xff] ^ t[5][(word >> 16) & 0xff] ^ t[4][(word >> 24) & 0xff] ^
          t[3][(word >> 32) & 0xff] ^ t[2][(word >> 40) & 0xff] ^ t[1][(word >> 48) & 0xff] ^ t[0][word >> 56];
  }
  for (; n > 0; ++p, --n) crc = (crc >> 8) ^ t[0][(crc ^ *p) & 0xffu];
  return crc;
}

// Multiplication modulo the polynomial, bit-reflected (bit 31 is x^0).
uint32_t mul_mod_p(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t m = 1u << 31; m != 0; m >>= 1) {
    if (a & m) product ^= b;
    b = (b & 1u) ? (b >> 1) ^ kPolyReflected : b >> 1;
  }
  return product;
}

}  // namespace

uint32_t crc32c_x_pow(uint64_t e) {
  uint32_t result = 1u << 31, square = 1u << 30;  // x^0, x^1
  for (; e != 0; e >>= 1) {
    if (e & 1) result = mul_mod_p(result, square);
    square = mul_mod_p(square, square);
  }
  return result;
}

namespace {

// x^(8 n): multiplying a CRC register by it is what running it over n zero bytes does.
uint32_t x_pow_8n(size_t n) { return crc32c_x_pow(8 * static_cast<uint64_t>(n)); }

inline uint64_t load_u64(const uint8_t* p) {
  uint64_t word;
  std::memcpy(&word, p, 8);
  return word;
}

// The crc32 instruction takes 3 cycles to give its result and can start one
// a cycle, so one chain runs at a third of its speed: three chains over three
// thirds of a long buffer, joined by the linearity of the CRC
// (crc(a + b) = crc(a) x^(8 |b|) + crc(b)), run at close to 8 bytes a cycle.
__attribute__((target("sse4.2"))) uint32_t crc_sse42(const uint8_t* p, size_t n, uint32_t crc) {
  uint64_t c = crc;
  if (n >= 3 * kStreamMin) {
    const size_t len = n / 24 * 8;  // bytes per chain, a multiple of 8
    uint64_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < len; i += 8) {
      c = _mm_crc32_u64(c, load_u64(p + i));
      c1 = _mm_crc32_u64(c1, load_u64(p + len + i));
      c2 = _mm_crc32_u64(c2, load_u64(p + 2 * len + i));
    }
    const uint32_t shift = x_pow_8n(len);
    c = mul_mod_p(mul_mod_p(static_cast<uint32_t>(c), shift) ^ static_cast<uint32_t>(c1), shift) ^
        static_cast<uint32_t>(c2);
    p += 3 * len;
    n -= 3 * len;
  }
  for (; n >= 8; p += 8, n -= 8) c = _mm_crc32_u64(c, load_u64(p));
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; ++p, --n) c32 = _mm_crc32_u8(c32, *p);
  return c32;
}

const bool kHaveSse42 = (__builtin_cpu_init(), __builtin_cpu_supports("sse4.2"));
constexpr size_t kFoldMin = 1024;  // shorter: the crc32 instruction's three chains are as fast
const bool kHaveFold512 = kHaveSse42 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq") &&
                          __builtin_cpu_supports("pclmul");
const bool kHaveFold256 = kHaveSse42 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vpclmulqdq") &&
                          __builtin_cpu_supports("pclmul");

std::atomic<int64_t> checksum_ns{0};

int64_t thread_cpu_ns() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

}  // namespace

ChecksumTimer::ChecksumTimer() : start_(thread_cpu_ns()) {}

ChecksumTimer::~ChecksumTimer() { checksum_ns += thread_cpu_ns() - start_; }

uint32_t crc32c_shift(uint32_t reg, size_t n) { return mul_mod_p(reg, x_pow_8n(n)); }

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  if (kHaveFold512 && n >= kFoldMin) crc = crc_fold_avx512(p, n, crc);
  else if (kHaveFold256 && n >= kFoldMin) crc = crc_fold_avx2(p, n, crc);
  else crc = kHaveSse42 ? crc_sse42(p, n, crc) : crc_table(p, n, crc);
  return ~crc;
}

}  // namespace offload_native

OFFLOAD_API uint32_t offload_crc32c(const void* data, int64_t n, uint32_t crc) {
  return n > 0 ? offload_native::crc32c(data, static_cast<size_t>(n), crc) : crc;
}

OFFLOAD_API int64_t offload_checksum_ns() { return offload_native::checksum_ns.load(); }

// Test hook: one way of computing it (0 table, 1 crc32 instruction, 2 AVX-512
// folding, which needs n >= 256, 3 AVX2 folding, n >= 128), to check them
// against each other; -1 if this CPU lacks it.
OFFLOAD_API int offload_crc32c_way(int way, const void* data, int64_t n, uint32_t crc, uint32_t* out) {
  using namespace offload_native;
  if (n < 0) return fail("crc32c: n must be >= 0, got %lld", static_cast<long long>(n));
  const auto* p = static_cast<const uint8_t*>(data);
  const auto len = static_cast<size_t>(n);
  if (way == 0) *out = ~crc_table(p, len, ~crc);
  else if (way == 1 && kHaveSse42) *out = ~crc_sse42(p, len, ~crc);
  else if (way == 2 && kHaveFold512 && n >= 256) *out = ~crc_fold_avx512(p, len, ~crc);
  else if (way == 3 && kHaveFold256 && n >= 128) *out = ~crc_fold_avx2(p, len, ~crc);
  else return fail("crc32c: way %d is not available on this CPU for %lld bytes", way, static_cast<long long>(n));
  return 0;
}

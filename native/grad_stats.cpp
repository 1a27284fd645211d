// Note [gradient statistics]
// The sum of squares (in double) of a gradient range, in one pass at memory
// speed: what clipping's global norm needs, and, being infinite or NaN exactly
// when some element is, what fp16's overflow check needs. The order of the
// additions is fixed whatever the ISA or the thread count, so the result is
// bitwise reproducible and offload/optim/grad_stats.py's PyTorch fallback
// reproduces it: the range is cut into blocks of kBlock elements; in a block,
// element i (counted from the block's start) is squared in double and added to
// lane i % kLanes, each lane in order; a block's sum is its lanes added from 0
// to kLanes - 1; the blocks' sums are added in order.
#include <cstdint>
#include <cstring>
#include <vector>

#include "errors.h"
#include "parallel.h"

using offload_native::fail;

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kBlock = int64_t{1} << 16;

inline double widen(float x) { return static_cast<double>(x); }

inline double widen(uint16_t bits, bool bf16) {
  if (bf16) {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  // IEEE half to double, exactly (every half is a double).
  const uint32_t sign = bits >> 15, exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
  double value;
  if (exponent == 0x1f) {
    value = mantissa ? __builtin_nan("") : __builtin_inf();
  } else if (exponent == 0) {
    value = static_cast<double>(mantissa) * 0x1p-24;
  } else {
    value = static_cast<double>(mantissa | 0x400) * __builtin_ldexp(1.0, static_cast<int>(exponent) - 25);
  }
  return sign ? -value : value;
}

// One block; the loop over j is what the compiler vectorises, lane by lane, so
// every clone adds in the same order.
__attribute__((target_clones("avx512f", "avx2", "default")))
double block_f32(const float* x, int64_t n) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) {
      const double v = widen(x[i + j]);
      acc[j] += v * v;
    }
  for (; i < n; ++i) {
    const double v = widen(x[i]);
    acc[i % kLanes] += v * v;
  }
  double sum = 0;
  for (int64_t j = 0; j < kLanes; ++j) sum += acc[j];
  return sum;
}

__attribute__((target_clones("avx512f", "avx2", "default")))
double block_16(const uint16_t* x, int64_t n, bool bf16) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) {
      const double v = widen(x[i + j], bf16);
      acc[j] += v * v;
    }
  for (; i < n; ++i) {
    const double v = widen(x[i], bf16);
    acc[i % kLanes] += v * v;
  }
  double sum = 0;
  for (int64_t j = 0; j < kLanes; ++j) sum += acc[j];
  return sum;
}

}  // namespace

// dtype: 0 float32, 1 bfloat16, 2 float16 (as the Adam kernel's codes).
OFFLOAD_API int offload_grad_sum_squares(const void* x, int dtype, int64_t n, int threads, double* out) {
  if (n < 0 || threads < 0) return fail("grad_sum_squares: n and threads must be >= 0");
  if ((n > 0 && x == nullptr) || out == nullptr) return fail("grad_sum_squares: null pointer");
  if (dtype < 0 || dtype > 2) return fail("grad_sum_squares: dtype must be 0 (float32), 1 (bfloat16) or 2 (float16), got %d", dtype);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<double> sums(static_cast<size_t>(blocks));
  // Whole blocks per thread: a block's sum never depends on who computed it.
  offload_native::parallel_ranges(blocks, threads, 4, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t begin = b * kBlock, len = std::min(kBlock, n - begin);
      if (dtype == 0) sums[b] = block_f32(static_cast<const float*>(x) + begin, len);
      else sums[b] = block_16(static_cast<const uint16_t*>(x) + begin, len, dtype == 1);
    }
  });
  double total = 0;
  for (double s : sums) total += s;
  *out = total;
  return 0;
}

// CRC-32C (Castagnoli), the checksum of every swap file's data and header.
#pragma once

#include <cstddef>
#include <cstdint>

namespace offload_native {

// Continues a CRC: crc32c(b, crc32c(a, 0)) == crc32c(a + b, 0).
uint32_t crc32c(const void* data, size_t n, uint32_t crc);

// The CRC register `reg` after n zero bytes: how far the register of a piece
// must be moved to join it with what follows it (chunk_crcs.h).
uint32_t crc32c_shift(uint32_t reg, size_t n);

// x^e modulo the polynomial, bit-reflected (bit 31 is x^0).
uint32_t crc32c_x_pow(uint64_t e);

// The CRC register after `reg` runs over p[0, n), by folding (crc_fold.h),
// n >= 256 and n >= 128; each is compiled for its ISA, so callers check that
// the CPU has AVX-512F or AVX2, and VPCLMULQDQ, PCLMULQDQ and SSE4.2.
uint32_t crc_fold_avx512(const uint8_t* p, size_t n, uint32_t reg);
uint32_t crc_fold_avx2(const uint8_t* p, size_t n, uint32_t reg);

// Times the swap checksums of its scope by the thread's CPU clock, into the
// total offload_checksum_ns reports (for `offload bench step`: the CPU they
// take beside compute, whichever thread runs them).
class ChecksumTimer {
 public:
  ChecksumTimer();
  ~ChecksumTimer();
  ChecksumTimer(const ChecksumTimer&) = delete;
  ChecksumTimer& operator=(const ChecksumTimer&) = delete;

 private:
  int64_t start_;
};

}  // namespace offload_native

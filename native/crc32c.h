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

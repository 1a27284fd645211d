// CRC-32C (Castagnoli), the checksum of every swap file's data and header.
#pragma once

#include <cstddef>
#include <cstdint>

namespace offload_native {

// Continues a CRC: crc32c(b, crc32c(a, 0)) == crc32c(a + b, 0).
uint32_t crc32c(const void* data, size_t n, uint32_t crc);

}  // namespace offload_native

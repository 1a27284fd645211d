#include "chunk_crcs.h"

#include <algorithm>
#include <atomic>

#include "crc32c.h"
#include "errors.h"

namespace offload_native {
namespace {

std::atomic<int64_t> from_memory_bytes{0};

}  // namespace

void ChunkCrcs::Writer::add(const void* p, int64_t n) {
  const auto* bytes = static_cast<const uint8_t*>(p);
  const uint8_t* base = target_->data_;
  if (bytes < base || bytes >= base + target_->len_) return;
  int64_t at = bytes - base;
  n = std::min(n, target_->len_ - at);
  while (n > 0) {
    const int64_t chunk_end = std::min((at / target_->chunk_ + 1) * target_->chunk_, target_->len_);
    const int64_t piece = std::min(n, chunk_end - at);
    if (at != end_ || at % target_->chunk_ == 0) {
      flush();
      begin_ = at;
      crc_ = 0;
    }
    crc_ = crc32c(base + at, static_cast<size_t>(piece), crc_);
    end_ = at + piece;
    at += piece;
    n -= piece;
  }
}

void ChunkCrcs::Writer::flush() {
  if (begin_ < 0) return;
  std::lock_guard<std::mutex> lock(target_->mu_);
  target_->runs_.push_back(Run{begin_, end_, crc_});
  begin_ = end_ = -1;
}

void ChunkCrcs::finish() {
  ChecksumTimer timer;
  const int64_t count = (len_ + chunk_ - 1) / chunk_;
  std::vector<uint32_t> raw(static_cast<size_t>(count), 0);
  std::vector<int64_t> covered(static_cast<size_t>(count), 0);
  for (const Run& r : runs_) {
    const int64_t k = r.begin / chunk_, chunk_end = std::min((k + 1) * chunk_, len_);
    const auto len = static_cast<size_t>(r.end - r.begin);
    const uint32_t run_raw = ~r.crc ^ crc32c_shift(~0u, len);
    raw[k] ^= crc32c_shift(run_raw, static_cast<size_t>(chunk_end - r.end));
    covered[k] += r.end - r.begin;
  }
  for (int64_t k = 0; k < count; ++k) {
    const int64_t begin = k * chunk_, len = std::min(chunk_, len_ - begin);
    if (covered[k] == len) {
      out_[k] = ~(raw[k] ^ crc32c_shift(~0u, static_cast<size_t>(len)));
    } else {
      out_[k] = crc32c(data_ + begin, static_cast<size_t>(len), 0);
      from_memory_bytes += len;
    }
  }
  runs_.clear();
}

}  // namespace offload_native

// Bytes of chunks the Adam passes had to checksum from memory, since their
// runs did not cover them (Note [checksums in the Adam pass]); tests check it
// stays 0 where the kernel writes every byte.
OFFLOAD_API int64_t offload_checksum_from_memory_bytes() { return offload_native::from_memory_bytes.load(); }

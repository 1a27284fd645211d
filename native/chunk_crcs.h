// The chunk CRCs of a swap file's data (Note [swap file layout] in aio.cpp),
// computed by the pass that writes the data rather than by a pass of its own.
//
// Note [checksums in the Adam pass]
// A CRC is limited by memory bandwidth, not by the crc32 instruction: over a
// buffer larger than the cache it runs as fast as a plain sum. Checksummed by
// the I/O thread before a write-back, a sub-group's state is read from memory
// once more, beside backward. The Adam kernel, given a ChunkCrcs, instead
// updates a tile of elements small enough to stay in the core's cache and
// checksums the bytes it wrote while they are still there. The tiles of each
// thread arrive out of file order, so each thread keeps runs (a stretch of
// contiguous file bytes inside one chunk, with its CRC), and finish() joins
// the runs of a chunk by the linearity of the CRC:
//   raw(a + b) = raw(a) x^(8 |b|) + raw(b),   crc(d) = ~(raw(d) + ~0 x^(8 |d|))
// where raw is the CRC register run from zero. A chunk whose runs do not
// cover it (bytes no kernel wrote) is checksummed from memory instead, so the
// result never depends on which parts a kernel happened to write.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

namespace offload_native {

class ChunkCrcs {
 public:
  // `count` CRCs of `chunk`-byte chunks of data[0, len) go to out.
  ChunkCrcs(const uint8_t* data, int64_t len, int64_t chunk, uint32_t* out) : data_(data), len_(len), chunk_(chunk), out_(out) {}

  // One thread's bytes of one buffer, added in increasing address order.
  class Writer {
   public:
    explicit Writer(ChunkCrcs* target) : target_(target) {}
    ~Writer() { flush(); }
    Writer(const Writer&) = delete;
    Writer& operator=(const Writer&) = delete;
    // Bytes [p, p + n) were just written; those outside the data are not its
    // business. The caller times its adds (ChecksumTimer, crc32c.h).
    void add(const void* p, int64_t n);

   private:
    void flush();
    ChunkCrcs* target_;
    int64_t begin_ = -1, end_ = -1;  // the open run, as offsets into the data
    uint32_t crc_ = 0;
  };

  // Every Writer is gone: fill out.
  void finish();

 private:
  struct Run {
    int64_t begin, end;
    uint32_t crc;
  };
  const uint8_t* data_;
  int64_t len_, chunk_;
  uint32_t* out_;
  std::mutex mu_;
  std::vector<Run> runs_;
};

}  // namespace offload_native

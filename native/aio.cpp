// The async file engine: one request (a shard's header and data) is split into
// block_size chunks, and a team of worker threads keeps up to queue_depth
// chunks in flight with Linux kernel AIO (raw io_submit/io_getevents syscalls:
// no libaio needed) or, where the kernel refuses an AIO context, plain
// pread/pwrite. Each chunk's CRC-32C is computed by the worker that moves it,
// so checksumming overlaps the I/O.
//
// Every submit returns its own Request; waiting on it waits for that request
// only and reports that request's first error (errno, path, offset).
//
// Note [swap file layout]
// A file is [header: header_len bytes][data, padded to a multiple of 4096].
// The header format belongs to offload/store/shard_file.py; this engine only
// fills in two CRCs at offsets the caller gives: the CRC of the data (CRC-32C of
// the little-endian array of per-chunk CRCs) and then the CRC of the header
// bytes before header_crc_at. On write the header goes last, queued as one more
// chunk once every data chunk succeeded, so a failed write never leaves a header
// that vouches for it.
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <linux/magic.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "crc32c.h"
#include "errors.h"

namespace offload_native {
namespace {

enum Op : int { kRead = 0, kWrite = 1 };
enum OpenMode : int { kBuffered = 0, kDirect = 1, kBufferedRefused = 2, kBufferedRamFs = 3 };

constexpr int64_t kAlign = 4096;
constexpr int64_t kHeaderChunk = -1;

struct Request {
  int op = kRead;
  int fd = -1;
  std::string path;
  uint8_t* header = nullptr;
  int64_t header_len = 0;
  int64_t data_crc_at = 0;
  int64_t header_crc_at = 0;
  bool header_queued = false;  // a write's header chunk is in the queue or in flight
  std::vector<uint32_t> chunk_crcs;
  bool crcs_given = false;  // a write whose writer checksummed it (Note [checksums in the Adam pass])
  std::atomic<int64_t> pending{0};
  uint32_t data_crc = 0;

  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  int err = 0;              // errno of the first failure, or EIO for a short transfer
  int64_t err_offset = -1;  // file offset of the chunk that failed
  std::string err_what;
};

struct Chunk {
  Request* req;
  int64_t index;  // position in chunk_crcs, or kHeaderChunk
  uint8_t* buf;
  int64_t io_len;   // bytes moved, padded for direct I/O
  int64_t crc_len;  // bytes covered by the checksum (the real data)
  int64_t file_offset;
};

struct Fault {
  int fd = -1;
  int op = -1;
  int64_t offset = -1;
  int err = 0;
};

// Note [kernel faults]
// Test hooks at the kernel boundary, so that tests reach the paths a real disk
// or kernel takes us down, which faults injected before submission never do:
// each counter makes that many of the next events happen, then runs out.
//   submit_eagain  io_submit takes one request, then says EAGAIN while it is
//                  in flight (a full kernel queue): the rest go back to the
//                  queue and are submitted after a reap;
//   submit_refuse  io_submit refuses (EINVAL): that chunk moves synchronously;
//   short_result   a completion reports half its bytes: a short write is
//                  finished synchronously (which also learns the real errno
//                  of a filling disk), a short read fails;
//   eio_result     a completion reports EIO.
// OFFLOAD_AIO_NO_KERNEL_AIO=1 in the environment at engine creation makes
// every worker use pread/pwrite, as when the kernel refuses an AIO context.
struct KernelFaults {
  std::atomic<int> submit_eagain{0}, submit_refuse{0}, short_result{0}, eio_result{0};
};

bool take(std::atomic<int>& counter) {
  int n = counter.load();
  while (n > 0)
    if (counter.compare_exchange_weak(n, n - 1)) return true;
  return false;
}

struct Engine {
  KernelFaults kernel_faults;
  int64_t block_size;
  int queue_depth;
  std::vector<std::thread> workers;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Chunk> queue;
  bool stop = false;
  std::mutex fault_mu;
  Fault fault;
  int kernel_aio_workers = 0;
};

long sys_io_setup(unsigned nr, aio_context_t* ctx) { return syscall(SYS_io_setup, nr, ctx); }
long sys_io_destroy(aio_context_t ctx) { return syscall(SYS_io_destroy, ctx); }
long sys_io_submit(aio_context_t ctx, long n, iocb** cbs) { return syscall(SYS_io_submit, ctx, n, cbs); }
long sys_io_getevents(aio_context_t ctx, long min_nr, long nr, io_event* events) {
  return syscall(SYS_io_getevents, ctx, min_nr, nr, events, nullptr);
}

void record_error(Request* r, int err, int64_t offset, const std::string& what) {
  std::lock_guard<std::mutex> lock(r->mu);
  if (r->err != 0) return;
  r->err = err;
  r->err_offset = offset;
  r->err_what = what;
}

bool has_error(Request* r) {
  std::lock_guard<std::mutex> lock(r->mu);
  return r->err != 0;
}

void complete(Request* r) {
  std::lock_guard<std::mutex> lock(r->mu);
  r->done = true;
  r->cv.notify_all();
}

// Synchronous whole transfer, for the header and for workers without kernel AIO.
int64_t transfer_sync(int op, int fd, uint8_t* buf, int64_t len, int64_t offset) {
  int64_t done = 0;
  while (done < len) {
    const ssize_t n = op == kRead ? pread(fd, buf + done, len - done, offset + done)
                                  : pwrite(fd, buf + done, len - done, offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -errno;
    if (n == 0) break;  // end of file on a read
    done += n;
  }
  return done;
}

void store_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

// Every data chunk of a request is done: combine the CRCs and, for a write that
// fully succeeded, queue the header that vouches for the data as one more
// asynchronous chunk (written synchronously here, it kept this worker from
// submitting its next data chunks); the request completes when that lands.
void finish_request(Engine* e, Request* r) {
  if (!r->header_queued) {
    std::vector<uint8_t> le(4 * r->chunk_crcs.size());
    for (size_t i = 0; i < r->chunk_crcs.size(); ++i) store_u32(&le[4 * i], r->chunk_crcs[i]);
    r->data_crc = crc32c(le.data(), le.size(), 0);
  }
  if (r->op == kWrite && !r->header_queued && !has_error(r)) {
    store_u32(r->header + r->data_crc_at, r->data_crc);
    store_u32(r->header + r->header_crc_at, crc32c(r->header, static_cast<size_t>(r->header_crc_at), 0));
    r->header_queued = true;
    r->pending.store(1);
    {
      std::lock_guard<std::mutex> lock(e->mu);
      e->queue.push_front(Chunk{r, kHeaderChunk, r->header, r->header_len, 0, 0});
    }
    e->cv.notify_one();
    return;
  }
  complete(r);
}

uint32_t chunk_crc(const Chunk& c) {
  ChecksumTimer timer;
  return crc32c(c.buf, static_cast<size_t>(c.crc_len), 0);
}

void finish_chunk(Engine* e, const Chunk& c, int64_t result) {
  Request* r = c.req;
  const char* verb = r->op == kRead ? "read" : "write";
  if (r->op == kWrite && result >= 0 && result < c.io_len) {
    // A short write (a filling disk): finish it synchronously to learn the real errno.
    const int64_t rest = transfer_sync(kWrite, r->fd, c.buf + result, c.io_len - result, c.file_offset + result);
    result = rest < 0 ? rest : result + rest;
  }
  if (result < 0) {
    record_error(r, static_cast<int>(-result), c.file_offset, verb);
  } else if (result != c.io_len) {
    record_error(r, EIO, c.file_offset,
                 std::string("short ") + verb + ": " + std::to_string(result) + " of " + std::to_string(c.io_len) +
                     (r->op == kRead ? " bytes (file truncated?)" : " bytes"));
  } else if (r->op == kRead && c.index != kHeaderChunk) {
    r->chunk_crcs[c.index] = chunk_crc(c);
  }
  if (r->pending.fetch_sub(1) == 1) finish_request(e, r);
}

// Returns the injected errno if the test hook targets this chunk, else 0.
int injected_fault(Engine* e, const Chunk& c) {
  std::lock_guard<std::mutex> lock(e->fault_mu);
  const Fault& f = e->fault;
  if (f.fd == c.req->fd && f.op == c.req->op && f.offset >= c.file_offset && f.offset < c.file_offset + c.io_len)
    return f.err;
  return 0;
}

void prepare(Engine* e, const Chunk& c, int* fault) {
  if (c.req->op == kWrite && c.index != kHeaderChunk && !c.req->crcs_given) c.req->chunk_crcs[c.index] = chunk_crc(c);
  *fault = injected_fault(e, c);
}

// ctx == 0: the kernel refused an AIO context; this worker uses pread/pwrite.
void worker(Engine* e, int depth, aio_context_t ctx) {
  const bool kernel_aio = ctx != 0;
  std::vector<Chunk> slots(depth);
  std::vector<int> free_slots;
  for (int i = depth - 1; i >= 0; --i) free_slots.push_back(i);
  std::vector<iocb> cbs(depth);
  std::vector<iocb*> to_submit;
  std::vector<io_event> events(depth);
  std::vector<std::pair<Chunk, int64_t>> reaped;
  int inflight = 0;

  for (;;) {
    std::vector<Chunk> taken;
    {
      std::unique_lock<std::mutex> lock(e->mu);
      if (inflight == 0 && reaped.empty()) e->cv.wait(lock, [&] { return e->stop || !e->queue.empty(); });
      if (e->queue.empty() && inflight == 0 && reaped.empty() && e->stop) break;
      while (inflight + static_cast<int>(taken.size()) < depth && !e->queue.empty()) {
        taken.push_back(e->queue.front());
        e->queue.pop_front();
      }
    }
    to_submit.clear();
    for (const Chunk& c : taken) {
      int fault = 0;
      prepare(e, c, &fault);
      if (fault != 0) {
        finish_chunk(e, c, -fault);
      } else if (!kernel_aio) {
        finish_chunk(e, c, transfer_sync(c.req->op, c.req->fd, c.buf, c.io_len, c.file_offset));
      } else {
        const int slot = free_slots.back();
        free_slots.pop_back();
        slots[slot] = c;
        iocb& cb = cbs[slot];
        std::memset(&cb, 0, sizeof cb);
        cb.aio_data = static_cast<uint64_t>(slot);
        cb.aio_lio_opcode = c.req->op == kRead ? IOCB_CMD_PREAD : IOCB_CMD_PWRITE;
        cb.aio_fildes = static_cast<uint32_t>(c.req->fd);
        cb.aio_buf = reinterpret_cast<uint64_t>(c.buf);
        cb.aio_nbytes = static_cast<uint64_t>(c.io_len);
        cb.aio_offset = c.file_offset;
        to_submit.push_back(&cb);
      }
    }
    size_t submitted = 0;
    while (submitted < to_submit.size()) {
      long n;
      if (inflight > 0 && take(e->kernel_faults.submit_eagain)) {
        errno = EAGAIN;
        n = -1;
      } else if (e->kernel_faults.submit_eagain.load() > 0) {  // a full kernel queue takes fewer than asked
        n = sys_io_submit(ctx, 1, to_submit.data() + submitted);
      } else if (take(e->kernel_faults.submit_refuse)) {
        errno = EINVAL;
        n = -1;
      } else {
        n = sys_io_submit(ctx, static_cast<long>(to_submit.size() - submitted), to_submit.data() + submitted);
      }
      if (n > 0) {
        submitted += static_cast<size_t>(n);
        inflight += static_cast<int>(n);
        continue;
      }
      if (n < 0 && errno == EAGAIN && inflight > 0) break;  // reap first, then retry below
      // The kernel refused this one: move it synchronously rather than fail the request.
      const int slot = static_cast<int>(to_submit[submitted]->aio_data);
      const Chunk& c = slots[slot];
      finish_chunk(e, c, transfer_sync(c.req->op, c.req->fd, c.buf, c.io_len, c.file_offset));
      free_slots.push_back(slot);
      ++submitted;
    }
    if (submitted < to_submit.size()) {  // EAGAIN: hand the rest back to the queue
      std::lock_guard<std::mutex> lock(e->mu);
      for (size_t i = to_submit.size(); i-- > submitted;) {
        const int slot = static_cast<int>(to_submit[i]->aio_data);
        e->queue.push_front(slots[slot]);
        free_slots.push_back(slot);
      }
    }
    // Chunks reaped last round are finished (checksummed) only now, after their
    // slots were refilled above, so the device never idles while we checksum.
    for (const auto& [chunk, result] : reaped) finish_chunk(e, chunk, result);
    reaped.clear();
    if (inflight > 0) {
      long n;
      do n = sys_io_getevents(ctx, 1, inflight, events.data());
      while (n < 0 && errno == EINTR);
      for (long i = 0; i < n; ++i) {
        const int slot = static_cast<int>(events[i].data);
        int64_t result = static_cast<int64_t>(events[i].res);
        if (result > 0 && take(e->kernel_faults.short_result)) result /= 2;
        else if (take(e->kernel_faults.eio_result)) result = -EIO;
        reaped.emplace_back(slots[slot], result);
        free_slots.push_back(slot);
        --inflight;
      }
    }
  }
  if (kernel_aio) sys_io_destroy(ctx);
}

}  // namespace
}  // namespace offload_native

using namespace offload_native;

OFFLOAD_API void* offload_aio_create(int64_t block_size, int queue_depth, int threads) {
  if (block_size <= 0 || block_size % kAlign != 0) {
    fail("aio: block_size must be a positive multiple of %lld bytes, got %lld", static_cast<long long>(kAlign),
         static_cast<long long>(block_size));
    return nullptr;
  }
  if (queue_depth < 1 || threads < 1) {
    fail("aio: queue_depth and thread_count must be >= 1, got %d and %d", queue_depth, threads);
    return nullptr;
  }
  auto* e = new Engine;
  e->block_size = block_size;
  e->queue_depth = queue_depth;
  // Split the depth over the workers; each keeps its share in flight.
  for (int i = 0; i < threads; ++i) {
    const int share = std::max(1, queue_depth / threads + (i < queue_depth % threads ? 1 : 0));
    aio_context_t ctx = 0;
    const char* no_kernel_aio = std::getenv("OFFLOAD_AIO_NO_KERNEL_AIO");
    if ((no_kernel_aio != nullptr && std::strcmp(no_kernel_aio, "1") == 0) ||
        sys_io_setup(static_cast<unsigned>(share), &ctx) != 0)
      ctx = 0;
    else ++e->kernel_aio_workers;
    e->workers.emplace_back(worker, e, share, ctx);
  }
  return e;
}

// Waits for every queued and in-flight chunk, then stops the workers.
OFFLOAD_API void offload_aio_destroy(void* engine) {
  auto* e = static_cast<Engine*>(engine);
  if (e == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(e->mu);
    e->stop = true;
  }
  e->cv.notify_all();
  for (auto& t : e->workers) t.join();
  delete e;
}

OFFLOAD_API int offload_aio_kernel_aio_workers(void* engine) {
  return static_cast<Engine*>(engine)->kernel_aio_workers;
}

// Opens (create: exclusively, 0600) without following a symlink. *mode_out
// says whether direct I/O is on, and if not, why (OpenMode).
OFFLOAD_API int offload_aio_open(const char* path, int create, int want_direct, int* mode_out) {
  const int base = O_RDWR | O_CLOEXEC | O_NOFOLLOW | (create ? O_CREAT | O_EXCL : 0);
  int fd = open(path, base, 0600);
  if (fd < 0) return fail("open %s: %s", path, std::strerror(errno));
  *mode_out = kBuffered;
  if (!want_direct) return fd;
  struct statfs fs;
  if (fstatfs(fd, &fs) == 0 && (fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC)) {
    *mode_out = kBufferedRamFs;  // memory, not a disk: direct I/O would only add copies
    return fd;
  }
  const int flags = fcntl(fd, F_GETFL);
  if (fcntl(fd, F_SETFL, flags | O_DIRECT) == 0) {
    *mode_out = kDirect;
  } else {
    *mode_out = kBufferedRefused;
  }
  return fd;
}

OFFLOAD_API int offload_aio_close(int fd) {
  if (close(fd) != 0) return fail("close fd %d: %s", fd, std::strerror(errno));
  return 0;
}

// Queues one request. data_io_len >= data_len is what moves (padded for direct
// I/O); the checksum covers data_len bytes. A write may bring its chunks' CRCs
// (chunk_crcs, one per block_size chunk of data_len; null: the workers compute
// them). Returns a handle for offload_aio_wait, or null with the reason in
// offload_last_error().
OFFLOAD_API void* offload_aio_submit(void* engine, int op, int fd, const char* path, void* header, int64_t header_len,
                                     int64_t data_crc_at, int64_t header_crc_at, void* data, int64_t data_len,
                                     int64_t data_io_len, const uint32_t* chunk_crcs) {
  auto* e = static_cast<Engine*>(engine);
  if (op != kRead && op != kWrite) return fail("aio: op must be 0 (read) or 1 (write), got %d", op), nullptr;
  if (header == nullptr || header_len <= 0 || data_crc_at < 0 || data_crc_at + 4 > header_len ||
      header_crc_at < 0 || header_crc_at + 4 > header_len)
    return fail("aio: bad header buffer or CRC offsets for %s", path), nullptr;
  if (data_len < 0 || data_io_len < data_len || (data_len > 0 && data == nullptr))
    return fail("aio: bad data length %lld (io length %lld) for %s", static_cast<long long>(data_len),
                static_cast<long long>(data_io_len), path),
           nullptr;
  if (chunk_crcs != nullptr && op != kWrite) return fail("aio: chunk CRCs come with a write only (%s)", path), nullptr;

  auto* r = new Request;
  r->op = op;
  r->fd = fd;
  r->path = path;
  r->header = static_cast<uint8_t*>(header);
  r->header_len = header_len;
  r->data_crc_at = data_crc_at;
  r->header_crc_at = header_crc_at;
  const int64_t chunks = (data_io_len + e->block_size - 1) / e->block_size;
  r->chunk_crcs.assign(static_cast<size_t>(chunks), 0);
  if (chunk_crcs != nullptr) {
    r->chunk_crcs.assign(chunk_crcs, chunk_crcs + chunks);
    r->crcs_given = true;
  }
  const bool read_header = op == kRead;
  r->pending.store(chunks + (read_header ? 1 : 0));
  if (r->pending.load() == 0) {  // an empty write: only the header
    finish_request(e, r);
    return r;
  }
  {
    std::lock_guard<std::mutex> lock(e->mu);
    if (read_header) e->queue.push_back(Chunk{r, kHeaderChunk, r->header, header_len, 0, 0});
    auto* bytes = static_cast<uint8_t*>(data);
    for (int64_t i = 0; i < chunks; ++i) {
      const int64_t begin = i * e->block_size;
      const int64_t io_len = std::min(e->block_size, data_io_len - begin);
      const int64_t crc_len = std::max<int64_t>(0, std::min(io_len, data_len - begin));
      e->queue.push_back(Chunk{r, i, bytes + begin, io_len, crc_len, header_len + begin});
    }
  }
  e->cv.notify_all();
  return r;
}

OFFLOAD_API int offload_aio_done(void* handle) {
  auto* r = static_cast<Request*>(handle);
  std::lock_guard<std::mutex> lock(r->mu);
  return r->done ? 1 : 0;
}

// Blocks until the request is done. 0, or -1 with "<op> <path> at offset N: <reason>".
OFFLOAD_API int offload_aio_wait(void* handle, uint32_t* data_crc_out) {
  auto* r = static_cast<Request*>(handle);
  std::unique_lock<std::mutex> lock(r->mu);
  r->cv.wait(lock, [&] { return r->done; });
  *data_crc_out = r->data_crc;
  if (r->err == 0) return 0;
  const std::string reason = r->err_what.rfind("short", 0) == 0 ? r->err_what : std::strerror(r->err);
  const std::string verb = r->err_what.rfind("short", 0) == 0 ? (r->op == kRead ? "read" : "write") : r->err_what;
  return fail("%s %s at offset %lld: %s (errno %d)", verb.c_str(), r->path.c_str(),
              static_cast<long long>(r->err_offset), reason.c_str(), r->err);
}

OFFLOAD_API void offload_aio_free(void* handle) {
  auto* r = static_cast<Request*>(handle);
  if (r == nullptr) return;
  {
    std::unique_lock<std::mutex> lock(r->mu);
    r->cv.wait(lock, [&] { return r->done; });  // never free a request the workers still hold
  }
  delete r;
}

// Test hook: chunks of `op` on `fd` covering file byte `offset` fail with `err`
// without touching the disk, until another call replaces the fault (fd -1: none).
// Note [kernel faults]: adds to each counter; returns how many of all four are still unspent.
OFFLOAD_API int offload_aio_kernel_faults(void* engine, int submit_eagain, int submit_refuse, int short_result,
                                          int eio_result) {
  auto& f = static_cast<Engine*>(engine)->kernel_faults;
  f.submit_eagain += submit_eagain;
  f.submit_refuse += submit_refuse;
  f.short_result += short_result;
  f.eio_result += eio_result;
  return f.submit_eagain + f.submit_refuse + f.short_result + f.eio_result;
}

OFFLOAD_API void offload_aio_inject_fault(void* engine, int fd, int op, int64_t offset, int err) {
  auto* e = static_cast<Engine*>(engine);
  std::lock_guard<std::mutex> lock(e->fault_mu);
  e->fault = Fault{fd, op, offset, err};
}

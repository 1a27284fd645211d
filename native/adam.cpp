// The C entry points of the CPU Adam: argument checks, ISA choice at run time,
// and the OpenMP split of one step over threads.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "adam_args.h"
#include "chunk_crcs.h"
#include "crc32c.h"
#include "errors.h"
#include "moment_codec.h"
#include "parallel.h"
#include "stream_store.h"

namespace offload_native {

namespace {

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

bool cpu_runs(int isa) {
  __builtin_cpu_init();
  switch (isa) {
    case kScalar: return true;
    case kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    case kAvx512: return __builtin_cpu_supports("avx512f");
    default: return false;
  }
}

int best_isa() {
  for (int isa : {kAvx512, kAvx2}) if (cpu_runs(isa)) return isa;
  return kScalar;
}

std::atomic<int> g_isa{best_isa()};

constexpr int64_t kMinPerThread = 1 << 15;
// Thread ranges start on 64-element (256-byte) boundaries: whole vectors, whole
// cache lines, and aligned streaming stores for the copy-out (adam_loop.h).
constexpr int64_t kRangeAlign = 64;

size_t dtype_size(int dtype) { return dtype == kFloat32 ? 4 : dtype == kBlockCodes8 ? 1 : 2; }

bool valid_dtype(int dtype) { return dtype == kFloat32 || dtype == kBFloat16 || dtype == kFloat16; }

struct Span {
  const char* name;
  uintptr_t begin;
  uintptr_t end;
};

int check_buffers(const AdamBuffers& b, int64_t n) {
  if (n < 0 || n > (int64_t{1} << 60))
    return fail("adam: n must be in [0, 2^60], got %lld", static_cast<long long>(n));
  if (!valid_dtype(b.grad_dtype)) return fail("adam: grad dtype code %d is not 0 (fp32), 1 (bf16) or 2 (fp16)", b.grad_dtype);
  if (b.param_dtype != kFloat32 && b.param_dtype != kBFloat16)
    return fail("adam: param dtype code %d is not 0 (fp32) or 1 (bf16)", b.param_dtype);
  if (b.param_dtype == kBFloat16 && n > (int64_t{1} << 32))
    return fail("adam: bf16 master weights take at most 2^32 elements per call (their rounding noise is keyed by a "
                "32-bit index), got %lld", static_cast<long long>(n));
  if (b.moment_dtype != kFloat32 && b.moment_dtype != kBFloat16 && b.moment_dtype != kBlockCodes8)
    return fail("adam: moment dtype code %d is not 0 (fp32), 1 (bf16) or 3 (8-bit block codes)", b.moment_dtype);
  if (b.out != nullptr && b.out_dtype != kBFloat16 && b.out_dtype != kFloat16)
    return fail("adam: out dtype code %d is not 1 (bf16) or 2 (fp16)", b.out_dtype);
  if (n == 0) return 0;
  const size_t elements = static_cast<size_t>(n);
  const size_t blocks = (elements + kQuantBlock - 1) / kQuantBlock;
  const bool codes = b.moment_dtype == kBlockCodes8;
  const AdamBackup& k = b.backup;
  const bool backup = k.exp_avg != nullptr || k.exp_avg_sq != nullptr || k.param != nullptr;
  if (backup && (k.exp_avg == nullptr || k.exp_avg_sq == nullptr))
    return fail("adam: a backup needs exp_avg and exp_avg_sq (param may be left out), got a null pointer");
  const struct {
    const char* name;
    const void* ptr;
    size_t element_size;
    size_t count;
    bool used;
  } buffers[12] = {
      {"param", b.param, dtype_size(b.param_dtype), elements, true},
      {"exp_avg", b.exp_avg, dtype_size(b.moment_dtype), elements, true},
      {"exp_avg_sq", b.exp_avg_sq, dtype_size(b.moment_dtype), elements, true},
      {"grad", b.grad, dtype_size(b.grad_dtype), elements, true},
      {"exp_avg_scale", b.exp_avg_scale, 4, blocks, codes},
      {"exp_avg_sq_scale", b.exp_avg_sq_scale, 4, blocks, codes},
      {"out", b.out, 2, elements, b.out != nullptr},
      {"backup param", k.param, dtype_size(b.param_dtype), elements, k.param != nullptr},
      {"backup exp_avg", k.exp_avg, dtype_size(b.moment_dtype), elements, backup},
      {"backup exp_avg_sq", k.exp_avg_sq, dtype_size(b.moment_dtype), elements, backup},
      {"backup exp_avg_scale", k.exp_avg_scale, 4, blocks, backup && codes},
      {"backup exp_avg_sq_scale", k.exp_avg_sq_scale, 4, blocks, backup && codes},
  };
  Span spans[12];
  int count = 0;
  for (const auto& buffer : buffers) {
    if (!buffer.used) continue;
    const uintptr_t begin = reinterpret_cast<uintptr_t>(buffer.ptr);
    const size_t bytes = buffer.element_size * buffer.count;
    if (begin == 0) return fail("adam: %s is a null pointer", buffer.name);
    if (begin % buffer.element_size != 0) return fail("adam: %s is not %zu-byte aligned", buffer.name, buffer.element_size);
    if (begin + bytes < begin) return fail("adam: %s wraps around the address space", buffer.name);
    spans[count++] = {buffer.name, begin, begin + bytes};
  }
  for (int i = 0; i < count; ++i)
    for (int j = i + 1; j < count; ++j)
      if (spans[i].begin < spans[j].end && spans[j].begin < spans[i].end)
        return fail("adam: %s and %s overlap in memory; each needs its own buffer", spans[i].name, spans[j].name);
  return 0;
}

int make_consts(double lr, double beta1, double beta2, double eps, double weight_decay, int decoupled,
                int bias_correction, int64_t step, double grad_scale, AdamConsts* c) {
  if (!(std::isfinite(lr) && lr >= 0)) return fail("adam: lr must be finite and >= 0, got %g", lr);
  if (!(beta1 >= 0 && beta1 < 1)) return fail("adam: beta1 must be in [0, 1), got %g", beta1);
  if (!(beta2 >= 0 && beta2 < 1)) return fail("adam: beta2 must be in [0, 1), got %g", beta2);
  if (!(std::isfinite(eps) && eps >= 0)) return fail("adam: eps must be finite and >= 0, got %g", eps);
  if (!(std::isfinite(weight_decay) && weight_decay >= 0))
    return fail("adam: weight_decay must be finite and >= 0, got %g", weight_decay);
  if (step < 1) return fail("adam: step must be >= 1 (the first step is 1), got %lld", static_cast<long long>(step));
  if (!std::isfinite(grad_scale)) return fail("adam: grad_scale must be finite, got %g", grad_scale);

  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  c->grad_scale = static_cast<float>(grad_scale);
  c->beta1 = static_cast<float>(beta1);
  c->one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c->beta2 = static_cast<float>(beta2);
  c->one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c->eps = static_cast<float>(eps);
  c->inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  c->step_size = static_cast<float>(lr / bc1);
  c->use_l2 = weight_decay != 0 && !decoupled;
  c->use_decoupled = weight_decay != 0 && decoupled;
  c->l2_decay = static_cast<float>(weight_decay);
  c->decoupled_keep = static_cast<float>(1.0 - lr * weight_decay);
  return 0;
}

// make_consts's message, which names the hyper-parameter, said of run k.
int fail_in_run(int64_t k) {
  const std::string why = last_error();
  const std::string prefix = "adam: ";
  return fail("adam: run %lld: %s", static_cast<long long>(k),
              why.c_str() + (why.rfind(prefix, 0) == 0 ? prefix.size() : 0));
}

// Note [hyper-parameters by run]: each run's constants, in `consts`.
int make_run_consts(const int64_t* bounds, const double* hypers, int64_t count, int64_t n, double lr, int decoupled,
                    int bias_correction, int64_t step, double grad_scale, std::vector<AdamConsts>* consts) {
  if (count < 0 || (count > 0 && (bounds == nullptr || hypers == nullptr)))
    return fail("adam: %lld runs need their bounds and hyper-parameters", static_cast<long long>(count));
  int64_t previous = 0;
  for (int64_t k = 0; k < count; ++k) {
    const int64_t lo = bounds[2 * k], hi = bounds[2 * k + 1];
    if (!(previous <= lo && lo < hi && hi <= n))
      return fail("adam: run %lld is [%lld, %lld); runs must be non-empty, increasing, disjoint and within "
                  "the %lld elements", static_cast<long long>(k), static_cast<long long>(lo),
                  static_cast<long long>(hi), static_cast<long long>(n));
    const double* h = hypers + kRunHypers * k;
    if (!(std::isfinite(h[kRunLrScale]) && h[kRunLrScale] >= 0))
      return fail("adam: run %lld has lr scale %g; it must be finite and >= 0", static_cast<long long>(k),
                  h[kRunLrScale]);
    previous = hi;
    consts->emplace_back();
    if (make_consts(lr * h[kRunLrScale], h[kRunBeta1], h[kRunBeta2], h[kRunEps], h[kRunWeightDecay], decoupled,
                    bias_correction, step, grad_scale, &consts->back()) != 0)
      return fail_in_run(k);
  }
  return 0;
}

void run_isa(int isa, const AdamBuffers& b, const AdamConsts& c, int64_t begin, int64_t end) {
  // Stochastic rounding has no AVX-512 form yet: every AVX-512 CPU runs AVX2.
  if (isa == kAvx512 && b.param_dtype == kBFloat16) isa = kAvx2;
  int64_t body_end = begin;
  if (isa == kAvx512) {
    body_end = begin + (end - begin) / kAvx512Width * kAvx512Width;
    adam_range_avx512(b, c, begin, body_end);
  } else if (isa == kAvx2) {
    body_end = begin + (end - begin) / kAvx2Width * kAvx2Width;
    adam_range_avx2(b, c, begin, body_end);
  }
  adam_range_scalar(b, c, body_end, end);
}

// Note [hyper-parameters by run]: [begin, end) cut where a run starts or ends.
void run_range(int isa, const AdamBuffers& b, const AdamConsts& c, int64_t begin, int64_t end) {
  const int64_t* bounds = b.runs.bounds;
  const int64_t* bounds_end = bounds + 2 * b.runs.count;
  while (begin < end) {
    // An odd index: inside run k / 2 (its end is next); an even one: before it.
    const int64_t k = std::upper_bound(bounds, bounds_end, b.index_base + begin) - bounds;
    const int64_t stop = k < 2 * b.runs.count ? std::min(end, bounds[k] - b.index_base) : end;
    run_isa(isa, b, k % 2 ? b.runs.consts[k / 2] : c, begin, stop);
    begin = stop;
  }
}

// Note [8-bit moments]: each block decoded into fp32 buffers, stepped there by
// the ISA kernel, and encoded back. begin is a multiple of kQuantBlock.
void run_blocks(int isa, const AdamBuffers& b, const AdamConsts& c, int64_t begin, int64_t end) {
  alignas(64) float exp_avg[kQuantBlock];
  alignas(64) float exp_avg_sq[kQuantBlock];
  auto* m_codes = static_cast<uint8_t*>(b.exp_avg);
  auto* s_codes = static_cast<uint8_t*>(b.exp_avg_sq);
  auto at = [](void* base, int dtype, int64_t i) -> void* {
    return base == nullptr ? nullptr : static_cast<char*>(base) + i * static_cast<int64_t>(dtype_size(dtype));
  };
  for (int64_t lo = begin; lo < end; lo += kQuantBlock) {
    const int64_t len = std::min(kQuantBlock, end - lo), block = lo / kQuantBlock;
    decode_moments(m_codes + lo, b.exp_avg_scale[block], s_codes + lo, b.exp_avg_sq_scale[block], len, exp_avg,
                   exp_avg_sq);
    AdamBuffers local = b;
    local.param = at(b.param, b.param_dtype, lo);
    local.grad = at(const_cast<void*>(b.grad), b.grad_dtype, lo);
    local.out = at(b.out, b.out_dtype, lo);
    local.exp_avg = exp_avg;
    local.exp_avg_sq = exp_avg_sq;
    local.moment_dtype = kFloat32;
    local.index_base = b.index_base + lo;
    run_range(isa, local, c, 0, len);
    encode_moments(exp_avg, exp_avg_sq, len, m_codes + lo, &b.exp_avg_scale[block], s_codes + lo,
                   &b.exp_avg_sq_scale[block]);
  }
}

// Elements a tile: their fp32 state and gradient (256 KiB) stay in a core's L2.
constexpr int64_t kTile = 8 * kQuantBlock;

// A thread's range a tile at a time: each tile's old state copied to the
// backup first (Note [the old state kept in the pass]), then stepped, then its
// new state checksummed while it is in cache (Note [checksums in the Adam
// pass]); either may be absent.
void run_tiled(int isa, const AdamBuffers& b, const AdamConsts& c, int64_t begin, int64_t end, ChunkCrcs* crcs) {
  const bool codes = b.moment_dtype == kBlockCodes8;
  const AdamBackup& k = b.backup;
  const auto bytes = [](const void* base, size_t size, int64_t i) {
    return static_cast<char*>(const_cast<void*>(base)) + i * size;
  };
  const size_t moment = dtype_size(b.moment_dtype), master = dtype_size(b.param_dtype);
  ChunkCrcs::Writer param(crcs), exp_avg(crcs), exp_avg_sq(crcs), exp_avg_scale(crcs), exp_avg_sq_scale(crcs);
  for (int64_t lo = begin; lo < end; lo += kTile) {
    const int64_t hi = std::min(end, lo + kTile), n = hi - lo;
    // With codes, lo starts a block: the tile's scales are blocks [first, first + blocks).
    const int64_t first = lo / kQuantBlock, blocks = (hi - 1) / kQuantBlock + 1 - first;
    if (k.exp_avg != nullptr) {  // read back only on a rollback: streamed past the cache
      if (k.param != nullptr) stream_copy_bytes(bytes(k.param, master, lo), bytes(b.param, master, lo), n * master);
      stream_copy_bytes(bytes(k.exp_avg, moment, lo), bytes(b.exp_avg, moment, lo), n * moment);
      stream_copy_bytes(bytes(k.exp_avg_sq, moment, lo), bytes(b.exp_avg_sq, moment, lo), n * moment);
      if (codes) {
        stream_copy_bytes(k.exp_avg_scale + first, b.exp_avg_scale + first, blocks * 4);
        stream_copy_bytes(k.exp_avg_sq_scale + first, b.exp_avg_sq_scale + first, blocks * 4);
      }
    }
    if (codes) run_blocks(isa, b, c, lo, hi);
    else run_range(isa, b, c, lo, hi);
    if (crcs == nullptr) continue;
    ChecksumTimer timer;
    param.add(bytes(b.param, master, lo), n * master);
    exp_avg.add(bytes(b.exp_avg, moment, lo), n * moment);
    exp_avg_sq.add(bytes(b.exp_avg_sq, moment, lo), n * moment);
    if (codes) {
      exp_avg_scale.add(b.exp_avg_scale + first, blocks * 4);
      exp_avg_sq_scale.add(b.exp_avg_sq_scale + first, blocks * 4);
    }
  }
  if (k.exp_avg != nullptr) _mm_sfence();
}

}  // namespace
}  // namespace offload_native

using namespace offload_native;

OFFLOAD_API const char* offload_last_error() { return last_error().c_str(); }

// 0 scalar, 1 AVX2, 2 AVX-512: the best this CPU runs.
OFFLOAD_API int offload_cpu_isa() { return best_isa(); }

OFFLOAD_API int offload_adam_isa() { return g_isa.load(); }

// Tests use this to run every kernel this CPU supports; -1 restores the best.
OFFLOAD_API int offload_set_adam_isa(int isa) {
  if (isa == -1) isa = best_isa();
  if (!cpu_runs(isa)) return fail("adam: ISA %d is not supported by this CPU", isa);
  g_isa.store(isa);
  return 0;
}

OFFLOAD_API int offload_adam_step(void* param, int param_dtype, uint32_t sr_key, void* exp_avg, void* exp_avg_sq,
                                  int moment_dtype, float* exp_avg_scale, float* exp_avg_sq_scale, const void* grad, int grad_dtype, void* out, int out_dtype,
                                  int64_t n, double lr, double beta1, double beta2,
                                  double eps, double weight_decay, int decoupled, int bias_correction, int64_t step,
                                  double grad_scale, int threads, const void* crc_data, int64_t crc_len,
                                  int64_t crc_chunk, uint32_t* crc_out, const int64_t* run_bounds,
                                  const double* run_hypers, int64_t run_count, void* backup_param,
                                  void* backup_exp_avg, void* backup_exp_avg_sq, float* backup_exp_avg_scale,
                                  float* backup_exp_avg_sq_scale) {
  AdamBuffers b{param, param_dtype, sr_key, exp_avg, exp_avg_sq, moment_dtype, exp_avg_scale, exp_avg_sq_scale,
                grad, grad_dtype, out, out_dtype};
  b.backup = AdamBackup{backup_param, backup_exp_avg, backup_exp_avg_sq, backup_exp_avg_scale, backup_exp_avg_sq_scale};
  AdamConsts c;
  std::vector<AdamConsts> run_consts;
  if (check_buffers(b, n) != 0) return -1;
  if (make_consts(lr, beta1, beta2, eps, weight_decay, decoupled, bias_correction, step, grad_scale, &c) != 0)
    return -1;
  if (make_run_consts(run_bounds, run_hypers, run_count, n, lr, decoupled, bias_correction, step, grad_scale,
                      &run_consts) != 0)
    return -1;
  b.runs = GroupRuns{run_bounds, run_consts.data(), run_count};
  if (threads < 0) return fail("adam: threads must be >= 0 (0 = all available cores), got %d", threads);
  const int isa = g_isa.load();
  const int64_t align = b.moment_dtype == kBlockCodes8 ? kQuantBlock : kRangeAlign;
  if (crc_out != nullptr || b.backup.exp_avg != nullptr) {
    if (crc_out != nullptr && (crc_data == nullptr || crc_len <= 0 || crc_chunk <= 0))
      return fail("adam: checksummed data needs a pointer, a length and a chunk size > 0, got %lld and %lld",
                  static_cast<long long>(crc_len), static_cast<long long>(crc_chunk));
    std::optional<ChunkCrcs> crcs;
    if (crc_out != nullptr) crcs.emplace(static_cast<const uint8_t*>(crc_data), crc_len, crc_chunk, crc_out);
    ChunkCrcs* target = crcs ? &*crcs : nullptr;
    parallel_ranges(n, threads, kMinPerThread, align,
                    [&](int64_t begin, int64_t end) { run_tiled(isa, b, c, begin, end, target); });
    if (crcs) crcs->finish();
    return 0;
  }
  if (b.moment_dtype == kBlockCodes8) {
    parallel_ranges(n, threads, kMinPerThread, align,
                    [&](int64_t begin, int64_t end) { run_blocks(isa, b, c, begin, end); });
    return 0;
  }
  parallel_ranges(n, threads, kMinPerThread, align,
                  [&](int64_t begin, int64_t end) { run_range(isa, b, c, begin, end); });
  return 0;
}

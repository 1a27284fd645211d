// One Adam step over a contiguous range, as the ISA-specific kernels see it.
//
// Note [bit-identical Adam]
// Every kernel (scalar, AVX2, AVX-512) and the pure-PyTorch fallback
// (offload/optim/adam_fallback.py) evaluate the same sequence of single,
// correctly rounded fp32 operations with the same fp32 constants:
//
//   g  = grad * grad_scale
//   g  = g + p * weight_decay            (classic L2 Adam only)
//   m  = m * beta1 + g * (1 - beta1)
//   v  = v * beta2 + (g * g) * (1 - beta2)
//   p  = p * (1 - lr * weight_decay)     (decoupled AdamW only)
//   p  = p - (m / (sqrt(v) * inv_bc2_sqrt + eps)) * step_size
//
// with inv_bc2_sqrt = 1 / sqrt(1 - beta2^step) and step_size = lr / (1 - beta1^step)
// computed in double and rounded once to fp32. (A multiply, not a division by a
// scalar, because torch may itself turn a division by a scalar into a multiply
// by its reciprocal, and the fallback must not depend on that.)
//
// The moments may be stored in bf16 (offload_optimizer.state_dtype): they are
// widened to fp32 on load, the sequence above runs in fp32 unchanged, and m and
// v are rounded to nearest even only when stored. The new weights use the fp32
// m and v of this step, not their rounded copies.
//
// The moments may also be stored in 8 bits (Note [8-bit moments]): adam.cpp
// decodes one block into fp32 buffers, runs this sequence on it and encodes it.
//
// The master weights may be stored in bf16 (offload_optimizer.master_dtype):
// widened on load like the moments, and the new value rounded stochastically
// when stored (Note [stochastic rounding]); the low-precision copy-out then
// receives exactly the stored master.
//
// The sources are built with -ffp-contract=off and use no FMA, because a fused
// multiply-add rounds once where the sequence above rounds twice. That costs
// nothing measurable (the step is bound by memory bandwidth) and buys results
// that are bitwise equal across ISAs, thread counts and the fallback.
#pragma once

#include <cstdint>

namespace offload_native {

enum Dtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kBlockCodes8 = 3 /* moments only */ };

// The fp32 constants of Note [bit-identical Adam], derived once per call from
// the double-precision hyper-parameters.
struct AdamConsts {
  float grad_scale;
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float eps;
  float inv_bc2_sqrt;
  float step_size;
  float l2_decay;       // used when use_l2
  float decoupled_keep; // 1 - lr * weight_decay, used when use_decoupled
  bool use_l2;
  bool use_decoupled;
};

// Note [stochastic rounding]
// A bf16 master weight x (fp32 after the step) is stored as the bf16 just
// below or just above it in magnitude, the upper one with probability equal
// to x's distance from the lower over the gap: add a 16-bit random number to
// x's fp32 bits and drop the low 16 bits (NaN stays NaN). The random number
// of element i (its index in the call's buffers, which is its index in the
// sub-group) is the low 16 bits of mix32(key ^ mix32(i)), mix32 being the
// "lowbias32" integer hash (x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15;
// x *= 0x846ca68b; x ^= x >> 16, all mod 2^32). The caller derives key from
// the step and the sub-group (offload/optim/stochastic.py), so a rerun or a
// resumed run draws the same numbers, whatever the ISA or thread count.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// Note [hyper-parameters by run]
// An optimizer's parameter groups may give parameters hyper-parameters of
// their own: a weight decay (biases and norms usually take none), a learning
// rate (a head trained faster than the body, layer-wise decay of the rate),
// betas and eps. A call carries those as runs: disjoint, increasing element
// ranges [bounds[2k], bounds[2k + 1]) of the call, each with kRunHypers
// doubles (the kRun* indices below), the rate as a factor on the call's
// learning rate; elements outside every run take the call's. A run's
// constants are those of a call with learning rate lr * lr_scale (in double)
// and the run's other values, and a thread's range is cut at the runs' ends
// (adam.cpp, run_range), so the kernels below only ever see one set of
// constants, and an element steps exactly as that call would step it.
constexpr int kRunWeightDecay = 0, kRunLrScale = 1, kRunBeta1 = 2, kRunBeta2 = 3, kRunEps = 4, kRunHypers = 5;

struct GroupRuns {
  const int64_t* bounds = nullptr;  // 2 * count
  const AdamConsts* consts = nullptr;  // count
  int64_t count = 0;
};

// Note [the old state kept in the pass]
// The overlapped step (offload/zero/overlap.py) steps a sub-group before it
// knows whether the step stands, so it keeps the sub-group's old state to put
// back. A copy before the call read and wrote the whole state once more, and
// cost the worker more than the Adam step itself. Instead the call copies
// each tile's old values into the backup just before stepping that tile, on
// the threads that step it, while the tile is in their cache: the state is
// read from memory once, as without a backup.
struct AdamBackup {
  void* param = nullptr;  // may stay null alone: the master then lives elsewhere and is stepped in a copy
  void* exp_avg = nullptr;  // null: no backup
  void* exp_avg_sq = nullptr;
  float* exp_avg_scale = nullptr;  // kBlockCodes8
  float* exp_avg_sq_scale = nullptr;
};

struct AdamBuffers {
  void* param;
  int param_dtype;   // kFloat32, or kBFloat16 (Note [stochastic rounding])
  uint32_t sr_key;   // for param_dtype kBFloat16
  void* exp_avg;
  void* exp_avg_sq;
  int moment_dtype;  // kFloat32, kBFloat16, or kBlockCodes8 (then uint8 codes)
  float* exp_avg_scale;     // kBlockCodes8: one scale per block (moment_codec.h)
  float* exp_avg_sq_scale;
  const void* grad;
  int grad_dtype;  // Dtype
  void* out;       // nullptr: no low-precision copy
  int out_dtype;   // kBFloat16 or kFloat16 when out != nullptr
  int64_t index_base = 0;  // element i of these buffers is element index_base + i of the call
  GroupRuns runs;          // in the call's element indices
  AdamBackup backup;       // Note [the old state kept in the pass]
};

// Each updates elements [begin, end). The vector kernels require
// (end - begin) to be a multiple of their width; the scalar one takes any range.
void adam_range_scalar(const AdamBuffers& b, const AdamConsts& c, int64_t begin, int64_t end);
void adam_range_avx2(const AdamBuffers& b, const AdamConsts& c, int64_t begin, int64_t end);
void adam_range_avx512(const AdamBuffers& b, const AdamConsts& c, int64_t begin, int64_t end);

constexpr int64_t kAvx2Width = 8;
constexpr int64_t kAvx512Width = 16;

}  // namespace offload_native

// The Adam loop, written once and instantiated per ISA. V supplies the vector
// type and its operations; see adam_scalar.cpp, adam_avx2.cpp, adam_avx512.cpp.
//
// Everything here has internal linkage: each ISA translation unit is compiled
// for a different target, and a shared inline symbol could let the linker pick
// the AVX-512 copy for a caller on a CPU without AVX-512.
#pragma once

#include <type_traits>

#include "adam_args.h"

namespace offload_native {
namespace {

struct BF16 { uint16_t bits; };
struct F16 { uint16_t bits; };

// kStream: write the low-precision copy with non-temporal stores. That copy goes
// to the accelerator (or to the next forward, long after it left the cache),
// so pulling its lines into cache before overwriting them is wasted traffic.
// Moments stored as MomT (float or BF16); load_grad widens either to fp32.
template <class V, class MomT>
void store_moment(MomT* p, typename V::Vec x) {
  if constexpr (std::is_same_v<MomT, float>) V::store(p, x);
  else V::template store_out<false>(p, x);
}

template <class V, class GradT, class OutT, class MomT, class ParamT, bool kStream>
void adam_loop(const AdamBuffers& b, const AdamConsts& c, int64_t begin, int64_t end) {
  using Vec = typename V::Vec;
  ParamT* p = static_cast<ParamT*>(b.param);
  MomT* m = static_cast<MomT*>(b.exp_avg);
  MomT* v = static_cast<MomT*>(b.exp_avg_sq);
  const GradT* g = static_cast<const GradT*>(b.grad);
  OutT* out = static_cast<OutT*>(b.out);

  const Vec grad_scale = V::set1(c.grad_scale);
  const Vec beta1 = V::set1(c.beta1), one_minus_beta1 = V::set1(c.one_minus_beta1);
  const Vec beta2 = V::set1(c.beta2), one_minus_beta2 = V::set1(c.one_minus_beta2);
  const Vec eps = V::set1(c.eps), inv_bc2_sqrt = V::set1(c.inv_bc2_sqrt);
  const Vec step_size = V::set1(c.step_size);
  const Vec l2_decay = V::set1(c.l2_decay), decoupled_keep = V::set1(c.decoupled_keep);

  // The order of operations is Note [bit-identical Adam]; do not reassociate.
  for (int64_t i = begin; i < end; i += V::kWidth) {
    Vec pi = V::load_grad(p + i);
    Vec gi = V::mul(V::load_grad(g + i), grad_scale);
    if (c.use_l2) gi = V::add(gi, V::mul(pi, l2_decay));
    Vec mi = V::add(V::mul(V::load_grad(m + i), beta1), V::mul(gi, one_minus_beta1));
    Vec vi = V::add(V::mul(V::load_grad(v + i), beta2), V::mul(V::mul(gi, gi), one_minus_beta2));
    if (c.use_decoupled) pi = V::mul(pi, decoupled_keep);
    Vec denom = V::add(V::mul(V::sqrt(vi), inv_bc2_sqrt), eps);
    pi = V::sub(pi, V::mul(V::div(mi, denom), step_size));
    if constexpr (std::is_same_v<ParamT, float>) {
      V::store(p + i, pi);
    } else {
      pi = V::round_stochastic(pi, b.sr_key, static_cast<uint32_t>(b.index_base + i));  // exactly a bf16 value now
      V::template store_out<false>(p + i, pi);
    }
    store_moment<V>(m + i, mi);
    store_moment<V>(v + i, vi);
    if constexpr (!std::is_same_v<OutT, float>) V::template store_out<kStream>(out + i, pi);
  }
  if constexpr (kStream) V::fence();
}

// float as OutT means "no low-precision copy". Streaming stores need every
// vector of the copy aligned to its width; callers start ranges on multiples of
// 64 elements, so a 64-byte aligned buffer is enough.
template <class V, class GradT, class MomT, class ParamT>
void adam_dispatch_out(const AdamBuffers& b, const AdamConsts& c, int64_t begin, int64_t end) {
  if (b.out == nullptr) return adam_loop<V, GradT, float, MomT, ParamT, false>(b, c, begin, end);
  const bool stream = reinterpret_cast<uintptr_t>(b.out) % 64 == 0 && begin % 64 == 0;
  if (b.out_dtype == kBFloat16) {
    if (stream) return adam_loop<V, GradT, BF16, MomT, ParamT, true>(b, c, begin, end);
    return adam_loop<V, GradT, BF16, MomT, ParamT, false>(b, c, begin, end);
  }
  if (stream) return adam_loop<V, GradT, F16, MomT, ParamT, true>(b, c, begin, end);
  return adam_loop<V, GradT, F16, MomT, ParamT, false>(b, c, begin, end);
}

template <class V, class MomT, class ParamT>
void adam_dispatch_grad(const AdamBuffers& b, const AdamConsts& c, int64_t begin, int64_t end) {
  if (b.grad_dtype == kFloat32) return adam_dispatch_out<V, float, MomT, ParamT>(b, c, begin, end);
  if (b.grad_dtype == kBFloat16) return adam_dispatch_out<V, BF16, MomT, ParamT>(b, c, begin, end);
  return adam_dispatch_out<V, F16, MomT, ParamT>(b, c, begin, end);
}

template <class V, class ParamT>
void adam_dispatch_moments(const AdamBuffers& b, const AdamConsts& c, int64_t begin, int64_t end) {
  if (b.moment_dtype == kBFloat16) return adam_dispatch_grad<V, BF16, ParamT>(b, c, begin, end);
  return adam_dispatch_grad<V, float, ParamT>(b, c, begin, end);
}

// V::kStochastic: the ISA has round_stochastic; the others never see bf16
// master weights (adam.cpp runs those on a kernel that has it).
template <class V>
void adam_dispatch(const AdamBuffers& b, const AdamConsts& c, int64_t begin, int64_t end) {
  if constexpr (V::kStochastic) {
    if (b.param_dtype == kBFloat16) return adam_dispatch_moments<V, BF16>(b, c, begin, end);
  }
  return adam_dispatch_moments<V, float>(b, c, begin, end);
}

}  // namespace
}  // namespace offload_native

// A float's bits and back, without undefined behaviour. Internal linkage: each
// ISA translation unit keeps its own copy (see adam_loop.h).
#pragma once

#include <cstdint>
#include <cstring>

namespace offload_native {
namespace {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace
}  // namespace offload_native

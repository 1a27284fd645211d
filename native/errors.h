// Error reporting across the C ABI: a call returns 0 on success or -1 after
// recording a message that offload_last_error() returns on the same thread.
#pragma once

#include <cstdarg>
#include <cstdio>
#include <string>

#define OFFLOAD_API extern "C" __attribute__((visibility("default")))

namespace offload_native {

std::string& last_error();

__attribute__((format(printf, 1, 2))) inline int fail(const char* fmt, ...) {
  char buf[1024];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  last_error() = buf;
  return -1;
}

}  // namespace offload_native

#include "errors.h"

namespace offload_native {

std::string& last_error() {
  thread_local std::string message;
  return message;
}

}  // namespace offload_native

// Raised whenever an entry point's arguments change, so that offload/_native.py
// refuses a library built from older sources (it would read arguments that are
// not there) instead of calling it.
OFFLOAD_API int offload_abi_version() { return 4; }

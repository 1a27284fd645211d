#include "errors.h"

namespace offload_native {

std::string& last_error() {
  thread_local std::string message;
  return message;
}

}  // namespace offload_native

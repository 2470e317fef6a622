#include "base/spans.h"

#include <memory>

namespace mpijax {

char* Scratch(size_t bytes) {
  thread_local std::unique_ptr<char[]> buf;
  thread_local size_t size = 0;
  if (size < bytes) {
    buf.reset(new char[bytes]);
    size = bytes;
  }
  return buf.get();
}

}  // namespace mpijax

// The one exception type of the core. The c10d glue turns it into
// torch.distributed.DistBackendError; messages name op, rank, peer and reason.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace collx {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

// A deadline passed while waiting on a peer.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream ss;
  (ss << ... << args);
  return ss.str();
}

#define COLLX_CHECK(cond, ...)                          \
  do {                                                  \
    if (!(cond)) throw ::collx::Error(::collx::str(__VA_ARGS__)); \
  } while (0)

}  // namespace collx

#include "log.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>

#include "core/error.h"

namespace collx::torch_glue {

namespace {
constexpr const char* kNames[] = {"OFF", "WARN", "INFO", "TRACE"};
}

LogLevel parseLogLevel(const std::string& value) {
  std::string upper(value);
  std::transform(upper.begin(), upper.end(), upper.begin(), [](unsigned char c) { return std::toupper(c); });
  if (upper.empty() || upper == "OFF") return LogLevel::kOff;
  for (int i = 1; i <= int(LogLevel::kTrace); ++i) {
    if (upper == kNames[i]) return LogLevel(i);
  }
  throw Error(collx::str("collx: COLLX_DEBUG=", value, " must be WARN, INFO, TRACE or OFF"));
}

void logLine(LogLevel level, int rank, int size, const std::string& message) {
  char host[256] = "?";
  gethostname(host, sizeof(host) - 1);
  // One fprintf per line, so lines of concurrent threads do not interleave.
  std::fprintf(stderr, "%s:%d:%ld collx %s rank %d of %d: %s\n", host, int(getpid()), long(syscall(SYS_gettid)),
               kNames[int(level)], rank, size, message.c_str());
  std::fflush(stderr);
}

std::string millis(double ms) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3f", ms);
  return buf;
}

}  // namespace collx::torch_glue

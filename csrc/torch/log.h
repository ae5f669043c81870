// COLLX_DEBUG logging, in the spirit of NCCL_DEBUG: off by default; WARN
// reports every failed op (also those whose Work nobody waits on), INFO adds
// each group's setup and teardown, TRACE every op with its algorithm and time.
// Lines go to stderr as "host:pid:tid collx LEVEL rank r of n: message".
#pragma once

#include <string>

namespace collx::torch_glue {

enum class LogLevel { kOff = 0, kWarn, kInfo, kTrace };

// "" and OFF are off; WARN, INFO and TRACE; in any case. Throws Error otherwise.
LogLevel parseLogLevel(const std::string& value);

void logLine(LogLevel level, int rank, int size, const std::string& message);
// Milliseconds with three decimals, for log lines.
std::string millis(double ms);

}  // namespace collx::torch_glue

// What a framed connection has received and not consumed yet, read ahead of
// its frames so that a run of small frames costs one recv. Pair and P2PLink
// parse their headers here and take a payload's first bytes from here, then
// read a large rest in place (receiveSome).
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "../../copy.h"
#include "stream.h"

namespace collx::tcp {

// How one recv on a stream ended, EINTR retried: kFailed leaves errno.
enum class Received { kBytes, kWouldBlock, kEnded, kFailed };
Received receiveSome(Stream& s, void* dst, size_t bytes, size_t& got);

class RxBuffer {
 public:
  static constexpr size_t kCapacity = 64 << 10;
  // Payload remainders below this go through the buffer, so that one recv
  // picks up several small frames; larger ones are read in place.
  static constexpr size_t kDirectReadBytes = 16 << 10;

  RxBuffer() : bytes_(kCapacity) {}

  const char* data() const { return bytes_.data() + begin_; }
  size_t size() const { return end_ - begin_; }
  void consume(size_t n) { begin_ += n; }
  // Whether a payload's next `want` bytes go straight from the stream into
  // dst (receiveSome): nothing is buffered, the rest is large, and there is
  // a destination. Otherwise they come through the buffer (fill, take).
  bool readsInPlace(const char* dst, size_t want) const {
    return size() == 0 && want >= kDirectReadBytes && dst != nullptr;
  }
  // Copies up to `want` buffered bytes to dst (null: drops them) and
  // consumes them; returns how many.
  size_t take(char* dst, size_t want) {
    const size_t n = std::min(size(), want);
    if (n == 0) return 0;
    if (dst) copyBytes(dst, data(), n);
    begin_ += n;
    return n;
  }
  // Receives until at least `want` bytes (at most the capacity) are
  // buffered, first moving the unread ones to the front: kBytes once they
  // are, else why not.
  Received fill(Stream& s, size_t want) { return size() >= want ? Received::kBytes : receive(s, want); }

 private:
  Received receive(Stream& s, size_t want);

  std::vector<char> bytes_;
  size_t begin_ = 0;
  size_t end_ = 0;
};

}  // namespace collx::tcp

#include "rx_buffer.h"

#include <cerrno>
#include <cstring>

namespace collx::tcp {

Received receiveSome(Stream& s, void* dst, size_t bytes, size_t& got) {
  for (;;) {
    const ssize_t rc = s.recvSome(dst, bytes);
    if (rc > 0) {
      got = size_t(rc);
      return Received::kBytes;
    }
    if (rc == 0) return Received::kEnded;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return Received::kWouldBlock;
    if (errno != EINTR) return Received::kFailed;
  }
}

Received RxBuffer::receive(Stream& s, size_t want) {
  if (begin_ > 0) {
    memmove(bytes_.data(), data(), size());
    end_ -= begin_;
    begin_ = 0;
  }
  while (end_ < want) {
    size_t got = 0;
    const Received r = receiveSome(s, bytes_.data() + end_, bytes_.size() - end_, got);
    if (r != Received::kBytes) return r;
    end_ += got;
  }
  return Received::kBytes;
}

}  // namespace collx::tcp

// Messages queued for a stream, each its frame header and then its payload,
// written in order with as few sendmsg calls as the stream takes (Pair's
// collective messages and P2PLink's point-to-point ones).
#pragma once

#include <sys/uio.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

#include "wire.h"

namespace collx::tcp {

struct OutFrame {
  FrameHeader header;
  const char* payload;
  size_t bytes;  // of payload
  size_t done;   // of sizeof(header) + bytes, written so far
  uint64_t id;   // the owner's name for it, handed back once it is written
  size_t total() const { return sizeof(FrameHeader) + bytes; }
};

// The unwritten parts of the frames from `first` to `last` into iov, header
// then payload, whole frames only while at most `max` parts fit; returns how
// many parts.
template <class It>
int unwrittenParts(It first, It last, iovec* iov, int max) {
  int n = 0;
  for (It it = first; it != last && n + 2 <= max; ++it) {
    size_t off = it->done;
    if (off < sizeof(FrameHeader)) {
      iov[n++] = {reinterpret_cast<char*>(&it->header) + off, sizeof(FrameHeader) - off};
      off = sizeof(FrameHeader);
    }
    const size_t payloadDone = off - sizeof(FrameHeader);
    if (payloadDone < it->bytes) iov[n++] = {const_cast<char*>(it->payload) + payloadDone, it->bytes - payloadDone};
  }
  return n;
}

// Counts `sent` bytes written from the front of `frames` against them; each
// frame written whole leaves the queue, its id going to `written`. Returns
// the payload bytes among them (headers not counted).
inline size_t retireWritten(std::deque<OutFrame>& frames, size_t sent, std::vector<uint64_t>& written) {
  size_t payload = 0;
  while (sent > 0) {
    OutFrame& f = frames.front();
    const size_t take = std::min(sent, f.total() - f.done);
    payload += std::max(f.done + take, sizeof(FrameHeader)) - std::max(f.done, sizeof(FrameHeader));
    f.done += take;
    sent -= take;
    if (f.done == f.total()) {
      written.push_back(f.id);
      frames.pop_front();
    }
  }
  return payload;
}

}  // namespace collx::tcp

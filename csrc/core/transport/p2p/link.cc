#include "link.h"

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "../../copy.h"
#include "../../error.h"

namespace collx::tcp {

namespace {
constexpr size_t kRxBufferBytes = 64 << 10;
// Payload remainders at least this large are read in place, not through rx_.
constexpr size_t kDirectReadBytes = 16 << 10;
constexpr int kMaxIov = 64;
}  // namespace

P2PLink::P2PLink(int rank, int peer, Socket socket, std::unique_ptr<shm::Link> rings)
    : rank_(rank), peer_(peer), stream_(std::move(socket), std::move(rings)), rx_(kRxBufferBytes) {}

void P2PLink::fail(const std::string& what, int err) const {
  if (err == ECONNRESET || err == EPIPE) throw peerClosed(rank_, peer_, "p2p");
  throw Error(str("collx rank ", rank_, ": p2p connection to peer ", peer_, " ", what,
                  err ? str(": ", strerror(err)) : std::string()));
}

void P2PLink::queue(const FrameHeader& header, const void* payload, uint64_t id) {
  frames_.push_back({header, static_cast<const char*>(payload), payload ? size_t(header.bytes) : 0, 0, id});
}

bool P2PLink::unqueue(uint64_t id) {
  auto it = std::find_if(frames_.begin(), frames_.end(), [&](const OutFrame& o) { return o.id == id; });
  if (it == frames_.end() || it->done > 0) return false;
  frames_.erase(it);
  return true;
}

bool P2PLink::writing(uint64_t id) const {
  return !frames_.empty() && frames_.front().id == id && frames_.front().done > 0;
}

void P2PLink::write(std::vector<uint64_t>& written) {
  while (!frames_.empty() && stream_.valid()) {
    iovec iov[kMaxIov];
    const int n = unwrittenParts(frames_.begin(), frames_.end(), iov, kMaxIov);
    ssize_t rc = stream_.sendv(iov, n);
    if (rc < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      fail("failed while sending", errno);
    }
    retireWritten(frames_, size_t(rc), written);
  }
}

bool P2PLink::fill(size_t want) {
  if (rxEnd_ - rxBegin_ >= want) return true;
  if (rxBegin_ > 0) {
    memmove(rx_.data(), rx_.data() + rxBegin_, rxEnd_ - rxBegin_);
    rxEnd_ -= rxBegin_;
    rxBegin_ = 0;
  }
  while (rxEnd_ < want) {
    if (!stream_.valid()) return false;
    ssize_t rc = stream_.recvSome(rx_.data() + rxEnd_, rx_.size() - rxEnd_);
    if (rc > 0) {
      rxEnd_ += size_t(rc);
    } else if (rc == 0) {
      throw peerClosed(rank_, peer_, "p2p");
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return false;
    } else if (errno != EINTR) {
      fail("failed while receiving", errno);
    }
  }
  return true;
}

bool P2PLink::readHeader(FrameHeader& header) {
  if (!fill(sizeof(FrameHeader))) return false;
  memcpy(&header, rx_.data() + rxBegin_, sizeof(header));
  rxBegin_ += sizeof(header);
  if (header.magic != kFrameMagic) fail("delivered a corrupt frame (bad magic)", 0);
  return true;
}

size_t P2PLink::readPayload(char* dst, size_t want) {
  if (want == 0) return 0;
  if (rxEnd_ > rxBegin_ || want < kDirectReadBytes || !dst) {
    if (!fill(1)) return 0;
    size_t take = std::min(rxEnd_ - rxBegin_, want);
    if (dst) copyBytes(dst, rx_.data() + rxBegin_, take);
    rxBegin_ += take;
    return take;
  }
  for (;;) {
    ssize_t rc = stream_.recvSome(dst, want);
    if (rc > 0) return size_t(rc);
    if (rc == 0) throw peerClosed(rank_, peer_, "p2p");
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    if (errno != EINTR) fail("failed while receiving", errno);
  }
}

}  // namespace collx::tcp

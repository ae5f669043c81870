#include "link.h"

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "../../error.h"

namespace collx::tcp {

namespace {
constexpr int kMaxIov = 64;
}  // namespace

P2PLink::P2PLink(int rank, int peer, Socket socket, std::unique_ptr<shm::Link> rings)
    : rank_(rank), peer_(peer), stream_(std::move(socket), std::move(rings)) {}

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
  if (rx_.size() >= want) return true;
  if (!stream_.valid()) return false;
  return received(rx_.fill(stream_, want));
}

bool P2PLink::received(Received r) const {
  switch (r) {
    case Received::kBytes: return true;
    case Received::kWouldBlock: return false;
    case Received::kEnded: throw peerClosed(rank_, peer_, "p2p");
    case Received::kFailed: break;
  }
  fail("failed while receiving", errno);
}

bool P2PLink::readHeader(FrameHeader& header) {
  if (!fill(sizeof(FrameHeader))) return false;
  memcpy(&header, rx_.data(), sizeof(header));
  rx_.consume(sizeof(header));
  if (header.magic != kFrameMagic) fail("delivered a corrupt frame (bad magic)", 0);
  return true;
}

size_t P2PLink::readPayload(char* dst, size_t want) {
  if (want == 0) return 0;
  if (!rx_.readsInPlace(dst, want)) return fill(1) ? rx_.take(dst, want) : 0;
  size_t got = 0;
  return received(receiveSome(stream_, dst, want, got)) ? got : 0;
}

}  // namespace collx::tcp

#include "pair.h"

#include <poll.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "../../error.h"

namespace collx::tcp {

namespace {
constexpr int kMaxIov = 64;

std::string describe(OpKind kind, DataType dtype, uint64_t seq, uint32_t tag, uint64_t bytes) {
  size_t es = elementSize(dtype);
  return str(name(kind), " #", seq, " tag ", tag, " (", es ? bytes / es : bytes, " x ",
             name(dtype), ")");
}
}  // namespace

Pair::Pair(int rank, int peer, Socket socket, const std::set<uint64_t>* cancelled, std::unique_ptr<shm::Link> shm)
    : rank_(rank),
      peer_(peer),
      stream_(std::move(socket), std::move(shm)),
      connected_(stream_.valid()),
      cancelled_(cancelled) {}

void Pair::postSend(const Frame& f, const void* data, size_t bytes, uint64_t cookie) {
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.kind = uint8_t(f.kind);
  h.dtype = uint8_t(f.dtype);
  h.tag = f.tag;
  h.seq = f.seq;
  h.bytes = bytes;
  sends_.push_back(OutFrame{h, static_cast<const char*>(data), bytes, 0, cookie});
}

void Pair::postRecv(const Frame& f, void* data, size_t bytes, uint64_t cookie) {
  recvs_.push_back(RecvOp{f, static_cast<char*>(data), bytes, 0, false, cookie});
}

void Pair::failClosed() const {
  throwIfAbortNoted();
  throw peerClosed(rank_, peer_, "collective");
}

void Pair::fail(const std::string& what, int err) const {
  if (err == ECONNRESET || err == EPIPE) throw peerClosed(rank_, peer_, "collective");
  throw Error(str("collx rank ", rank_, ": connection to peer ", peer_, " ", what,
                  err ? str(": ", strerror(err)) : std::string()));
}

void Pair::progressSend(std::vector<uint64_t>& done) {
  while (!sends_.empty()) {
    // The unwritten parts of the queued messages in one sendmsg.
    iovec iov[kMaxIov];
    const int n = unwrittenParts(sends_.begin(), sends_.end(), iov, kMaxIov);
    ssize_t rc = stream_.sendv(iov, n);
    if (rc < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      int err = errno;
      if (err == EPIPE || err == ECONNRESET) throwSalvagedAbort();
      fail("failed while sending", err);
    }
    bytesSent_ += retireWritten(sends_, size_t(rc), done);
  }
}

bool Pair::fill(size_t want, bool endIsError) {
  switch (rx_.fill(stream_, want)) {
    case Received::kBytes: return true;
    case Received::kWouldBlock: return false;
    case Received::kEnded:
      ended_ = true;
      if (endIsError) failClosed();
      throwIfAbortNoted();
      return false;
    case Received::kFailed: break;
  }
  fail("failed while receiving", errno);
}

bool Pair::finishPartialSend(Deadline deadline) {
  OutFrame& op = sends_.front();
  while (op.done < op.total()) {
    iovec iov[2];
    const int n = unwrittenParts(sends_.begin(), sends_.begin() + 1, iov, 2);
    ssize_t rc = stream_.sendv(iov, n);
    if (rc > 0) {
      op.done += size_t(rc);
    } else if (rc < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (ms <= 0) return false;
      pollfd p{stream_.fd(), POLLOUT, 0};
      if (stream_.usesShm()) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));  // a reader drains the ring without a bell
      } else if (::poll(&p, 1, int(ms)) <= 0) {
        return false;
      }
    } else if (!(rc < 0 && errno == EINTR)) {
      return false;
    }
  }
  sends_.pop_front();
  return true;
}

void Pair::sendAbort(const std::string& reason, Deadline deadline, uint64_t seq) {
  if (!stream_.valid()) return;
  const std::string why = reason.substr(0, kMaxReasonBytes);
  // Rings: the note is read even if the frame below cannot be sent.
  stream_.leaveAbortNote(why);
  if (!sends_.empty() && sends_.front().done > 0 && !finishPartialSend(deadline)) return;
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.kind = uint8_t(OpKind::kAbort);
  h.seq = seq;
  h.bytes = why.size();
  std::string frame(reinterpret_cast<const char*>(&h), sizeof(h));
  frame += why;
  // A ring takes the frame whole or not at all: half a frame would read as garbage.
  if (stream_.writableNow() < frame.size()) return;
  iovec iov{frame.data(), frame.size()};
  ssize_t rc = stream_.sendv(&iov, 1);
  (void)rc;  // the connection closes next either way
}

bool Pair::skipCancel(const FrameHeader& h) {
  size_t n = std::min<size_t>(h.bytes, kMaxReasonBytes);
  if (!fill(sizeof(FrameHeader) + n)) return false;
  std::string why(rx_.data() + sizeof(FrameHeader), n);
  if (!cancelled_ || !cancelled_->count(h.seq)) {
    throw Error(str("collx rank ", rank_, ": peer ", peer_, " did not run ", name(OpKind(h.tag)), " #", h.seq,
                    ", which failed there: ", why));
  }
  rx_.consume(sizeof(FrameHeader) + n);  // every rank failed that op: nothing to match
  return true;
}

void Pair::throwAbort(const FrameHeader& h) {
  std::string why = "(no reason received)";
  size_t n = std::min<size_t>(h.bytes, kMaxReasonBytes);
  rx_.consume(sizeof(FrameHeader));
  try {
    if (fill(n)) why.assign(rx_.data(), n);
  } catch (const Error&) {
  }
  throw peerAborted(rank_, peer_, why);
}

void Pair::throwIfAbortNoted() const {
  const std::string why = stream_.peerAbortNote();
  if (!why.empty()) throw peerAborted(rank_, peer_, why);
}

void Pair::throwSalvagedAbort() {
  // The peer closed with our data unread, which resets the connection, but the
  // bytes it sent before (its abort frame last) stay readable. Read them all
  // and look from the end for a header whose byte count reaches exactly there.
  std::vector<char> tail(rx_.data(), rx_.data() + rx_.size());
  char chunk[64 << 10];
  for (;;) {
    ssize_t rc = ::recv(stream_.fd(), chunk, sizeof(chunk), MSG_DONTWAIT);
    if (rc > 0) tail.insert(tail.end(), chunk, chunk + rc);
    if (rc > 0 || (rc < 0 && errno == EINTR)) continue;
    break;
  }
  const size_t hs = sizeof(FrameHeader);
  for (size_t end = tail.size(), pos = end >= hs ? end - hs + 1 : 0; pos-- > 0 && end - pos <= hs + kMaxReasonBytes;) {
    FrameHeader h;
    memcpy(&h, tail.data() + pos, hs);
    if (h.magic == kFrameMagic && h.kind == uint8_t(OpKind::kAbort) && pos + hs + h.bytes == end) {
      throw peerAborted(rank_, peer_, std::string(tail.data() + pos + hs, h.bytes));
    }
  }
}

void Pair::throwIfRejectedHere(const FrameHeader& h) const {
  if (cancelled_ && cancelled_->count(h.seq)) {
    throw Error(str("collx rank ", rank_, ": peer ", peer_, " ran ",
                    describe(OpKind(h.kind), DataType(h.dtype), h.seq, h.tag, h.bytes),
                    ", which this rank rejected (its input was invalid here), so the group is out of step"));
  }
}

void Pair::checkHeader(const FrameHeader& h, const RecvOp& op) {
  if (h.magic == kFrameMagic && h.kind == uint8_t(OpKind::kAbort)) throwAbort(h);
  if (h.magic != kFrameMagic) {
    throw Error(str("collx rank ", rank_, ": corrupt frame from peer ", peer_,
                    " (bad magic) while expecting ",
                    describe(op.expect.kind, op.expect.dtype, op.expect.seq, op.expect.tag,
                             op.bytes)));
  }
  if (h.seq != op.expect.seq) throwIfRejectedHere(h);
  if (h.kind != uint8_t(op.expect.kind) || h.dtype != uint8_t(op.expect.dtype) ||
      h.seq != op.expect.seq || h.tag != op.expect.tag || h.bytes != op.bytes) {
    throw Error(str("collx rank ", rank_, ": mismatched collective with peer ", peer_,
                    ": peer sent ",
                    describe(OpKind(h.kind), DataType(h.dtype), h.seq, h.tag, h.bytes),
                    ", this rank expected ",
                    describe(op.expect.kind, op.expect.dtype, op.expect.seq, op.expect.tag,
                             op.bytes),
                    ". Every rank must call the same collectives in the same order with the "
                    "same sizes and dtypes."));
  }
}

void Pair::progressRecv(std::vector<uint64_t>& done) {
  while (!recvs_.empty()) {
    RecvOp& op = recvs_.front();
    if (!op.headerDone) {
      if (!fill(sizeof(FrameHeader))) return;
      FrameHeader h;
      memcpy(&h, rx_.data(), sizeof(h));
      if (h.magic == kFrameMagic && h.kind == uint8_t(OpKind::kCancel)) {
        if (!skipCancel(h)) return;
        continue;
      }
      checkHeader(h, op);
      rx_.consume(sizeof(h));
      op.headerDone = true;
    }
    while (op.got < op.bytes) {
      const size_t left = op.bytes - op.got;
      size_t got = rx_.take(op.data + op.got, left);
      if (got == 0 && !rx_.readsInPlace(op.data + op.got, left)) {
        if (!fill(1)) return;
        continue;
      }
      if (got == 0) {
        switch (receiveSome(stream_, op.data + op.got, left, got)) {
          case Received::kBytes: break;
          case Received::kWouldBlock: return;
          case Received::kEnded: failClosed();
          case Received::kFailed: fail("failed while receiving", errno);
        }
      }
      op.got += got;
      bytesReceived_ += got;
    }
    done.push_back(op.cookie);
    recvs_.pop_front();
  }
}

void Pair::checkAbort(uint64_t upTo) {
  if (!fill(sizeof(FrameHeader), false)) return;
  FrameHeader h;
  memcpy(&h, rx_.data(), sizeof(h));
  if (h.magic == kFrameMagic && h.kind == uint8_t(OpKind::kAbort) && h.seq <= upTo) throwAbort(h);
}

void Pair::checkControl(uint64_t upTo, bool endIsError, uint64_t abortsUpTo) {
  FrameHeader h;
  do {
    if (!fill(sizeof(FrameHeader), endIsError)) return;
    memcpy(&h, rx_.data(), sizeof(h));
    if (h.magic != kFrameMagic) return;
    if (h.kind == uint8_t(OpKind::kAbort)) {
      if (h.seq <= abortsUpTo) throwAbort(h);
      return;
    }
    if (h.kind != uint8_t(OpKind::kCancel)) throwIfRejectedHere(h);  // never to be received
  } while (h.kind == uint8_t(OpKind::kCancel) && h.seq <= upTo && skipCancel(h));
}

std::string Pair::describePending() const {
  std::string s;
  if (!recvs_.empty()) {
    const RecvOp& r = recvs_.front();
    s += str("receive of ", describe(r.expect.kind, r.expect.dtype, r.expect.seq, r.expect.tag, r.bytes),
             " (", r.got, " of ", r.bytes, " bytes arrived)");
  }
  if (!sends_.empty()) {
    const OutFrame& o = sends_.front();
    if (!s.empty()) s += " and ";
    s += str("send of ", describe(OpKind(o.header.kind), DataType(o.header.dtype), o.header.seq,
                                   o.header.tag, o.bytes));
  }
  return s;
}

}  // namespace collx::tcp

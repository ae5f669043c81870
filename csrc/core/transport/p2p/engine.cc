#include "engine.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "../../copy.h"
#include "../../error.h"

namespace collx::tcp {

namespace {
uint64_t tagOf(const FrameHeader& h) { return uint64_t(h.reserved2) << 32 | h.tag; }

// Frames whose `bytes` is a message size, not a payload that follows.
size_t payloadBytes(const FrameHeader& h) {
  return h.kind == uint8_t(OpKind::kP2PRequest) || h.kind == uint8_t(OpKind::kP2PClear) ? 0 : size_t(h.bytes);
}

std::string elements(uint64_t bytes, DataType dtype) {
  size_t es = elementSize(dtype);
  return str(es ? bytes / es : bytes, " x ", name(dtype));
}

std::exception_ptr error(const std::string& why) { return std::make_exception_ptr(Error(why)); }
}  // namespace

int64_t P2PEngine::millis(const Op& op) {
  // The deadline was computed just before the op was posted: round.
  return std::chrono::duration_cast<std::chrono::milliseconds>(op.deadline - op.posted + std::chrono::microseconds(500))
      .count();
}

P2PEngine::P2PEngine(int rank, std::vector<Socket> sockets, std::vector<std::unique_ptr<shm::Link>> rings,
                     Connect connect)
    : rank_(rank), connect_(std::move(connect)), links_(sockets.size()), incoming_(sockets.size()), linkError_(sockets.size()), linkRemote_(sockets.size()) {
  for (size_t peer = 0; peer < sockets.size(); ++peer) {
    if (sockets[peer].valid()) {
      links_[peer] = std::make_unique<P2PLink>(rank, int(peer), std::move(sockets[peer]), std::move(rings[peer]));
    }
  }
  wakeFd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  closeFd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  COLLX_CHECK(wakeFd_ >= 0 && closeFd_ >= 0, "collx rank ", rank, ": eventfd failed: ", strerror(errno));
}

P2PEngine::~P2PEngine() {
  close(str("collx rank ", rank_, ": the process group was destroyed"));
  ::close(wakeFd_);
  ::close(closeFd_);
}

void P2PEngine::install(int peer, Socket socket) {
  links_[size_t(peer)] = std::make_unique<P2PLink>(rank_, peer, std::move(socket), nullptr);
  wake();  // a sleeping progress thread watches it from its next poll
}

void P2PEngine::adopt(int peer, Socket socket) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!closed_.empty() || links_[size_t(peer)] || dead(peer)) return;  // dropped: the peer sees it close
  install(peer, std::move(socket));
  startThread();  // its messages are read (and parked) before any receive is posted
}

void P2PEngine::depart(int peer, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (dead(peer)) return;
  if (links_[size_t(peer)]) {
    failLink(peer, why, /*remote=*/true);
  } else {
    linkError_[size_t(peer)] = why;
    linkRemote_[size_t(peer)] = true;
    failIfNoPeers();
  }
  kick();
}

std::string P2PEngine::ensureLink(int peer, Deadline deadline) {
  if (!connect_ || peer < 0 || size_t(peer) >= links_.size() || peer == rank_) return "";
  std::lock_guard<std::mutex> one(connectMu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (links_[size_t(peer)] || !closed_.empty() || dead(peer)) return "";
  }
  Socket s;
  std::string why;
  bool gone = false, remote = false;
  try {
    s = connect_(peer, deadline, closeFd_);
  } catch (const TimeoutError& e) {
    why = e.what();
  } catch (const PeerClosedError& e) {
    why = e.what();
    gone = remote = true;
  } catch (const Error& e) {
    why = e.what();
    gone = true;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (s.valid() && !links_[size_t(peer)] && closed_.empty()) install(peer, std::move(s));
  if (!gone || links_[size_t(peer)] || !closed_.empty()) return why;
  linkError_[size_t(peer)] = why;
  linkRemote_[size_t(peer)] = remote;
  failIfNoPeers();
  return "";
}

std::string P2PEngine::describe(const Op& op, bool isSend) const {
  std::string who = op.peer == kAnySource ? std::string("any source") : str("peer ", op.peer);
  return str(isSend ? "send to " : "recv from ", who, " with tag ", uint32_t(op.tag), " (",
             elements(op.buffer.bytes, op.buffer.dtype), ")");
}

// ---- posting -----------------------------------------------------------------

void P2PEngine::postSend(int peer, uint64_t tag, P2PBuffer buffer, Deadline deadline, P2PDone done) {
  COLLX_CHECK(peer >= 0 && size_t(peer) < links_.size() && peer != rank_, "collx rank ", rank_,
              ": invalid p2p peer ", peer);
  const Clock::time_point posted = Clock::now();  // before connecting: the op's timeout runs from here
  const std::string late = ensureLink(peer, deadline);
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t id = ++nextId_;
  auto it = sends_.emplace(id, Op{peer, tag, buffer, deadline, posted, std::move(done)}).first;
  if (closed_.empty() && !dead(peer) && !links_[peer]) {
    finish(sends_, it, std::make_exception_ptr(TimeoutError(str(late, " (", describe(it->second, true), ")"))));
  } else if (!closed_.empty() || dead(peer)) {
    const std::string why = str(closed_.empty() ? linkError_[peer] : closed_, " (", describe(it->second, true), ")");
    finish(sends_, it, closed_.empty() ? linkError(peer, why) : error(why));
  } else {
    const bool eager = buffer.bytes <= kEagerBytes;
    FrameHeader h{kFrameMagic, uint8_t(eager ? OpKind::kP2P : OpKind::kP2PRequest), uint8_t(buffer.dtype), 0,
                  uint32_t(tag), uint32_t(tag >> 32), id, buffer.bytes};
    links_[peer]->queue(h, eager ? buffer.data : nullptr, eager ? id : id | kRequestBit);
    progressLink(peer);  // a small send usually leaves right here
  }
  if (sends_.count(id)) startThread();
  kick();
  runFinished(lock);
}

void P2PEngine::postRecv(int peer, uint64_t tag, P2PBuffer buffer, Deadline deadline, P2PDone done) {
  COLLX_CHECK(peer == kAnySource || (peer >= 0 && size_t(peer) < links_.size() && peer != rank_), "collx rank ",
              rank_, ": invalid p2p peer ", peer);
  const Clock::time_point posted = Clock::now();  // before connecting: the op's timeout runs from here
  const std::string late = peer == kAnySource ? "" : ensureLink(peer, deadline);
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t id = ++nextId_;
  auto it = recvs_.emplace(id, Op{peer, tag, buffer, deadline, posted, std::move(done)}).first;
  if (!closed_.empty()) {
    finish(recvs_, it, error(str(closed_, " (", describe(it->second, false), ")")));
  } else if (peer != kAnySource && !dead(peer) && !links_[peer]) {
    finish(recvs_, it, std::make_exception_ptr(TimeoutError(str(late, " (", describe(it->second, false), ")"))));
  } else {
    // A message that fully arrived before its sender left is still received.
    matchParked(it);
    if (recvs_.count(id) && !it->second.matched) {
      if (peer != kAnySource && dead(peer)) {
        finish(recvs_, it, linkError(peer, str(linkError_[peer], " (", describe(it->second, false), ")")));
      } else {
        failIfNoPeers();
      }
    }
  }
  if (recvs_.count(id)) startThread();
  kick();
  runFinished(lock);
}

bool P2PEngine::accept(OpMap::iterator r, int peer, const FrameHeader& h) {
  Op& op = r->second;
  op.source = peer;
  if (h.bytes == op.buffer.bytes && h.dtype == uint8_t(op.buffer.dtype)) {
    op.matched = true;
    return true;
  }
  const std::string why =
      str("collx rank ", rank_, ": mismatched send/recv with peer ", peer, " (tag ", uint32_t(op.tag), "): the peer sent ",
          elements(h.bytes, DataType(h.dtype)), ", this rank's recv expected ",
          elements(op.buffer.bytes, op.buffer.dtype), "; nothing was written to the receive buffer");
  if (h.kind == uint8_t(OpKind::kP2PRequest)) queueControl(peer, OpKind::kP2PRefuse, h.seq, why);
  finish(recvs_, r, error(why));
  return false;
}

void P2PEngine::matchParked(OpMap::iterator r) {
  const Op& op = r->second;
  for (auto p = parked_.begin(); p != parked_.end(); ++p) {
    Parked& m = p->second;
    if (m.claimedBy || m.dropped || tagOf(m.header) != op.tag || (op.peer != kAnySource && op.peer != m.peer)) continue;
    const int peer = m.peer;
    const FrameHeader h = m.header;
    if (!accept(r, peer, h)) {
      if (m.complete) parked_.erase(p); else m.dropped = true;  // that message was this receive's
      return;
    }
    if (h.kind == uint8_t(OpKind::kP2PRequest)) {
      r->second.awaiting = h.seq;
      parked_.erase(p);
      queueControl(peer, OpKind::kP2PClear, h.seq);
    } else if (m.complete) {
      if (h.bytes) copyBytes(r->second.buffer.data, m.payload.data(), h.bytes);
      parked_.erase(p);
      finish(recvs_, r, nullptr);
    } else {
      m.claimedBy = r->first;  // onPayload copies it over once it has all arrived
    }
    return;
  }
}

P2PEngine::OpMap::iterator P2PEngine::match(int peer, uint64_t tag) {
  for (auto it = recvs_.begin(); it != recvs_.end(); ++it) {
    const Op& op = it->second;
    if (!op.matched && op.tag == tag && (op.peer == peer || op.peer == kAnySource)) return it;
  }
  return recvs_.end();
}

void P2PEngine::queueControl(int peer, OpKind kind, uint64_t seq, const std::string& text) {
  if (!links_[peer] || !links_[peer]->alive()) return;
  FrameHeader h{kFrameMagic, uint8_t(kind), 0, 0, 0, 0, seq, 0};
  if (text.empty()) {
    links_[peer]->queue(h, nullptr, 0);
    return;
  }
  const uint64_t id = ++nextId_ | kNoteBit;
  const std::string& note = notes_[id] = text.substr(0, kMaxReasonBytes);
  h.bytes = note.size();
  links_[peer]->queue(h, note.data(), id);
}

// ---- progress ----------------------------------------------------------------

void P2PEngine::progress() {
  for (size_t peer = 0; peer < links_.size(); ++peer) {
    if (links_[peer] && links_[peer]->alive()) progressLink(int(peer));
  }
}

void P2PEngine::progressLink(int peer) {
  P2PLink& link = *links_[peer];
  Incoming& in = incoming_[peer];
  try {
    std::vector<uint64_t> written;
    link.write(written);
    onWritten(written);
    for (;;) {
      if (!in.active) {
        if (!link.readHeader(in.header)) break;
        in = Incoming{true, in.header, nullptr, 0, 0, 0, {}};
        onHeader(peer, in);
      }
      const size_t want = payloadBytes(in.header) - in.got;
      if (want > 0) {
        size_t n = link.readPayload(in.dst ? in.dst + in.got : nullptr, want);
        if (n == 0) break;
        in.got += n;
        if (n < want) continue;
      }
      in.active = false;
      onPayload(peer, in);
    }
    // Replies queued while reading (clears, data of cleared sends) leave now.
    written.clear();
    link.write(written);
    onWritten(written);
  } catch (const Error& e) {
    failLink(peer, e.what(), dynamic_cast<const PeerClosedError*>(&e) != nullptr);
  }
}

void P2PEngine::onHeader(int peer, Incoming& in) {
  const FrameHeader& h = in.header;
  switch (OpKind(h.kind)) {
    case OpKind::kP2P: {
      auto r = match(peer, tagOf(h));
      if (r == recvs_.end()) {
        const uint64_t id = ++nextId_;
        Parked& m = parked_[id] = Parked{peer, h, std::vector<char>(h.bytes)};
        in.parked = id;
        in.dst = m.payload.data();
      } else if (accept(r, peer, h)) {
        in.recv = r->first;
        in.dst = static_cast<char*>(r->second.buffer.data);
      }  // else refused: the payload is discarded
      break;
    }
    case OpKind::kP2PRequest: {
      auto r = match(peer, tagOf(h));
      if (r == recvs_.end()) {
        parked_[++nextId_] = Parked{peer, h, {}, true};
      } else if (accept(r, peer, h)) {
        r->second.awaiting = h.seq;
        queueControl(peer, OpKind::kP2PClear, h.seq);
      }
      break;
    }
    case OpKind::kP2PClear: {
      auto s = sends_.find(h.seq);
      if (s == sends_.end() || s->second.peer != peer || s->second.cleared) break;  // withdrawn meanwhile
      s->second.cleared = true;
      const Op& op = s->second;
      FrameHeader d{kFrameMagic, uint8_t(OpKind::kP2PData), uint8_t(op.buffer.dtype), 0, uint32_t(op.tag),
                    uint32_t(op.tag >> 32), h.seq, op.buffer.bytes};
      links_[peer]->queue(d, op.buffer.data, h.seq);
      break;
    }
    case OpKind::kP2PData: {
      for (auto& [id, op] : recvs_) {
        if (op.source != peer || op.awaiting != h.seq) continue;
        COLLX_CHECK(op.buffer.bytes == h.bytes, "collx rank ", rank_, ": corrupt p2p data frame from peer ", peer);
        in.recv = id;
        in.dst = static_cast<char*>(op.buffer.data);
        break;
      }
      break;  // not found: that receive timed out; discard
    }
    case OpKind::kP2PRefuse:
    case OpKind::kCancel:
    case OpKind::kAbort:
      COLLX_CHECK(h.bytes <= kMaxReasonBytes, "collx rank ", rank_, ": corrupt p2p frame from peer ", peer);
      in.reason.resize(h.bytes);
      in.dst = in.reason.data();
      break;
    default:
      throw Error(str("collx rank ", rank_, ": unexpected ", name(OpKind(h.kind)), " frame from peer ", peer,
                      " on the p2p connection"));
  }
}

void P2PEngine::onPayload(int peer, Incoming& in) {
  const FrameHeader& h = in.header;
  switch (OpKind(h.kind)) {
    case OpKind::kP2P:
    case OpKind::kP2PData:
      if (in.recv) {
        auto r = recvs_.find(in.recv);
        if (r != recvs_.end()) finish(recvs_, r, nullptr);
      } else if (in.parked) {
        auto p = parked_.find(in.parked);
        if (p == parked_.end()) break;  // the connection failed meanwhile
        Parked& m = p->second;
        m.complete = true;
        if (m.dropped) {
          parked_.erase(p);
        } else if (m.claimedBy) {
          auto r = recvs_.find(m.claimedBy);
          if (h.bytes) copyBytes(r->second.buffer.data, m.payload.data(), h.bytes);
          parked_.erase(p);
          finish(recvs_, r, nullptr);
        }
      }
      break;
    case OpKind::kP2PRefuse: {
      auto s = sends_.find(h.seq);
      if (s != sends_.end()) {
        finish(sends_, s, error(str("collx rank ", rank_, ": peer ", peer, " refused this rank's ",
                                    describe(s->second, true), ": ", in.reason)));
      }
      break;
    }
    case OpKind::kCancel:
      for (auto p = parked_.begin(); p != parked_.end(); ++p) {
        if (p->second.peer == peer && p->second.header.kind == uint8_t(OpKind::kP2PRequest) &&
            p->second.header.seq == h.seq) {
          parked_.erase(p);  // withdrawn before any receive matched it
          break;
        }
      }
      for (auto r = recvs_.begin(); r != recvs_.end(); ++r) {
        if (r->second.source != peer || r->second.awaiting != h.seq) continue;
        finish(recvs_, r, error(str("collx rank ", rank_, ": peer ", peer, " withdrew the send that this rank's ",
                                    describe(r->second, false), " matched: ", in.reason)));
        break;
      }
      break;
    case OpKind::kAbort:
      throw peerAborted(rank_, peer, in.reason);
    default:
      break;
  }
}

void P2PEngine::onWritten(const std::vector<uint64_t>& ids) {
  for (uint64_t id : ids) {
    if (id & kNoteBit) {
      notes_.erase(id);
    } else if (id & kRequestBit) {
      auto s = sends_.find(id & ~kRequestBit);
      if (s != sends_.end()) s->second.requested = true;
    } else if (id) {
      auto s = sends_.find(id);
      if (s != sends_.end()) finish(sends_, s, nullptr);
    }
  }
}

}  // namespace collx::tcp

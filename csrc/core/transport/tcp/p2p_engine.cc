#include "p2p_engine.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "../../error.h"

namespace collx::tcp {

namespace {
uint64_t tagOf(const FrameHeader& h) { return uint64_t(h.reserved2) << 32 | h.tag; }

// Ids of queued frames (P2PLink::queue): a send's own id for its payload
// frame; with kRequestBit for its request; with kNoteBit for a control frame
// carrying text (notes_); 0 for one that carries nothing.
constexpr uint64_t kRequestBit = 1ull << 63;
constexpr uint64_t kNoteBit = 1ull << 62;

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

P2PEngine::P2PEngine(int rank, std::vector<Socket> sockets, std::vector<std::unique_ptr<shm::Link>> rings)
    : rank_(rank), links_(sockets.size()), incoming_(sockets.size()), linkError_(sockets.size()), linkRemote_(sockets.size()) {
  for (size_t peer = 0; peer < sockets.size(); ++peer) {
    if (sockets[peer].valid()) {
      links_[peer] = std::make_unique<P2PLink>(rank, int(peer), std::move(sockets[peer]), std::move(rings[peer]));
    }
  }
  wakeFd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  COLLX_CHECK(wakeFd_ >= 0, "collx rank ", rank, ": eventfd failed: ", strerror(errno));
}

P2PEngine::~P2PEngine() {
  close(str("collx rank ", rank_, ": the process group was destroyed"));
  ::close(wakeFd_);
}

std::string P2PEngine::describe(const Op& op, bool isSend) const {
  std::string who = op.peer == kAnySource ? std::string("any source") : str("peer ", op.peer);
  return str(isSend ? "send to " : "recv from ", who, " with tag ", uint32_t(op.tag), " (",
             elements(op.buffer.bytes, op.buffer.dtype), ")");
}

// ---- posting -----------------------------------------------------------------

void P2PEngine::postSend(int peer, uint64_t tag, P2PBuffer buffer, Deadline deadline, P2PDone done) {
  std::unique_lock<std::mutex> lock(mu_);
  COLLX_CHECK(peer >= 0 && size_t(peer) < links_.size() && links_[peer], "collx rank ", rank_, ": invalid p2p peer ",
              peer);
  const uint64_t id = ++nextId_;
  auto it = sends_.emplace(id, Op{peer, tag, buffer, deadline, Clock::now(), std::move(done)}).first;
  if (!closed_.empty() || !links_[peer]->alive()) {
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
  std::unique_lock<std::mutex> lock(mu_);
  COLLX_CHECK(peer == kAnySource || (peer >= 0 && size_t(peer) < links_.size() && links_[peer]), "collx rank ",
              rank_, ": invalid p2p peer ", peer);
  const uint64_t id = ++nextId_;
  auto it = recvs_.emplace(id, Op{peer, tag, buffer, deadline, Clock::now(), std::move(done)}).first;
  if (!closed_.empty()) {
    finish(recvs_, it, error(str(closed_, " (", describe(it->second, false), ")")));
  } else {
    // A message that fully arrived before its sender left is still received.
    matchParked(it);
    if (recvs_.count(id) && !it->second.matched) {
      if (peer != kAnySource && !links_[peer]->alive()) {
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
      if (h.bytes) memcpy(r->second.buffer.data, m.payload.data(), h.bytes);
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
  if (!links_[peer]->alive()) return;
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
          if (h.bytes) memcpy(r->second.buffer.data, m.payload.data(), h.bytes);
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

// ---- failures and deadlines --------------------------------------------------

void P2PEngine::finish(OpMap& ops, OpMap::iterator it, std::exception_ptr err) {
  if (!err) (&ops == &sends_ ? bytesSent_ : bytesReceived_) += it->second.buffer.bytes;
  finished_.push_back({std::move(it->second.done), it->second.source, err});
  ops.erase(it);
}

std::exception_ptr P2PEngine::linkError(int peer, const std::string& why) const {
  if (linkRemote_[peer]) return std::make_exception_ptr(PeerClosedError(why));
  return error(why);
}

void P2PEngine::failLink(int peer, const std::string& why, bool remote) {
  links_[peer]->close();
  linkError_[peer] = why;
  linkRemote_[peer] = remote;
  incoming_[peer] = Incoming{};
  for (auto it = sends_.begin(); it != sends_.end();) {
    auto cur = it++;
    if (cur->second.peer == peer) finish(sends_, cur, linkError(peer, str(why, " (", describe(cur->second, true), ")")));
  }
  for (auto it = recvs_.begin(); it != recvs_.end();) {
    auto cur = it++;
    if (cur->second.peer == peer || (cur->second.matched && cur->second.source == peer)) {
      finish(recvs_, cur, linkError(peer, str(why, " (", describe(cur->second, false), ")")));
    }
  }
  // Messages that fully arrived stay receivable; the rest never will be.
  for (auto it = parked_.begin(); it != parked_.end();) {
    auto cur = it++;
    if (cur->second.peer == peer && (!cur->second.complete || cur->second.header.kind != uint8_t(OpKind::kP2P))) {
      parked_.erase(cur);
    }
  }
  failIfNoPeers();
}

void P2PEngine::failIfNoPeers() {
  if (std::any_of(links_.begin(), links_.end(), [](auto& l) { return l && l->alive(); })) return;
  for (auto it = recvs_.begin(); it != recvs_.end();) {
    auto cur = it++;
    if (cur->second.peer == kAnySource && !cur->second.matched) {
      finish(recvs_, cur, error(str("collx rank ", rank_, ": no peer is left to send to this rank's ",
                                    describe(cur->second, false))));
    }
  }
}

Deadline P2PEngine::nextDeadline() const {
  Deadline next = Deadline::max();
  for (auto* ops : {&sends_, &recvs_}) {
    for (const auto& [id, op] : *ops) next = std::min(next, op.deadline);
  }
  return next;
}

void P2PEngine::expire() {
  const Deadline now = Clock::now();
  auto timedOut = [&](const Op& op, bool isSend, const char* state) {
    return std::make_exception_ptr(
        TimeoutError(str("collx rank ", rank_, ": Timed out after ", millis(op), " ms in ", describe(op, isSend), ": ", state)));
  };
  for (auto it = sends_.begin(); it != sends_.end();) {
    auto s = it++;
    Op& op = s->second;
    if (op.deadline > now) continue;
    P2PLink& link = *links_[op.peer];
    const uint64_t id = s->first;
    if (link.writing(id)) {  // half on the wire: the connection cannot go on
      failLink(op.peer, str("collx rank ", rank_, ": Timed out after ", millis(op), " ms while sending to peer ", op.peer, " (tag ", uint32_t(op.tag), "): the peer stopped reading"));
      it = sends_.upper_bound(id);  // failLink erased ops
      continue;
    }
    link.unqueue(id);
    link.unqueue(id | kRequestBit);
    if (op.requested) queueControl(op.peer, OpKind::kCancel, id, "the send timed out on its rank");
    finish(sends_, s, timedOut(op, true, op.requested ? "the peer posted no matching recv" : "the peer did not read it"));
  }
  for (auto it = recvs_.begin(); it != recvs_.end();) {
    auto r = it++;
    Op& op = r->second;
    if (op.deadline > now) continue;
    for (auto& in : incoming_) {
      if (in.recv == r->first) in.recv = 0, in.dst = nullptr;  // the rest of its payload is discarded
    }
    for (auto& [id, m] : parked_) {
      if (m.claimedBy == r->first) m.claimedBy = 0;  // left for a later receive
    }
    finish(recvs_, r, timedOut(op, false, op.matched ? "its data did not arrive" : "no matching send arrived"));
  }
}

void P2PEngine::close(const std::string& why) {
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_.empty()) {
    closed_ = why;
    for (auto* ops : {&sends_, &recvs_}) {
      while (!ops->empty()) finish(*ops, ops->begin(), error(str(why, " (", describe(ops->begin()->second, ops == &sends_), ")")));
    }
    parked_.clear();
    notes_.clear();
    for (auto& l : links_) {
      if (l) l->close();
    }
  }
  stopping_ = true;
  wake();
  std::thread thread = std::move(thread_);
  runFinished(lock);
  lock.unlock();
  if (thread.joinable()) {
    if (thread.get_id() == std::this_thread::get_id()) thread.detach();  // closed from a callback
    else thread.join();
  }
}

}  // namespace collx::tcp

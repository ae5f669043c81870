// How a p2p op ends other than by completing: its link fails, its deadline
// passes, or the engine closes.
#include <unistd.h>

#include <algorithm>

#include "../../error.h"
#include "engine.h"

namespace collx::tcp {

namespace {
std::exception_ptr error(const std::string& why) { return std::make_exception_ptr(Error(why)); }
}  // namespace

void P2PEngine::finish(OpMap& ops, OpMap::iterator it, std::exception_ptr err) {
  const Op& op = it->second;
  const int peer = op.source >= 0 ? op.source : op.peer;
  if (!err && peer >= 0 && links_[size_t(peer)]) {
    const Carrier c = links_[size_t(peer)]->usesShm() ? Carrier::kShmRing : Carrier::kTcp;
    const bool isSend = &ops == &sends_;
    counters_.add(c, isSend ? op.buffer.bytes : 0, isSend ? 0 : op.buffer.bytes);
  }
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
  // A peer not connected yet (a lazy group's) may still send.
  for (size_t peer = 0; peer < links_.size(); ++peer) {
    if (int(peer) != rank_ && !dead(int(peer))) return;
  }
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
    const uint64_t one = 1;
    (void)!::write(closeFd_, &one, sizeof(one));  // a dial in progress gives up
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

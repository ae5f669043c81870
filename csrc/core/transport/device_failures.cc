// How a group's transport breaks (device.h): an interrupt from another
// thread, the user's abort, and the failing op's: the sticky error, the abort
// frames and the note that tell the peers why, and a timeout's report of whom
// it waited for. Every later op fails at once with the same error.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include "../error.h"
#include "device.h"

namespace collx::tcp {

namespace {
// How long a failing rank may spend finishing half-sent messages so that its
// abort frames reach the peers (all pairs together).
constexpr auto kAbortGrace = std::chrono::milliseconds(200);
// The same for an abort the user asked for, which must return within 100 ms.
constexpr auto kUserAbortGrace = std::chrono::milliseconds(20);
}  // namespace

void Device::interrupt(const std::string& why, bool tellPeers) {
  std::lock_guard<std::mutex> lock(socketsMutex_);
  if (interrupted_) return;
  interruptReason_ = why;
  interrupted_ = true;
  // A read shut down wakes a poll at once (the read sees an end); the
  // waiter, failing, still writes its abort frames.
  for (auto& p : pairs_) {
    if (p && p->fd() >= 0) ::shutdown(p->fd(), tellPeers ? SHUT_RD : SHUT_RDWR);
  }
  const uint64_t one = 1;  // a waiter polling only for POLLOUT wakes too
  (void)!::write(wakeFd_, &one, sizeof(one));
}

void Device::abort(const std::string& why) {
  // No op is in flight (one would have failed on interrupt()): every posted one finished.
  if (error_.empty()) breakGroup(why, Failure::kAborted, Clock::now() + kUserAbortGrace, seqPosted_ + 1);
}

void Device::throwIfBroken() const {
  if (error_.empty()) return;
  if (errorIsTimeout_) throw TimeoutError(error_);
  throw Error(error_);
}

void Device::breakWith(const std::exception& e, bool isTimeout) {
  std::string why = e.what();
  bool aborting;
  {
    std::lock_guard<std::mutex> lock(socketsMutex_);
    aborting = interrupted_;
    if (aborting) why = interruptReason_;
  }
  Failure kind = Failure::kLocal;
  if (aborting) {
    kind = Failure::kAborted;
  } else if (isTimeout) {
    kind = Failure::kTimeout;
  } else if (dynamic_cast<const PeerAbortedError*>(&e) || dynamic_cast<const PeerClosedError*>(&e)) {
    kind = Failure::kRemote;
  }
  breakGroup(why, kind, Clock::now() + (aborting ? kUserAbortGrace : kAbortGrace), seqPosted_);
  throwIfBroken();
  throw Error(error_);  // unreachable: error_ is set
}

void Device::breakGroup(const std::string& why, Failure kind, Deadline grace, uint64_t unfinished) {
  error_ = why;
  errorIsTimeout_ = kind == Failure::kTimeout;
  failure_ = kind;
  // Tell every peer why, so that ranks waiting on this one fail now with the
  // cause instead of at their timeout; then close, since the byte streams
  // are at unknown positions and nothing more can be matched. Finishing a
  // half-sent message for that may take a peer that reads until `grace`.
  for (auto& p : pairs_) {
    if (p) p->sendAbort(error_, grace, unfinished);
  }
  // A peer that was not reading gets no frame: it finds the note when it
  // sees the close (waitSome), as do peers not yet connected.
  connector_->leaveNote(error_);
  closeSockets();
  pending_ = 0;
}

void Device::timeout() {
  std::string what;
  std::vector<int> waited;
  for (auto& p : pairs_) {
    if (!p || (!p->wantsRead() && !p->wantsWrite())) continue;
    what += str(what.empty() ? "" : "; ", "peer ", p->peer(), ": ", p->describePending());
    if (std::find(waited.begin(), waited.end(), p->peer()) == waited.end()) waited.push_back(p->peer());
  }
  {
    std::lock_guard<std::mutex> lock(progressMutex_);
    missing_ = std::move(waited);
    missingOfAll_ = false;
  }
  breakWith(TimeoutError(str("collx rank ", rank_, ": Timed out waiting for ", what)), true);
}

std::vector<int> Device::missing(bool* ofAll) const {
  std::lock_guard<std::mutex> lock(progressMutex_);
  if (ofAll) *ofAll = missingOfAll_;
  return missing_;
}

}  // namespace collx::tcp

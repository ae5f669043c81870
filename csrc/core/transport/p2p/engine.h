// The TCP implementation of PointToPoint (p2p.h): one connection per peer,
// apart from the collectives' (rendezvous.h, channel kPointToPoint), and a
// progress thread of its own, started by the first post.
//
// A send of up to kEagerBytes goes at once, payload included; the receiver
// parks it in a heap buffer if no receive matches yet. A larger send asks
// first and moves its data once the receiver has matched it, so a large
// message never waits in memory for a receive nor blocks the connection:
//
//   sender                              receiver
//   ------                              --------
//   small:  [kP2P hdr|payload]   --->   match a posted recv (check size,
//                                       dtype) and read into it, else park
//   large:  [kP2PRequest hdr]    --->   match now or when a recv is posted;
//                                <---   [kP2PClear]     (or [kP2PRefuse why])
//           [kP2PData hdr|payload] ->   read into the matched recv
//           [kCancel why]        --->   (the sender gave up: fail the recv)
//
// Matching: an arriving message goes to the first posted receive (in post
// order) whose peer (or any source) and tag fit; a posted receive takes the
// first parked message that fits. Frames of one connection arrive in order,
// so one pair's messages with one tag match in posting order.
//
// Every thread holds mu_ while it touches state. The progress thread sleeps
// in poll(); posts write what they can inline and wake it only when it must
// watch for more; a waiter may drive progress itself for a while (spin).
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../p2p.h"
#include "link.h"

namespace collx::tcp {

class P2PEngine : public PointToPoint {
 public:
  // Connects to `peer` by `deadline`; `wakeFd` readable: give up (connector.h's take).
  using Connect = std::function<Socket(int peer, Deadline deadline, int wakeFd)>;

  // `sockets`: a connected socket per peer (invalid at `rank`, and for the
  // peers of a lazy group that are not connected yet); `rings`: per peer,
  // shared memory on this host or null (the socket). `connect`: dials a
  // missing peer at its first post (a lazy group's); missing peers that
  // dial first arrive through adopt().
  P2PEngine(int rank, std::vector<Socket> sockets, std::vector<std::unique_ptr<shm::Link>> rings,
            Connect connect = {});
  ~P2PEngine() override;

  // A connection that `peer` opened (thread-safe).
  void adopt(int peer, Socket socket);
  // `peer` left the group (it closed it, or died, during setup): its ops
  // fail with `why`, now and later, and its connections are dropped.
  void depart(int peer, const std::string& why);

  void postSend(int peer, uint64_t tag, P2PBuffer buffer, Deadline deadline, P2PDone done) override;
  void postRecv(int peer, uint64_t tag, P2PBuffer buffer, Deadline deadline, P2PDone done) override;
  void spin(const std::function<bool()>& finished, std::chrono::microseconds budget) override;
  void close(const std::string& why) override;
  TransportCounters counters() const override { return counters_.snapshot(); }

  // Messages up to this size go eagerly; larger ones ask first.
  static constexpr size_t kEagerBytes = 64 << 10;

 private:
  // Ids of queued frames (P2PLink::queue): a send's own id for its payload
  // frame; with kRequestBit for its request; with kNoteBit for a control
  // frame carrying text (notes_); 0 for one that carries nothing.
  static constexpr uint64_t kRequestBit = 1ull << 63;
  static constexpr uint64_t kNoteBit = 1ull << 62;

  struct Op {
    int peer;  // kAnySource for such a receive
    uint64_t tag;
    P2PBuffer buffer;
    Deadline deadline;
    Clock::time_point posted;
    P2PDone done;
    int source = -1;         // receive: the peer whose message it matched
    bool matched = false;    // receive: a message is bound to it
    uint64_t awaiting = 0;   // receive: the cleared send it waits for (peer's id)
    bool requested = false;  // large send: its request has left
    bool cleared = false;    // large send: its data is queued
  };
  // A message that arrived before a receive for it: parked.
  struct Parked {
    int peer;
    FrameHeader header;
    std::vector<char> payload;  // small sends
    bool complete = false;      // payload fully arrived (a request: always)
    uint64_t claimedBy = 0;     // a receive waits for the rest of the payload
    bool dropped = false;       // consumed by a receive that failed on it
  };
  // What a connection's reader is in the middle of.
  struct Incoming {
    bool active = false;
    FrameHeader header{};
    char* dst = nullptr;  // where the payload goes; null: discarded
    size_t got = 0;
    uint64_t recv = 0;    // the receive it fills
    uint64_t parked = 0;  // or the parked message
    std::string reason;   // or the text of a refusal, cancel or abort
  };
  struct Finished {
    P2PDone done;
    int source;
    std::exception_ptr error;
  };
  using OpMap = std::map<uint64_t, Op>;  // by id: post order

  // Before a post to `peer` (no lock held): connects to it if it has no link
  // yet. Returns why it could not where only this op should fail (the peer
  // did not answer in time); a peer that is gone fails its link instead.
  std::string ensureLink(int peer, Deadline deadline);
  // Under mu_: a link over `socket`, watched by the progress thread.
  void install(int peer, Socket socket);
  // Under mu_: the peer's link failed or could not be made.
  bool dead(int peer) const { return !linkError_[size_t(peer)].empty(); }
  void startThread();
  void wake();
  // Wakes the progress thread if it sleeps without watching for what another
  // thread just queued, or past a new deadline. Every thread but the progress
  // thread calls it before it lets go of mu_ after changing state.
  void kick();
  void loop();
  // Moves bytes on every live connection; a failing one fails its ops.
  void progress();
  void progressLink(int peer);
  void onHeader(int peer, Incoming& in);
  void onPayload(int peer, Incoming& in);
  void onWritten(const std::vector<uint64_t>& ids);
  // The first posted, unmatched receive that a message from `peer` with `tag` fits.
  OpMap::iterator match(int peer, uint64_t tag);
  // Binds receive `r` to a parked message, or leaves it posted.
  void matchParked(OpMap::iterator r);
  // Binds receive `r` to `peer`'s message `header`; false if refused.
  bool accept(OpMap::iterator r, int peer, const FrameHeader& header);
  void queueControl(int peer, OpKind kind, uint64_t seq, const std::string& text = {});
  void expire();
  Deadline nextDeadline() const;
  void finish(OpMap& ops, OpMap::iterator it, std::exception_ptr error);
  // `remote`: the peer is gone (PeerClosedError), not this rank's failure.
  void failLink(int peer, const std::string& why, bool remote = false);
  // The error of an op on `peer`'s failed link, typed as the link's was.
  std::exception_ptr linkError(int peer, const std::string& why) const;
  void failIfNoPeers();
  // Runs the finished ops' callbacks with the lock released.
  void runFinished(std::unique_lock<std::mutex>& lock);
  std::string describe(const Op& op, bool isSend) const;
  static int64_t millis(const Op& op);  // the op's timeout

  const int rank_;
  const Connect connect_;
  std::mutex connectMu_;  // one dial at a time, outside mu_
  int closeFd_ = -1;      // an eventfd, readable once closed: stops a dial
  std::mutex mu_;
  std::vector<std::unique_ptr<P2PLink>> links_;  // by peer; null for self
  std::vector<Incoming> incoming_;               // by peer
  std::vector<std::string> linkError_;           // by peer: why it is gone
  std::vector<char> linkRemote_;                 // by peer: it was the peer's end
  OpMap sends_, recvs_;
  std::map<uint64_t, Parked> parked_;            // by id: arrival order
  std::map<uint64_t, std::string> notes_;        // payloads of queued control frames
  std::vector<Finished> finished_;
  uint64_t nextId_ = 0;
  // Payload bytes of finished ops, by the carrier of their peer's link.
  SharedCounters counters_;
  std::string closed_;  // why, once closed
  bool stopping_ = false;
  std::thread thread_;
  int wakeFd_ = -1;
  Deadline wakeAt_{};  // when the sleeping progress thread wakes by itself
};

}  // namespace collx::tcp

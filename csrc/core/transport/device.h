// The transport of one group: its Pairs, set up through the Store, and the
// poll loop that drives them (the progress engine). Pairs on one host move
// their bytes through shared-memory rings; the rest through TCP. A lazy
// group connects a TCP pair when an op first posts to it (connector.h); an
// eager one connects them all at creation. Progress
// runs in the thread that waits, so a collective costs no thread handoffs.
// Point-to-point ops have connections and a progress thread of their own
// (p2p()), so they never queue behind the collectives nor hold them back.
#pragma once

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "../store.h"
#include "shared_windows.h"
#include "p2p/engine.h"
#include "socket/connector.h"
#include "socket/pair.h"

namespace collx::tcp {

struct DeviceOptions {
  std::string ifname;  // COLLX_SOCKET_IFNAME syntax; empty: hostname address
  int family = AF_UNSPEC;  // COLLX_SOCKET_FAMILY: AF_INET, AF_INET6 or either
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  shm::Mode transport = shm::Mode::kAuto;  // COLLX_TRANSPORT: rings for peers on this host
  shm::ReadPeers readPeers = shm::ReadPeers::kWherePays;  // COLLX_SHM_CMA: cross-memory attach between them
  std::string localCongestion = "reno";  // COLLX_TCP_CONGESTION: within a host ("": the system's)
  // COLLX_CONNECT: connect TCP pairs on first use (lazy) or all at creation.
  // Peers that shared memory may link are connected at creation either way:
  // their rings and windows are set up together.
  bool lazy = true;
  // COLLX_SOCKETS_PER_PEER: connections to each peer on another host (at
  // most kMaxLanes), over which a large message is striped, so that a pair
  // is not held to one flow's share of the link (a cloud's per-flow cap, a
  // core per stream). A lazy pair connects them when it first stripes, an
  // eager one at creation.
  int lanes = 1;
  std::string hostLabel;  // stands for this rank's host in the host indices (rendezvous.h); "": its address
  int wakeFd = -1;  // readable: the connects at creation stop (a group shut down while it connects)
  // The group's Store for the rest of its life: where a rank whose group
  // breaks leaves why, for peers that dial it later or see its connection
  // close without its abort frame (Connector::setNotes).
  std::shared_ptr<Store> notes;
};

class Device : public Transport {
 public:
  // Publishes this rank and connects to the peers it must connect to now;
  // throws Error/TimeoutError on failure.
  Device(Store& store, int rank, int size, const DeviceOptions& options);
  // The same for a rank that announce()d itself already (rendezvous.h):
  // reads the group's table, then connects.
  Device(Store& store, Directory announced, const DeviceOptions& options);
  ~Device() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int host(int rank) const override { return hosts_.at(size_t(rank)); }
  int hostCount() const override { return hostCount_; }
  // The "host:port" this rank listened on during setup (for logs).
  const std::string& address() const { return address_; }
  // What the shared-memory setup did, for the log; and whether some local
  // pair wanted it but fell back to TCP (worth a warning).
  const std::string& transportNote() const { return transportNote_; }
  const std::string& transportKey() const { return transportKey_; }  // shm::LocalLinks::key
  bool shmUnavailable() const { return shmUnavailable_; }
  bool connectsOnUse() const override { return lazy_; }
  // The peers this rank holds a collectives connection (or rings) with.
  int connectedPeers() const;
  // How many peers left during setup (closed their group, or died: a
  // refused dial, or a socket closed in the shared-memory setup). Their ops
  // fail, the others' go on.
  int departedPeers() const;
  void postSend(int peer, const Frame& frame, const void* data, size_t bytes,
                uint64_t cookie) override;
  void postRecv(int peer, const Frame& frame, void* data, size_t bytes, uint64_t cookie) override;
  // A message of at least twice this many bytes to a peer with lanes is
  // striped, in pieces of at least this size over at most `lanes` of them.
  // Under a per-flow cap, 64 KiB pieces left 1 MiB ops 2-5x slower than
  // 128 KiB ones (docs/measurements.md).
  static constexpr size_t kMinPieceBytes = 128 << 10;
  void waitSome(std::vector<uint64_t>& done, Deadline deadline) override;
  size_t pending() const override { return pending_; }
  TransportCounters counters() const override;
  void close() override;
  SharedWindows* sharedWindows() const override;

  // Takes collective #seq out of the group's sequence on this rank (its input
  // was rejected): tells every peer why with a cancel frame, so a peer running
  // #seq fails now instead of at its timeout, while peers that cancelled #seq
  // too skip this rank's frame and the group stays usable.
  void cancel(uint64_t seq, OpKind kind, const std::string& why, Deadline deadline);

  // Sends and receives outside the collective order (thread-safe).
  PointToPoint& p2p() { return *p2p_; }
  // For holders that may outlive the Device (a Work waited on after destroy).
  std::shared_ptr<PointToPoint> sharedP2P() const { return p2p_; }

  // Thread-safe: makes a waitSome blocked in another thread fail promptly
  // with `why` (Backend::shutdown and abort with an op in flight). With
  // `tellPeers`, the sockets stay writable so that the failing op's abort
  // frames reach the peers; else they are shut both ways.
  void interrupt(const std::string& why, bool tellPeers);
  // With no op in flight (the caller makes sure): breaks the group with
  // `why` and tells every peer, as a failing op does. No-op if broken.
  void abort(const std::string& why);

  // Why the group broke, sticky; thread-safe.
  enum class Failure { kNone, kTimeout, kRemote, kLocal, kAborted };
  Failure failure() const { return failure_.load(); }

  // For a timeout's report. noteProgress: this rank started or completed
  // the user's collective #seq (peers on this host read it in shared
  // memory); peerProgress: what peer r last noted, where it can be read.
  struct Progress {
    uint64_t started = 0, completed = 0;
    OpKind startedKind = OpKind::kAllreduce;
  };
  void noteProgress(uint64_t seq, OpKind kind, bool completed);
  std::optional<Progress> peerProgress(int r) const;
  // How often a wait moved this rank's thread off a core it shared with a
  // local peer (Windows::unstack).
  uint64_t coreMoves() const;
  // The peers whose data (or reading) the wait that broke the group waited
  // for; empty if it broke otherwise. `ofAll`: that wait was on every peer
  // (the shared windows'), so the others had sent. Thread-safe.
  std::vector<int> missing(bool* ofAll = nullptr) const;

 private:
  void throwIfBroken() const;
  void closeSockets();
  Pair& pair(int peer, int lane = 0);
  // Posts one message, striped over the pair's lanes where it is large.
  void post(int peer, const Frame& frame, char* data, size_t bytes, uint64_t cookie, bool send);
  // Connects a lazy pair that has ops queued (breaks the group on failure).
  void connect(Pair& p, Channel channel, Deadline deadline);
  // Replaces the completed pieces in done[from...] by their messages'
  // cookies, once all of a message's pieces and all earlier messages of its
  // peer and direction are done.
  void joinStripes(std::vector<uint64_t>& done, size_t from);
  void progressOnce(std::vector<uint64_t>& done, Deadline deadline);
  // Reads what a peer this rank does not receive from has sent: its abort
  // frame or end, or a cancel of this op (waitSome's listening).
  void listen(Pair& p);
  [[noreturn]] void breakWith(const std::exception& e, bool timeout);
  // Sets the sticky error, sends abort frames (finishing half-sent messages
  // until `grace`), closes the sockets. `unfinished`: the first collective
  // this rank will not finish, which the frames carry (see Pair::checkAbort).
  void breakGroup(const std::string& why, Failure kind, Deadline grace, uint64_t unfinished);
  [[noreturn]] void timeout();

  class Windows;  // windows.cc
  friend class Windows;

  int rank_;
  int size_;
  bool lazy_;  // some peers are connected on first use
  std::shared_ptr<Connector> connector_;       // serves a lazy group's dials until close()
  int lanes_ = 1;
  // Indexed by lane * size + peer; null for self and pairs never posted to.
  std::vector<std::unique_ptr<Pair>> pairs_;
  // The messages in flight to and from peers with lanes: a piece's cookie
  // (kStriped | id) to its message. A message completes when all its pieces
  // have, and a peer's messages complete in post order, as on one
  // connection: `order_` holds each peer's ids per direction (peer * 2 +
  // send), and a message is reported once those before it were.
  struct Striped {
    uint64_t cookie;
    int left;  // pieces not yet done
    size_t queue;
  };
  static constexpr uint64_t kStriped = uint64_t(1) << 63;
  std::unordered_map<uint64_t, Striped> stripes_;
  std::vector<std::deque<uint64_t>> order_;
  uint64_t nextStripe_ = 0;
  std::shared_ptr<P2PEngine> p2p_;
  std::vector<int> hosts_;                    // host index per rank (rendezvous.h)
  std::vector<std::string> departed_;         // per rank: why it left during setup ("" if it did not)
  int hostCount_ = 1;
  std::string address_;                       // published "host:port"
  std::string transportNote_, transportKey_;
  bool shmUnavailable_ = false;
  std::unique_ptr<Windows> windows_;  // when every rank is here, on shared memory
  size_t pending_ = 0;
  std::chrono::microseconds spin_{0};  // busy-poll budget per waitSome
  bool yield_ = false;                 // yield the core between busy polls from the start
  // Between two busy polls, `spun` into them: yields the core where yield_,
  // or once the pure spin has passed. Returns whether the waiter should
  // sleep now rather than spin on (kSharedCoreYield).
  bool spinPause(Clock::duration spun) const;
  // After posting `frame`: seqPosted_, and the windows' `linked` (shared_windows.h).
  void noteLinked(const Frame& frame);
  mutable std::atomic<bool> coreShared_{false};  // a yield found this core shared (spinPause)
  std::set<uint64_t> cancelled_;  // collectives cancelled here (see Pair)
  // The latest of the user's collectives this rank posted or ran in the
  // windows (not the group's own: types.h's kInternalSeqs).
  uint64_t seqPosted_ = 0;
  int wakeFd_ = -1;                // an eventfd in every poll: interrupt() wakes the waiter
  std::string error_;  // sticky once set
  bool errorIsTimeout_ = false;
  std::mutex socketsMutex_;  // close() vs interrupt() from another thread
  std::atomic<bool> interrupted_{false};
  std::string interruptReason_;  // under socketsMutex_, set before interrupted_
  std::atomic<Failure> failure_{Failure::kNone};
  mutable std::mutex progressMutex_;
  std::vector<int> missing_;   // under progressMutex_
  bool missingOfAll_ = false;  // under progressMutex_
  mutable std::mutex countersMutex_;  // counters() may be read from another thread
  TransportCounters counters_;
};

}  // namespace collx::tcp

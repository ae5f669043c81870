#include "device.h"

#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "../error.h"
#include "socket/rendezvous.h"
#include "shm/windows.h"

namespace collx::tcp {

namespace {
// How long a waiter retries non-blocking I/O before sleeping in poll(): a
// loopback hop is 10-30 us, and a poll() wakeup costs ~100 us on a busy VM;
// with a shorter window (50 us) two ranks fell into a mode where each
// wakeup made the other miss its window (4 B all-reduce p50 140 us vs 20 us).
// With more local ranks than cores the waiter yields between retries, so the
// peer it waits for can run on this core without a sleep/wakeup round trip.
// Otherwise it yields too once kPureSpin has passed: where another process
// has taken a core, the peer may be waiting for this one (n=2 on 2 cores, a
// 0.5 s CPU hog: 16 MiB all-reduces in the windows went from 2 to 12 ms).
constexpr auto kSpin = std::chrono::microseconds(250);
constexpr auto kYieldSpin = std::chrono::microseconds(200);
constexpr auto kPureSpin = std::chrono::microseconds(20);
// A yield that gave the core away for longer than this, where every local
// rank has a core of its own, means another thread runs on this core: most
// often a peer, after the ranks started stacked on one core while another
// idled. Yields only trade the core between them (each finds the other's
// post done when it gets the core back, so neither ever sleeps), while a
// sleep lets the scheduler wake the sleeper on the idle core (stacked, a
// 4 KiB all-reduce took 3-5x its time until the load balancer moved one,
// docs/measurements.md).
constexpr auto kSharedCoreYield = std::chrono::microseconds(20);

// Whether the setup's wake fd was set: the group is being shut down.
bool woken(int wakeFd) {
  pollfd p{wakeFd, POLLIN, 0};
  return wakeFd >= 0 && ::poll(&p, 1, 0) > 0;
}
}  // namespace

Device::Device(Store& store, int rank, int size, const DeviceOptions& options)
    : Device(store,
             announce(store, rank, size, options.ifname, options.family, options.hostLabel,
                      options.lazy ? "lazy" : "eager"),
             options) {}

Device::Device(Store& store, Directory announced, const DeviceOptions& options)
    : rank_(announced.rank),
      size_(announced.size),
      lazy_(options.lazy),
      lanes_(std::clamp<int>(options.lanes, 1, int(kMaxLanes))),
      pairs_(size_t(announced.size) * size_t(lanes_)) {
  const Deadline deadline = Clock::now() + options.timeout;
  const int rank = rank_;
  const int size = size_;
  readTable(store, announced, options.timeout);
  connector_ = std::make_shared<Connector>(rank, std::move(announced), options.localCongestion);
  connector_->setNotes(options.notes);
  const Directory& dir = connector_->directory();
  hosts_ = dir.hosts;
  address_ = dir.address;
  // Connected now: every peer (eager), or the local ones that shared memory
  // may link. Both ranks of a pair dial (Connector::take keeps one).
  // A peer that left already (its dial is refused, its socket closes in
  // the shared-memory setup: it closed its group or died) does not fail the
  // setup: it is noted as departed, the others connect without it, and
  // only the ops that need it fail (they dial it and read its note).
  departed_.resize(size_t(size));
  std::vector<Socket> sockets[kChannels];
  for (auto& channel : sockets) channel.resize(size_t(size));
  shm::LocalLinks local;
  try {
    for (int peer = 0; peer < size; ++peer) {
      const bool onHost = hosts_[size_t(peer)] == hosts_[size_t(rank)];
      if (peer == rank || (lazy_ && !(onHost && options.transport != shm::Mode::kTcp))) continue;
      try {
        const int lanes = onHost ? 1 : lanes_;  // an eager pair's lanes connect now too
        for (uint32_t ch = 0; ch < kFirstLane + uint32_t(lanes) - 1; ++ch) {
          sockets[ch][size_t(peer)] = connector_->take(peer, Channel(ch), deadline, options.wakeFd);
        }
      } catch (const PeerClosedError& e) {
        departed_[size_t(peer)] = e.what();
        for (auto& channel : sockets) channel[size_t(peer)] = Socket();
      }
    }
    if (woken(options.wakeFd)) throw Error("interrupted");
    std::vector<int> fds;
    for (const Socket& s : sockets[kCollectives]) fds.push_back(s.fd());
    local = shm::connectLocal(store, dir.prefix, dir.token, rank, hosts_, fds, options.transport, options.readPeers,
                              deadline, [connector = connector_](int peer) { return connector->readNote(peer); },
                              options.wakeFd);
  } catch (const std::exception& e) {
    // The peers in setup with this rank see its sockets close: the note,
    // left while they are still open, tells them why.
    connector_->leaveNote(woken(options.wakeFd) ? kClosedItsGroup : e.what());
    throw;
  }
  for (int peer = 0; peer < size; ++peer) {
    if (departed_[size_t(peer)].empty()) departed_[size_t(peer)] = local.departed[size_t(peer)];
    if (!departed_[size_t(peer)].empty()) {
      for (auto& channel : sockets) channel[size_t(peer)] = Socket();
      connector_->forget(peer);
    }
  }
  // Nobody connects any more where every peer is connected (eager, or all
  // on this host). Where one departed, an op that needs it dials it: the
  // refusal says why it left.
  if (std::count_if(sockets[kCollectives].begin(), sockets[kCollectives].end(),
                    [](const Socket& s) { return s.valid(); }) == size - 1) {
    lazy_ = false;
    connector_->stop();
  } else if (departedPeers() > 0) {
    lazy_ = true;
  }
  transportNote_ = local.note;
  transportKey_ = local.key;
  shmUnavailable_ = local.unavailable;
  if (std::all_of(local.windows.begin(), local.windows.end(), [](char* w) { return w != nullptr; })) {
    windows_ = std::make_unique<Windows>(*this, std::move(local.windows), std::move(local.segments),
                                         std::move(local.pids), local.peerReads);
  }
  for (int peer = 0; peer < size; ++peer) {
    if (sockets[kCollectives][size_t(peer)].valid()) {
      pairs_[size_t(peer)] = std::make_unique<Pair>(rank, peer, std::move(sockets[kCollectives][size_t(peer)]),
                                                    &cancelled_, std::move(local.collectives[size_t(peer)]));
    }
    for (int lane = 1; lane < lanes_; ++lane) {
      Socket& s = sockets[laneChannel(lane)][size_t(peer)];
      if (s.valid()) pairs_[size_t(lane * size + peer)] = std::make_unique<Pair>(rank, peer, std::move(s), &cancelled_);
    }
  }
  P2PEngine::Connect dial;
  if (lazy_) {
    dial = [connector = connector_](int peer, Deadline until, int wakeFd) {
      return connector->take(peer, kPointToPoint, until, wakeFd);
    };
  }
  p2p_ = std::make_shared<P2PEngine>(rank, std::move(sockets[kPointToPoint]), std::move(local.p2p), std::move(dial));
  for (int peer = 0; peer < size; ++peer) {
    if (!departed_[size_t(peer)].empty()) p2p_->depart(peer, departed_[size_t(peer)]);
  }
  if (lazy_) {
    connector_->setSink(kPointToPoint, [engine = std::weak_ptr<P2PEngine>(p2p_)](int peer, Socket s) {
      if (auto e = engine.lock()) e->adopt(peer, std::move(s));
    });
  }
  // Pure busy-polling only pays while every local rank has a core of its
  // own; with more ranks than cores a waiter yields between polls instead.
  hostCount_ = hosts_.empty() ? 1 : *std::max_element(hosts_.begin(), hosts_.end()) + 1;  // dense indices
  const auto localRanks = std::count(hosts_.begin(), hosts_.end(), hosts_[size_t(rank)]);
  unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  yield_ = unsigned(localRanks) > cores;
  spin_ = yield_ ? kYieldSpin : kSpin;
  wakeFd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  COLLX_CHECK(wakeFd_ >= 0, "collx rank ", rank, ": eventfd failed: ", strerror(errno));
}

Device::~Device() {
  close();
  ::close(wakeFd_);
}

bool Device::spinPause(Clock::duration spun) const {
  if (yield_) {
    std::this_thread::yield();
    return false;
  }
  if (spun <= kPureSpin) return false;
  // The yield that found the core shared ends its own wait as it did (the
  // peer ran meanwhile); the next wait to get this far sleeps.
  if (coreShared_.exchange(false, std::memory_order_relaxed)) return true;
  const auto before = Clock::now();
  std::this_thread::yield();
  if (Clock::now() - before > kSharedCoreYield) {
    coreShared_.store(true, std::memory_order_relaxed);
    if (windows_) windows_->unstack();
  }
  return false;
}

SharedWindows* Device::sharedWindows() const { return windows_.get(); }

void Device::closeSockets() {
  std::lock_guard<std::mutex> lock(socketsMutex_);
  for (auto& p : pairs_) {
    if (p) p->close();
  }
}

int Device::departedPeers() const {
  return int(std::count_if(departed_.begin(), departed_.end(), [](const std::string& s) { return !s.empty(); }));
}

void Device::close() {
  // Peers may still dial a lazy group: a refused dial then reads why.
  if (lazy_ && error_.empty()) connector_->leaveNote(kClosedItsGroup);
  connector_->stop();
  p2p_->close(str("collx rank ", rank_, ": the process group was shut down"));
  closeSockets();
  if (error_.empty()) error_ = str("collx rank ", rank_, ": the process group was shut down");
  pending_ = 0;
}

Pair& Device::pair(int peer, int lane) {
  throwIfBroken();
  COLLX_CHECK(peer >= 0 && peer < size_ && peer != rank_, "collx rank ", rank_, ": invalid peer ",
              peer, " for a group of size ", size_);
  std::unique_ptr<Pair>& p = pairs_[size_t(lane * size_ + peer)];
  if (!p) {
    std::lock_guard<std::mutex> lock(socketsMutex_);  // interrupt() reads pairs_
    p = std::make_unique<Pair>(rank_, peer, Socket(), &cancelled_);
  }
  return *p;
}

int Device::connectedPeers() const {
  return int(std::count_if(pairs_.begin(), pairs_.begin() + size_, [](auto& p) { return p && p->connected(); }));
}

void Device::connect(Pair& p, Channel channel, Deadline deadline) {
  Socket s;
  try {
    s = connector_->take(p.peer(), channel, deadline, wakeFd_);
  } catch (const TimeoutError& e) {
    {
      std::lock_guard<std::mutex> lock(progressMutex_);
      missing_ = {p.peer()};
      missingOfAll_ = false;
    }
    breakWith(e, true);
  }
  std::lock_guard<std::mutex> lock(socketsMutex_);
  p.connect(std::move(s));
}

void Device::postSend(int peer, const Frame& frame, const void* data, size_t bytes,
                      uint64_t cookie) {
  post(peer, frame, static_cast<char*>(const_cast<void*>(data)), bytes, cookie, true);
}

void Device::postRecv(int peer, const Frame& frame, void* data, size_t bytes, uint64_t cookie) {
  post(peer, frame, static_cast<char*>(data), bytes, cookie, false);
}

// Both sides of a pair cut a message alike, from what both know (its size
// and dtype, the peer's host), and post its pieces to the lanes in the
// order of their messages, so each lane's FIFO matches as lane 0's does.
void Device::post(int peer, const Frame& frame, char* data, size_t bytes, uint64_t cookie, bool send) {
  Pair& first = pair(peer);  // checks the peer
  COLLX_CHECK(!(cookie & kStriped), "collx: a cookie with the top bit set: ", cookie);
  if (lanes_ == 1 || hosts_[size_t(peer)] == hosts_[size_t(rank_)]) {
    send ? first.postSend(frame, data, bytes, cookie) : first.postRecv(frame, data, bytes, cookie);
    noteLinked(frame);
    ++pending_;
    return;
  }
  const int pieces = int(std::clamp<size_t>(bytes / kMinPieceBytes, 1, size_t(lanes_)));
  const uint64_t id = kStriped | nextStripe_++;
  const size_t queue = size_t(peer) * 2 + send;
  if (order_.empty()) order_.resize(size_t(size_) * 2);
  stripes_[id] = {cookie, pieces, queue};
  order_[queue].push_back(id);
  const size_t es = std::max<size_t>(1, elementSize(frame.dtype)), elems = bytes / es;
  for (int i = 0; i < pieces; ++i) {
    const size_t b = elems * size_t(i) / size_t(pieces) * es;
    const size_t e = i + 1 == pieces ? bytes : elems * size_t(i + 1) / size_t(pieces) * es;
    Pair& p = pair(peer, i);
    send ? p.postSend(frame, data + b, e - b, id) : p.postRecv(frame, data + b, e - b, id);
    ++pending_;
  }
  noteLinked(frame);
}

void Device::joinStripes(std::vector<uint64_t>& done, size_t from) {
  std::vector<uint64_t> finished;
  for (size_t i = from; i < done.size(); ++i) {
    if (!(done[i] & kStriped)) {
      finished.push_back(done[i]);
      continue;
    }
    auto it = stripes_.find(done[i]);
    if (--it->second.left > 0) continue;
    for (std::deque<uint64_t>& q = order_[it->second.queue]; !q.empty(); q.pop_front()) {
      auto front = stripes_.find(q.front());
      if (front->second.left > 0) break;
      finished.push_back(front->second.cookie);
      stripes_.erase(front);
    }
  }
  done.resize(from);
  done.insert(done.end(), finished.begin(), finished.end());
}

void Device::noteLinked(const Frame& frame) {
  if (frame.seq >= kInternalSeqs) return;
  seqPosted_ = std::max(seqPosted_, frame.seq);
  // A cancel travels on the connections of an op that runs anywhere.
  if (windows_ && frame.kind != OpKind::kCancel) {
    windows_->control(rank_).linked.store(frame.seq, std::memory_order_relaxed);
  }
}

void Device::cancel(uint64_t seq, OpKind kind, const std::string& why, Deadline deadline) {
  throwIfBroken();
  cancelled_.insert(seq);
  const std::string reason = why.substr(0, kMaxReasonBytes);  // outlives the sends: waitAll below
  const Frame frame{OpKind::kCancel, DataType::kUInt8, seq, uint32_t(kind)};
  for (int peer = 0; peer < size_; ++peer) {
    if (peer != rank_) postSend(peer, frame, reason.data(), reason.size(), 0);
  }
  waitAll(*this, deadline);
}

void Device::progressOnce(std::vector<uint64_t>& done, Deadline deadline) {
  size_t before = done.size();
  for (size_t i = 0; i < pairs_.size(); ++i) {
    Pair* p = pairs_[i].get();
    if (!p) continue;
    if (!p->connected()) {
      if (!p->wantsWrite() && !p->wantsRead()) continue;
      connect(*p, laneChannel(int(i / size_t(size_))), deadline);
    }
    if (p->wantsWrite()) p->progressSend(done);
    if (p->wantsRead()) p->progressRecv(done);
  }
  pending_ -= done.size() - before;
  if (!stripes_.empty()) joinStripes(done, before);
}

void Device::listen(Pair& p) {
  // A peer this rank sends to may never read (it cancelled this op or left):
  // its cancel frame or its end fails the op. From an idle peer only an abort
  // counts, and only one of this op or an earlier one: it may have finished
  // this op and left, or failed in a later op, which this rank then meets;
  // its cancel of a later op waits for that op, which this rank may reject too.
  if (p.wantsWrite()) {
    p.checkControl();
  } else {
    p.checkAbort(seqPosted_);
  }
}

void Device::waitSome(std::vector<uint64_t>& done, Deadline deadline) {
  throwIfBroken();
  std::vector<pollfd> fds;
  std::vector<Pair*> watched;  // parallel to fds: pairs watched for control frames
  std::vector<std::pair<Pair*, size_t>> sleepers;  // ring pairs asleep in this poll, and their fds index
  size_t start = done.size();
  const Clock::time_point spinStart = Clock::now();
  const Deadline spinUntil = spinStart + spin_;
  try {
    for (;;) {
      if (interrupted_) throw Error("interrupted");  // breakWith below says why
      progressOnce(done, deadline);
      if (done.size() > start || pending_ == 0) break;
      if (const auto now = Clock::now(); now < spinUntil && !spinPause(now - spinStart)) continue;
      fds.clear();
      watched.clear();
      sleepers.clear();
      bool moved = false;
      for (auto& p : pairs_) {
        if (!p || !p->connected()) continue;
        // A peer this rank does not receive from may have failed or aborted:
        // listen to it (listen()), so that a failure anywhere in the group
        // reaches every rank now. A peer whose next message is here, or
        // whose end was read, needs no listening.
        bool watch = !p->wantsRead() && !p->hasBufferedHeader() && !p->ended();
        if (watch && p->usesShm()) {
          // Bytes in its ring would keep the sleep from starting (prepareSleep):
          // look at them now, as poll() would have made us do.
          listen(*p);
          watch = !p->hasBufferedHeader() && !p->ended();
        }
        short ev = short((p->wantsRead() || watch ? POLLIN : 0) | (p->wantsWrite() ? POLLOUT : 0));
        if (!ev) continue;
        if (p->usesShm()) {
          // The rings' doorbell and the peer's end both arrive as POLLIN.
          if (!p->prepareSleep(ev & POLLIN)) {
            moved = true;
            break;
          }
          ev = POLLIN;
          sleepers.emplace_back(p.get(), fds.size());
        }
        fds.push_back({p->fd(), ev, 0});
        watched.push_back(watch ? p.get() : nullptr);
      }
      if (moved) {
        for (auto& [p, i] : sleepers) p->afterSleep(0);
        if (Clock::now() >= deadline) timeout();
        continue;
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) timeout();
      fds.push_back({wakeFd_, POLLIN, 0});
      watched.push_back(nullptr);
      int rc = ::poll(fds.data(), fds.size(), int(std::min<int64_t>(left.count() + 1, 1 << 30)));
      if (interrupted_) throw Error("interrupted");  // breakWith below says why
      if (rc < 0 && errno != EINTR) throw Error(str("collx: poll failed: ", strerror(errno)));
      for (auto& [p, i] : sleepers) p->afterSleep(rc > 0 ? fds[i].revents : 0);
      if (rc == 0 && Clock::now() >= deadline) timeout();
      for (size_t i = 0; rc > 0 && i < fds.size(); ++i) {
        Pair* w = watched[i];
        if (w && (fds[i].revents & (POLLIN | POLLHUP | POLLERR))) listen(*w);
      }
    }
  } catch (const TimeoutError&) {
    throw;
  } catch (const PeerClosedError& e) {
    // A peer that failed first left its cause before it closed (breakGroup);
    // an end this rank made (interrupt) has none to look for.
    if (error_.empty()) {
      const std::string note = e.peer() >= 0 && !interrupted_ ? connector_->readNote(e.peer()) : "";
      const std::string closed = note == kClosedItsGroup ? noteOfPeer(e.peer(), note) : "";
      if (!closed.empty() && std::string(e.what()).find(closed) == std::string::npos) {
        breakWith(PeerClosedError(e.what() + closed, e.peer()), false);
      }
      if (!note.empty() && closed.empty()) breakWith(peerAborted(rank_, e.peer(), note), false);
      breakWith(e, false);
    }
    throw;
  } catch (const Error& e) {
    if (error_.empty()) breakWith(e, false);
    throw;
  }
  std::lock_guard<std::mutex> lock(countersMutex_);
  counters_ = {};
  for (auto& p : pairs_) {
    if (p) counters_.add(p->usesShm() ? Carrier::kShmRing : Carrier::kTcp, p->bytesSent(), p->bytesReceived());
  }
}

void Device::noteProgress(uint64_t seq, OpKind kind, bool completed) {
  if (!windows_) return;
  WindowControl& me = windows_->control(rank_);
  if (completed) {
    me.completed.store(seq, std::memory_order_relaxed);
  } else {
    me.startedKind.store(uint32_t(kind), std::memory_order_relaxed);
    me.started.store(seq, std::memory_order_relaxed);
    windows_->noteCpu(::sched_getcpu());
  }
}

std::optional<Device::Progress> Device::peerProgress(int r) const {
  if (!windows_) return std::nullopt;
  const WindowControl& c = windows_->control(r);
  return Progress{c.started.load(std::memory_order_relaxed), c.completed.load(std::memory_order_relaxed),
                  OpKind(c.startedKind.load(std::memory_order_relaxed))};
}

uint64_t Device::coreMoves() const { return windows_ ? windows_->moves() : 0; }

TransportCounters Device::counters() const {
  TransportCounters c = p2p_->counters();
  if (windows_) c += windows_->counters();
  std::lock_guard<std::mutex> lock(countersMutex_);
  c += counters_;
  return c;
}

}  // namespace collx::tcp

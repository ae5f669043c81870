#include "connector.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "../../error.h"
#include "wire.h"

namespace collx::tcp {

namespace {
// How long one accepted connection may take to say hello before it is dropped.
constexpr auto kHelloTimeout = std::chrono::seconds(10);
// Connections still saying hello at once, beyond every peer dialing on both
// channels; past that the oldest is dropped.
constexpr size_t kMaxStrangers = 64;
// The acceptor's reply to a hello.
constexpr char kAccepted = 1;
constexpr char kDuplicate = 0;
// How often a waiting take() looks at its wake fd.
constexpr auto kWakeCheck = std::chrono::milliseconds(1);
// How long a failing rank waits for the Store to take its note (an abort
// the user asks for must return within 100 ms).
constexpr auto kNoteSetWait = std::chrono::milliseconds(20);
// How long a reader waits for a note to appear: a failing rank closes its
// connections kNoteSetWait after it sent its note at the latest, and a slow
// Store may take the note only after the peers saw the close.
constexpr auto kNoteLate = std::chrono::milliseconds(100);

bool readable(int fd) {
  if (fd < 0) return false;
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}
}  // namespace

struct Connector::Pending {
  Socket socket;
  Hello hello{};
  size_t got = 0;
  Deadline until;
};

Connector::Connector(int rank, Directory directory, const std::string& localCongestion)
    : rank_(rank), dir_(std::move(directory)), localCongestion_(localCongestion) {
  for (uint32_t ch = 0; ch < kChannels; ++ch) {
    state_[ch].assign(size_t(dir_.size), State::kIdle);
    ready_[ch].resize(size_t(dir_.size));
  }
  if (!dir_.listener.valid()) {
    stopped_ = true;
    return;
  }
  // A setting the kernel refuses fails every rank that has local peers now,
  // not only the one whose dial meets it first.
  const int here = dir_.hosts[size_t(rank)];
  if (!localCongestion_.empty() && std::count(dir_.hosts.begin(), dir_.hosts.end(), here) > 1) {
    Socket probe(::socket(dir_.addrs[size_t(rank)].storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    COLLX_CHECK(probe.valid() && probe.setCongestionControl(localCongestion_.c_str()), "collx rank ", rank_,
                ": the kernel refuses congestion control '", localCongestion_, "' (COLLX_TCP_CONGESTION): ",
                strerror(errno));
  }
  stopFd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  COLLX_CHECK(stopFd_ >= 0, "collx rank ", rank, ": eventfd failed: ", strerror(errno));
  acceptor_ = std::thread([this] { acceptLoop(); });
}

Connector::~Connector() {
  stop();
  if (stopFd_ >= 0) ::close(stopFd_);
}

void Connector::setSink(Channel channel, Sink sink) {
  std::vector<std::pair<int, Socket>> early;  // accepted before the sink was set
  {
    std::lock_guard<std::mutex> lock(mu_);
    sinks_[channel] = sink;
    for (int peer = 0; peer < dir_.size; ++peer) {
      if (ready_[channel][size_t(peer)].valid()) early.emplace_back(peer, std::move(ready_[channel][size_t(peer)]));
    }
  }
  for (auto& [peer, socket] : early) sink(peer, std::move(socket));
}

void Connector::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_ && !acceptor_.joinable()) return;
    stopped_ = true;
    for (auto& channel : ready_) {
      for (auto& s : channel) s.reset();
    }
  }
  changed_.notify_all();
  if (acceptor_.joinable()) {
    const uint64_t one = 1;
    (void)!::write(stopFd_, &one, sizeof(one));
    acceptor_.join();
  }
  dir_.listener.reset();
}

void Connector::configure(Socket& s, int peer) const {
  // Between ranks on one host nothing congests, and a pacing congestion
  // control (BBR, the default on some systems) spaces every burst at its own
  // estimate of the link, an estimate each connection makes apart: at n=2 a
  // 256 KiB direct all-reduce took 170 us under bbr and 103 us under reno,
  // and under bbr some groups ran 1.7x slower than others doing the same.
  // Reno, which does not pace and which every kernel allows, is used there
  // by default (COLLX_TCP_CONGESTION). Across hosts the system's choice stands.
  //
  // The send buffer is fixed there too: autotuning grows it for large ops
  // (to 4 MiB) and never shrinks it, and a grown one slowed the group's later
  // ops (n=2, ring, 1 MiB: 1.3x after five 64 MiB all-reduces,
  // benchmarks/group_history.py; 64 MiB itself ran 1.37x faster capped).
  constexpr int kLocalSendBuffer = 256 << 10;  // the kernel doubles it
  if (dir_.hosts[size_t(peer)] != dir_.hosts[size_t(rank_)]) return;
  s.setSendBuffer(kLocalSendBuffer);
  COLLX_CHECK(localCongestion_.empty() || s.setCongestionControl(localCongestion_.c_str()), "collx rank ", rank_,
              ": the kernel refuses congestion control '", localCongestion_, "' (COLLX_TCP_CONGESTION): ",
              strerror(errno));
}

Socket Connector::take(int peer, Channel channel, Deadline deadline, int wakeFd) {
  COLLX_CHECK(peer >= 0 && peer < dir_.size && peer != rank_, "collx rank ", rank_, ": invalid peer ", peer);
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (stopped_) throw Error(str("collx rank ", rank_, ": the group no longer connects (it was shut down)"));
    if (!failed_.empty()) throw Error(failed_);
    State& state = state_[channel][size_t(peer)];
    Socket& ready = ready_[channel][size_t(peer)];
    if (ready.valid()) return std::move(ready);
    if (state == State::kDone) return Socket();  // the sink took it
    if (state == State::kIdle) {
      state = State::kDialing;
      lock.unlock();
      Socket s;
      bool accepted;
      try {
        accepted = this->dial(peer, channel, deadline, wakeFd, &s);
      } catch (...) {
        // The peer's own dial may have been accepted meanwhile: the pair
        // has its connection, and this dial failed only because the peer,
        // connected, stopped listening before it answered.
        lock.lock();
        if (state_[channel][size_t(peer)] != State::kDialing) continue;
        state_[channel][size_t(peer)] = State::kIdle;
        throw;
      }
      lock.lock();
      if (accepted) {
        state_[channel][size_t(peer)] = State::kDone;
        return s;
      }
      continue;  // refused as a duplicate: the peer's own dial is on its way here
    }
    if (readable(wakeFd)) throw Error("interrupted");
    if (Clock::now() >= deadline) {
      throw TimeoutError(str("collx rank ", rank_, ": Timed out waiting for peer ", peer, " (",
                             dir_.addrs[size_t(peer)].str(), ") to connect"));
    }
    changed_.wait_for(lock, wakeFd >= 0 ? std::chrono::duration_cast<Clock::duration>(kWakeCheck)
                                        : std::min<Clock::duration>(deadline - Clock::now(), std::chrono::seconds(1)));
  }
}

void Connector::forget(int peer) {
  std::lock_guard<std::mutex> lock(mu_);
  for (uint32_t ch = 0; ch < kChannels; ++ch) {
    if (state_[ch][size_t(peer)] == State::kDone) state_[ch][size_t(peer)] = State::kIdle;
    ready_[ch][size_t(peer)].reset();
  }
}

PeerClosedError Connector::gone(int peer, Deadline deadline, const std::string& how) const {
  const std::string note = readNote(peer, std::min<Clock::duration>(kNoteWait, deadline - Clock::now()));
  return PeerClosedError(str("Connection closed by peer ", peer, " (collx rank ", rank_, " ", how, ")",
                             noteOfPeer(peer, note)));
}

bool Connector::dial(int peer, Channel channel, Deadline deadline, int wakeFd, Socket* out) {
  const Address& addr = dir_.addrs[size_t(peer)];
  Socket s;
  try {
    // The peer listened before it published its address, and listens while
    // its group lives: a refusal means it is gone.
    s = connectTo(addr, deadline, /*retryRefused=*/false);
  } catch (const TimeoutError&) {
    throw TimeoutError(str("collx rank ", rank_, ": Timed out connecting to peer ", peer, " at ", addr.str()));
  } catch (const Error& e) {
    throw gone(peer, deadline,
               str("could not connect to ", addr.str(), ": the peer's process exited or it closed its group; ",
                   e.what()));
  }
  configure(s, peer);  // before the hello: a setting the kernel refuses fails here, not at the peer
  const Hello mine{kHelloMagic, rank_, dir_.size, channel, dir_.generation, dir_.token};
  if (!writeAll(s, &mine, sizeof(mine), deadline)) {
    if (Clock::now() >= deadline) {
      throw TimeoutError(str("collx rank ", rank_, ": Timed out sending hello to peer ", peer, " at ", addr.str()));
    }
    throw gone(peer, deadline,
               str("sending hello to ", addr.str(), ": the peer's process exited or it closed its group"));
  }
  char reply = kDuplicate;
  for (;;) {
    pollfd fds[3] = {{s.fd(), POLLIN, 0}, {stopFd_, POLLIN, 0}, {wakeFd, POLLIN, 0}};
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (ms <= 0) {
      throw TimeoutError(str("collx rank ", rank_, ": Timed out waiting for peer ", peer, " at ", addr.str(),
                             " to answer its connection (the peer is stopped or overloaded)"));
    }
    const int rc = ::poll(fds, wakeFd >= 0 ? 3 : 2, int(std::min<int64_t>(ms + 1, 1 << 30)));
    if (rc < 0 && errno != EINTR) throw Error(str("collx rank ", rank_, ": poll failed: ", strerror(errno)));
    if (rc > 0 && fds[1].revents) throw Error(str("collx rank ", rank_, ": the group was shut down"));
    if (rc > 0 && fds[2].revents) throw Error("interrupted");
    if (rc > 0 && fds[0].revents) {
      const ssize_t got = ::recv(s.fd(), &reply, 1, MSG_DONTWAIT);
      if (got == 1) break;
      if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      throw gone(peer, deadline,
                 str("connecting to ", addr.str(), ": the peer's process exited or it closed its group"));
    }
  }
  if (reply != kAccepted) return false;
  *out = std::move(s);
  return true;
}

namespace {

// Runs `request` on a thread of its own and waits for its answer at most
// `wait` (else ""): a Store whose server is stopped never answers, a c10d
// request cannot be interrupted, and a request stuck there holds the
// client's lock, on which the next would wait too. One left behind ends
// with the Store's answer.
std::string askStore(std::function<std::string()> request, Clock::duration wait) {
  struct Answer {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::string text;
  };
  auto answer = std::make_shared<Answer>();
  std::thread([answer, request = std::move(request)] {
    std::string text;
    try {
      text = request();
    } catch (const std::exception&) {  // the Store is gone too, or the key never came: the caller goes on without it
    }
    std::lock_guard<std::mutex> lock(answer->mu);
    answer->text = std::move(text);
    answer->done = true;
    answer->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(answer->mu);
  answer->cv.wait_for(lock, wait, [&] { return answer->done; });
  return answer->text;
}

}  // namespace

void Connector::leaveNote(const std::string& why) noexcept {
  if (!notes_) return;
  try {
    askStore(
        [store = notes_, key = str(dir_.prefix, "left/", rank_), why] {
          store->set(key, std::vector<uint8_t>(why.begin(), why.end()));
          return std::string();
        },
        kNoteSetWait);
  } catch (const std::exception&) {  // no thread to be had: peers see the refusal alone
  }
}

std::string Connector::readNote(int peer, Clock::duration wait) const {
  if (!notes_) return "";
  try {
    return askStore(
        [store = notes_, key = str(dir_.prefix, "left/", peer)] {
          const auto value = store->get(key, kNoteLate);  // none by then: askStore answers ""
          return std::string(value.begin(), value.end());
        },
        wait);
  } catch (const std::exception&) {  // no thread to be had: the refusal alone
    return "";
  }
}

void Connector::onHello(Socket socket, int peer, Channel channel) {
  std::unique_lock<std::mutex> lock(mu_);
  State& state = state_[channel][size_t(peer)];
  const bool duplicate =
      state == State::kDone || state == State::kAccepting || (state == State::kDialing && rank_ < peer);
  if (!duplicate) {
    try {
      configure(socket, peer);
    } catch (const Error& e) {
      failed_ = e.what();  // this rank's waits fail with it
      lock.unlock();
      changed_.notify_all();
      return;
    }
  }
  const char reply = duplicate ? kDuplicate : kAccepted;
  if (::send(socket.fd(), &reply, 1, MSG_NOSIGNAL | MSG_DONTWAIT) != 1 || duplicate) return;  // dropped
  if (sinks_[channel]) {
    state = State::kAccepting;
    Sink sink = sinks_[channel];
    lock.unlock();  // the sink takes its own lock; take() never holds it while calling here
    sink(peer, std::move(socket));
    lock.lock();  // only now does take() find the connection made (kDone)
  } else {
    ready_[channel][size_t(peer)] = std::move(socket);
  }
  state_[channel][size_t(peer)] = State::kDone;
  lock.unlock();
  changed_.notify_all();
}

void Connector::acceptLoop() {
  std::vector<Pending> pending;
  std::vector<pollfd> fds;
  for (;;) {
    const Deadline now = Clock::now();
    pending.erase(std::remove_if(pending.begin(), pending.end(), [&](const Pending& p) { return p.until <= now; }),
                  pending.end());
    int timeoutMs = -1;
    fds.assign({pollfd{stopFd_, POLLIN, 0}, pollfd{dir_.listener.fd(), POLLIN, 0}});
    for (const auto& p : pending) {
      fds.push_back({p.socket.fd(), POLLIN, 0});
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(p.until - now).count() + 1;
      timeoutMs = timeoutMs < 0 ? int(ms) : std::min(timeoutMs, int(ms));
    }
    if (::poll(fds.data(), fds.size(), timeoutMs) < 0 && errno != EINTR) return;
    if (fds[0].revents) return;  // stop()
    // Read what arrived; a hello completes a connection, anything else drops it.
    std::vector<Pending> still;
    for (size_t i = 0; i < pending.size(); ++i) {
      Pending& p = pending[i];
      if (fds[i + 2].revents) {
        ssize_t rc = ::recv(p.socket.fd(), reinterpret_cast<char*>(&p.hello) + p.got, sizeof(Hello) - p.got,
                            MSG_DONTWAIT);
        if (rc == 0 || (rc < 0 && errno != EINTR && errno != EAGAIN)) continue;  // closed: drop
        if (rc > 0) p.got += size_t(rc);
      }
      if (p.got < sizeof(Hello)) {
        still.push_back(std::move(p));
        continue;
      }
      const Hello& h = p.hello;
      const bool ours = h.magic == kHelloMagic && h.token == dir_.token && h.generation == dir_.generation &&
                        h.size == dir_.size && h.rank >= 0 && h.rank < dir_.size && h.rank != rank_ &&
                        h.channel < kChannels;
      if (ours) onHello(std::move(p.socket), h.rank, Channel(h.channel));  // else a stranger or stale peer: drop
    }
    pending.swap(still);
    while (fds[1].revents & POLLIN) {  // every peer of a lazy group may dial at once
      int fd = ::accept4(dir_.listener.fd(), nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) {
        if (pending.size() >= kMaxStrangers + 2 * size_t(dir_.size)) pending.erase(pending.begin());
        pending.push_back(Pending{Socket(fd), Hello{}, 0, Clock::now() + kHelloTimeout});
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        break;
      } else if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        // Out of descriptors (ulimit -n) or memory: the dial waits in the
        // backlog; this rank's own ops fail on it with the reason.
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        break;
      } else if (errno != EINTR && errno != ECONNABORTED) {
        return;  // the listener failed: dials to this rank fail, and say so there
      }
    }
  }
}

}  // namespace collx::tcp

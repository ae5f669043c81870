#include "windows.h"

#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <thread>

#include "../../copy.h"
#include "../../error.h"

namespace collx::tcp {

namespace {
// A sleeper wakes at least this often to look at its peers' health.
constexpr auto kSleepSlice = std::chrono::milliseconds(1);
constexpr int kLooksPerClock = 8;
// unstack() moves a thread at most this often: a move costs a migration,
// and a scheduler that keeps stacking the ranks must not make it a loop.
constexpr auto kMoveEvery = std::chrono::milliseconds(10);

void futexWait(std::atomic<uint32_t>* word, uint32_t seen, std::chrono::nanoseconds timeout) {
  const timespec ts{time_t(timeout.count() / 1000000000), long(timeout.count() % 1000000000)};
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void futexWake(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}
}  // namespace

Device::Windows::Windows(Device& device, std::vector<char*> areas, std::vector<std::shared_ptr<shm::Segment>> segments,
                         std::vector<pid_t> pids, PeerReads reads)
    : device_(device), areas_(std::move(areas)), segments_(std::move(segments)), pids_(std::move(pids)),
      reads_(reads) {
  static_assert(sizeof(WindowControl) <= kControlBytes, "the control block fits its page");
}

void Device::Windows::publish() {
  for (int r = 0; r < device_.size_; ++r) {
    WindowControl& c = control(r);
    if (r != device_.rank_ && c.sleeping.load(std::memory_order_seq_cst)) {
      c.bell.fetch_add(1, std::memory_order_seq_cst);
      futexWake(&c.bell);
    }
  }
}

// Two ranks that wake each other can stay stacked on one core for tens of
// milliseconds while another core idles: a wakeup places the sleeper beside
// its waker, and the balancer is slow to part them. Stacked, a small op took
// 5-10x its time (docs/measurements.md). Of two ranks on one core the higher
// moves, to the first core of its mask that no peer last ran on; its mask is
// narrowed to that core for the move and restored at once, so the user's
// affinity stays as it was and the scheduler may move the thread later.
void Device::Windows::unstack() {
  const int cpu = ::sched_getcpu();
  if (cpu < 0 || cpu >= CPU_SETSIZE) return;
  noteCpu(cpu);
  const Clock::time_point now = Clock::now();
  if (now - lastMove_ < kMoveEvery) return;
  bool stacked = false;
  cpu_set_t taken;
  CPU_ZERO(&taken);
  CPU_SET(cpu, &taken);
  for (int r = 0; r < device_.size_; ++r) {
    const int c = control(r).cpu.load(std::memory_order_relaxed) - 1;
    if (r == device_.rank_ || c < 0 || c >= CPU_SETSIZE) continue;
    if (c == cpu && r < device_.rank_) stacked = true;
    CPU_SET(c, &taken);
  }
  cpu_set_t allowed;
  if (!stacked || ::sched_getaffinity(0, sizeof allowed, &allowed) != 0) return;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (!CPU_ISSET(c, &allowed) || CPU_ISSET(c, &taken)) continue;
    lastMove_ = now;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(c, &one);
    if (::sched_setaffinity(0, sizeof one, &one) != 0) return;
    ::sched_setaffinity(0, sizeof allowed, &allowed);
    moves_.fetch_add(1, std::memory_order_relaxed);
    noteCpu(::sched_getcpu());
    return;
  }
}

int Device::Windows::linkedPeer() {
  if (op_ == 0 || control(device_.rank_).linked.load(std::memory_order_relaxed) == op_) return -1;
  for (int r = 0; r < device_.size_; ++r) {
    if (r == device_.rank_) continue;
    WindowControl& p = control(r);
    // One that posted a chunk of the op here ran part of it in the windows
    // (a coalesced op's earlier tensor) and moved on, as this rank will.
    if (p.linked.load(std::memory_order_relaxed) == op_ && p.op[0].seq.load(std::memory_order_relaxed) != op_ &&
        p.op[1].seq.load(std::memory_order_relaxed) != op_) {
      return r;
    }
  }
  return -1;
}

void Device::Windows::checkPeers(const std::function<bool()>& ready) {
  if (const int r = linkedPeer(); r >= 0 && !ready()) {
    const WindowControl& peer = control(r);
    device_.breakWith(Error(str("collx rank ", device_.rank_, ": mismatched collective with peer ", r, ": peer runs ",
                                name(OpKind(peer.startedKind.load())), " #", op_,
                                " over its connections, this rank in shared memory (an algorithm chosen for other "
                                "sizes or dtypes). Every rank must call the same collectives in the same order with "
                                "the same sizes and dtypes.")),
                      false);
  }
  pollfds_.clear();  // kept across calls: no allocation on a wait path
  for (auto& p : device_.pairs_) {
    if (p) pollfds_.push_back({p->fd(), POLLIN, 0});
  }
  try {
    const int rc = ::poll(pollfds_.data(), pollfds_.size(), 0);
    size_t i = 0;
    for (auto& p : device_.pairs_) {
      if (!p) continue;
      if (rc > 0) p->afterSleep(pollfds_[i].revents);
      ++i;
      p->checkControl(UINT64_MAX, true, device_.seqPosted_);  // an abort or cancel frame in its ring, or its end
    }
  } catch (const Error& e) {
    // A peer that has everything it needed may finish the op and leave (its
    // socket closes) before this rank sees the counter it waited for: what
    // it posted before leaving counts, as bytes sent before a close do.
    if (ready()) return;
    device_.breakWith(e, false);
  }
}

void Device::Windows::waitFor(const std::function<bool()>& ready, Deadline deadline,
                              const std::function<std::string()>& what) {
  device_.throwIfBroken();
  if (ready()) return;  // before any clock read: most waits of a small op end here or soon after
  WindowControl& me = control(device_.rank_);
  const Clock::time_point spinStart = Clock::now();
  const Deadline spinUntil = spinStart + device_.spin_;
  for (uint32_t round = 1;; ++round) {
    // While spinning alone on a core, a few looks between clock reads: the
    // clock costs more than a look, and delays seeing the counter move.
    for (int look = device_.yield_ ? 1 : kLooksPerClock; look > 0; --look) {
      if (ready()) return;
    }
    // Backend::shutdown or abort with this op in flight: fail now, as a wait
    // on the rings does when interrupt() shuts their sockets.
    if (device_.interrupted_) device_.breakWith(Error("interrupted"), false);
    const Deadline now = Clock::now();
    if (now >= deadline) {
      device_.breakWith(TimeoutError(str("collx rank ", device_.rank_, ": Timed out waiting for ", what())), true);
    }
    if (round % 256 == 0) checkPeers(ready);
    if (now < spinUntil && !device_.spinPause(now - spinStart)) continue;
    // Sleep on this rank's bell; a peer that publishes rings it (publish()).
    me.sleeping.store(1, std::memory_order_seq_cst);
    const uint32_t bell = me.bell.load(std::memory_order_seq_cst);
    if (!ready()) futexWait(&me.bell, bell, std::min<std::chrono::nanoseconds>(kSleepSlice, deadline - now));
    me.sleeping.store(0, std::memory_order_relaxed);
    checkPeers(ready);
  }
}

void Device::Windows::noteMissing(std::vector<int> ranks) {
  std::lock_guard<std::mutex> lock(device_.progressMutex_);
  device_.missing_ = std::move(ranks);
  device_.missingOfAll_ = true;
}

void Device::Windows::readPeer(int r, uint64_t address, void* dst, size_t bytes) {
  count(Carrier::kPeerMemory, 0, bytes);
  char* to = static_cast<char*>(dst);
  if (bytes < kSlowStringCopyMinBytes || !slowStringCopy(uintptr_t(to), uintptr_t(address))) {
    return readRaw(r, address, to, bytes);
  }
  // The kernel would copy at a crawling distance (copy.h): read a piece at
  // a time into a scratch at the source's page offset, which stays in cache
  // while copyBytes moves it on.
  alignas(4096) thread_local char scratch[kBouncePieceBytes + 4096];
  char* const at = scratch + address % 4096;
  for (size_t done = 0; done < bytes; done += kBouncePieceBytes) {
    const size_t len = std::min(kBouncePieceBytes, bytes - done);
    readRaw(r, address + done, at, len);
    copyBytes(to + done, at, len);
  }
}

void Device::Windows::readRaw(int r, uint64_t address, char* to, size_t bytes) {
  while (bytes > 0) {
    iovec local{to, bytes};
    iovec remote{reinterpret_cast<void*>(uintptr_t(address)), bytes};
    const ssize_t got = ::process_vm_readv(pids_.at(size_t(r)), &local, 1, &remote, 1, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      const int err = got == 0 ? 0 : errno;
      // A peer that failed first sent its abort frame before it exited or
      // freed its tensors: the frame names the cause (rank 2 saw rank 1 die,
      // aborted, and left (ESRCH) or freed the window (EFAULT) while rank 0
      // was still reading it).
      try {
        Pair& p = *device_.pairs_.at(size_t(r));
        p.checkControl(UINT64_MAX, false);
        p.throwIfAbortNoted();  // a ring full of data left the frame out
      } catch (const PeerAbortedError& e) {
        device_.breakWith(e, false);
      } catch (const Error&) {
      }
      if (err == ESRCH) device_.breakWith(peerClosed(device_.rank_, r, "shared-memory"), false);
      const std::string why = err == 0 ? "nothing read" : strerror(err);
      device_.breakWith(Error(str("collx rank ", device_.rank_, ": could not read peer ", r, "'s memory (pid ",
                                  pids_.at(size_t(r)), "): ", why)),
                        false);
    }
    to += got;
    address += uint64_t(got);
    bytes -= size_t(got);
  }
}

void Device::Windows::checkGroup(uint64_t seq) {
  device_.throwIfBroken();
  op_ = seq < kInternalSeqs ? seq : 0;
  if (seq < kInternalSeqs) device_.seqPosted_ = std::max(device_.seqPosted_, seq);
  try {
    for (auto& p : device_.pairs_) {
      // A peer that posted may have finished the op and left: its end is no
      // error here (a wait on it would notice it).
      if (p) p->checkControl(seq, false, device_.seqPosted_);
    }
  } catch (const Error& e) {
    device_.breakWith(e, false);
  }
}

void Device::Windows::fail(const std::string& why) { device_.breakWith(Error(why), false); }

}  // namespace collx::tcp

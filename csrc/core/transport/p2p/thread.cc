// The progress side of P2PEngine: its thread, its wakeups, and a waiter
// driving progress itself for a while (engine.h).
#include <poll.h>
#include <unistd.h>

#include <algorithm>

#include "engine.h"

namespace collx::tcp {

void P2PEngine::runFinished(std::unique_lock<std::mutex>& lock) {
  while (!finished_.empty()) {
    std::vector<Finished> batch;
    batch.swap(finished_);
    lock.unlock();
    for (auto& f : batch) f.done(f.source, f.error);
    batch.clear();  // drops the callbacks' captures outside the lock too
    lock.lock();
  }
}

void P2PEngine::startThread() {
  if (!thread_.joinable() && !stopping_) thread_ = std::thread([this] { loop(); });
}

void P2PEngine::wake() {
  if (!thread_.joinable()) return;
  uint64_t one = 1;
  ssize_t rc = ::write(wakeFd_, &one, sizeof(one));
  (void)rc;  // EAGAIN: a wakeup is pending anyway
}

void P2PEngine::kick() {
  const bool writes = std::any_of(links_.begin(), links_.end(), [](auto& l) { return l && l->alive() && l->wantsWrite(); });
  if (writes || nextDeadline() < wakeAt_) wake();
}

void P2PEngine::spin(const std::function<bool()>& finished, std::chrono::microseconds budget) {
  const Deadline until = Clock::now() + budget;
  bool drove = false;
  while (!finished() && Clock::now() < until) {
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (lock.owns_lock() && closed_.empty()) {
      progress();
      drove = true;
      runFinished(lock);
    }
    if (lock.owns_lock()) lock.unlock();
    std::this_thread::yield();
  }
  if (drove) {
    // What this thread queued (a cleared send's data, say) must not wait on
    // a progress thread that sleeps without watching for it.
    std::lock_guard<std::mutex> lock(mu_);
    kick();
  }
}

void P2PEngine::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  std::vector<pollfd> fds;
  std::vector<std::pair<P2PLink*, size_t>> sleepers;  // ring links asleep in this poll, and their fds index
  while (!stopping_) {
    progress();
    expire();
    runFinished(lock);
    if (stopping_) break;
    fds.assign(1, pollfd{wakeFd_, POLLIN, 0});
    sleepers.clear();
    bool moved = false;
    for (auto& l : links_) {
      if (!l || !l->alive()) continue;
      if (l->usesShm()) {
        // The rings' doorbell and the peer's end both arrive as POLLIN.
        if (!l->prepareSleep()) {
          moved = true;
          break;
        }
        sleepers.emplace_back(l.get(), fds.size());
        fds.push_back({l->fd(), POLLIN, 0});
      } else {
        fds.push_back({l->fd(), short(POLLIN | (l->wantsWrite() ? POLLOUT : 0)), 0});
      }
    }
    if (moved) {  // a peer moved since progress(): go round again
      for (auto& [l, i] : sleepers) l->afterSleep(0);
      continue;
    }
    wakeAt_ = nextDeadline();
    int64_t ms = -1;
    if (wakeAt_ != Deadline::max()) {
      ms = std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(wakeAt_ - Clock::now()).count() + 1);
    }
    lock.unlock();
    const int rc = ::poll(fds.data(), fds.size(), int(std::min<int64_t>(ms, 1 << 30)));
    if (fds[0].revents) {
      uint64_t n;
      ssize_t got = ::read(wakeFd_, &n, sizeof(n));
      (void)got;
    }
    lock.lock();
    for (auto& [l, i] : sleepers) l->afterSleep(rc > 0 ? fds[i].revents : 0);
  }
}

}  // namespace collx::tcp

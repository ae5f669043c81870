// Device::Windows: the SharedWindows of a Device whose peers all share this
// host: every rank's window area, mapped from the segments of shm/links.h,
// and waits that watch the pairs' sockets and rings for a peer's failure.
#pragma once

#include <poll.h>

#include <memory>
#include <vector>

#include "../device.h"

namespace collx::tcp {

class Device::Windows : public SharedWindows {
 public:
  // `pids` and `reads`: shm::LocalLinks's.
  Windows(Device& device, std::vector<char*> areas, std::vector<std::shared_ptr<shm::Segment>> segments,
          std::vector<pid_t> pids, PeerReads reads);

  size_t halfBytes() const override { return shm::kWindowHalfBytes; }
  char* window(int rank) override { return areas_.at(size_t(rank)) + kControlBytes; }
  WindowControl& control(int rank) override { return *reinterpret_cast<WindowControl*>(areas_.at(size_t(rank))); }
  PeerReads peerReads() const override { return reads_; }
  void readPeer(int r, uint64_t address, void* dst, size_t bytes) override;
  void count(Carrier c, uint64_t sent, uint64_t received) override { counters_.add(c, sent, received); }
  TransportCounters counters() const override { return counters_.snapshot(); }
  void checkGroup(uint64_t seq) override;
  void publish() override;
  void waitFor(const std::function<bool()>& ready, Deadline deadline,
               const std::function<std::string()>& what) override;
  [[noreturn]] void fail(const std::string& why) override;
  void noteMissing(std::vector<int> ranks) override;

  // After a yield found this thread's core shared (Device::spinPause): where
  // a local peer of a lower rank last ran on this core and some core this
  // thread may run on has no peer, moves this thread there.
  void unstack();
  // This rank's op thread runs on `cpu` now (the ops' start, for unstack()).
  void noteCpu(int cpu) { control(device_.rank_).cpu.store(cpu + 1, std::memory_order_relaxed); }
  uint64_t moves() const { return moves_.load(std::memory_order_relaxed); }

 private:
  static constexpr size_t kControlBytes = 4096;
  // Throws (breaking the device) if a peer closed its socket or sent an
  // abort, or runs this rank's op over its connections (WindowControl::
  // linked), unless ready() holds by then.
  void checkPeers(const std::function<bool()>& ready);
  // A peer that runs op #op_ over its connections and posted none of it
  // here, while this rank ran none of it there: -1 if none.
  int linkedPeer();
  // readPeer() without the bounce: process_vm_readv straight into `to`.
  void readRaw(int r, uint64_t address, char* to, size_t bytes);
  static constexpr size_t kBouncePieceBytes = 128 << 10;  // 16-32 KiB pieces cost more calls; 1 MiB no less

  Device& device_;
  std::vector<char*> areas_;
  std::vector<std::shared_ptr<shm::Segment>> segments_;
  std::vector<pid_t> pids_;
  PeerReads reads_;
  std::vector<pollfd> pollfds_;  // checkPeers()'s
  uint64_t op_ = 0;              // the user's collective of the wait (checkGroup), 0 for the group's own
  SharedCounters counters_;
  Clock::time_point lastMove_{};  // unstack()'s, at most one per kMoveEvery
  std::atomic<uint64_t> moves_{0};
};

}  // namespace collx::tcp

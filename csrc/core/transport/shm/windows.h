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
  // `pids` and `readPeers`: shm::LocalLinks's.
  Windows(Device& device, std::vector<char*> areas, std::vector<std::shared_ptr<shm::Segment>> segments,
          std::vector<pid_t> pids, bool readPeers);

  size_t halfBytes() const override { return shm::kWindowHalfBytes; }
  char* window(int rank) override { return areas_.at(size_t(rank)) + kControlBytes; }
  WindowControl& control(int rank) override { return *reinterpret_cast<WindowControl*>(areas_.at(size_t(rank))); }
  bool canReadPeers() const override { return readPeers_; }
  void readPeer(int r, uint64_t address, void* dst, size_t bytes) override;
  void count(Carrier c, uint64_t sent, uint64_t received) override {
    sent_[int(c)].fetch_add(sent, std::memory_order_relaxed);
    received_[int(c)].fetch_add(received, std::memory_order_relaxed);
  }
  TransportCounters counters() const override;
  void checkGroup(uint64_t seq) override;
  void publish() override;
  void waitFor(const std::function<bool()>& ready, Deadline deadline,
               const std::function<std::string()>& what) override;
  [[noreturn]] void fail(const std::string& why) override;
  void noteMissing(std::vector<int> ranks) override;

 private:
  static constexpr size_t kControlBytes = 4096;
  // Throws (breaking the device) if a peer closed its socket or sent an
  // abort, unless ready() holds by then.
  void checkPeers(const std::function<bool()>& ready);

  Device& device_;
  std::vector<char*> areas_;
  std::vector<std::shared_ptr<shm::Segment>> segments_;
  std::vector<pid_t> pids_;
  bool readPeers_;
  std::vector<pollfd> pollfds_;  // checkPeers()'s
  std::atomic<uint64_t> sent_[kCarriers] = {}, received_[kCarriers] = {};
};

}  // namespace collx::tcp

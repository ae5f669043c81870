// A group of N ranks in one process: Devices over loopback, set up through
// an in-memory Store by N threads (the C++ tests' world). All ranks share a
// host, so by default they talk through shared-memory rings; pass
// transport = shm::Mode::kTcp for sockets.
#pragma once

#include <memory>
#include <vector>

#include "../../csrc/core/transport/tcp/device.h"
#include "check.h"
#include "memory_store.h"

namespace collx::test {

struct Group {
  MemoryStore store;
  std::vector<std::unique_ptr<tcp::Device>> devices;
  explicit Group(int size, tcp::DeviceOptions options = {}) : devices(size) {
    runRanks(size, [&](int r) { devices[r] = std::make_unique<tcp::Device>(store, r, size, options); });
  }
};

}  // namespace collx::test

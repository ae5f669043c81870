// A group of N ranks in one process: Devices over loopback, set up through
// an in-memory Store by N threads (the C++ tests' world). All ranks share a
// host, so by default they talk through shared-memory rings; pass
// transport = shm::Mode::kTcp for sockets.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../../csrc/core/algorithms/algorithms.h"
#include "../../csrc/core/algorithms/collective.h"
#include "../../csrc/core/error.h"
#include "../../csrc/core/reduce/reduce.h"
#include "../../csrc/core/transport/device.h"
#include "check.h"
#include "memory_store.h"

namespace collx::test {

// Options for a Device on `mode`, reading its peers' memory wherever allowed
// (whatever a read costs, so that the tests run the reads in place) unless
// readPeers is false.
inline tcp::DeviceOptions over(shm::Mode mode, bool readPeers = true) {
  tcp::DeviceOptions o;
  o.transport = mode;
  o.readPeers = readPeers ? shm::ReadPeers::kAlways : shm::ReadPeers::kNever;
  return o;
}

struct Group {
  MemoryStore store;
  std::vector<std::unique_ptr<tcp::Device>> devices;
  explicit Group(int size, tcp::DeviceOptions options = {}) : devices(size) {
    runRanks(size, [&](int r) { devices[r] = std::make_unique<tcp::Device>(store, r, size, options); });
  }
};

using AllreduceFn = void (*)(const Collective&, void*, size_t, ReduceFn);

// shmAllgather on n blocks laid end to end, this rank's in place.
inline void shmAllgatherFlat(const Collective& c, int32_t* buf, size_t block) {
  const auto blocks = blocksAt<void*>(buf, c.size(), block * sizeof(int32_t));
  shmAllgather(c, blocks[size_t(c.rank())], blocks, block);
}

// Rank 0 of a new 2-rank group runs `allreduce` over `count` floats while
// rank 1 closes its device after 50 ms (as a killed process's sockets
// close); returns rank 0's error.
inline std::string errorWhenPeerLeaves(AllreduceFn allreduce, size_t count) {
  Group g(2, over(shm::Mode::kShm));
  std::string error;
  test::runRanks(2, [&](int r) {
    if (r == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      g.devices[1]->close();
      return;
    }
    std::vector<float> buf(count, 1.0f);
    Workspace ws;
    Collective c{*g.devices[0], OpKind::kAllreduce, DataType::kFloat32, 1, Clock::now() + std::chrono::seconds(20),
                 1 << 16, 2, ws};
    try {
      allreduce(c, buf.data(), buf.size(), cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
    } catch (const Error& e) {
      error = e.what();
    }
  });
  return error;
}

}  // namespace collx::test

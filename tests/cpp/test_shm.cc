// The shared-memory path: the ring alone (wrap-around, concurrent copies in
// odd sizes, the sleep handshake), a group's setup and its note, a peer that
// goes away mid-op, errors of attaching, and no descriptor or mapping leaked
// over many groups.
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>

#include "../../csrc/core/algorithms/algorithms.h"
#include "../../csrc/core/error.h"
#include "../../csrc/core/transport/shm/links.h"
#include "../../csrc/core/transport/tcp/device.h"
#include "check.h"
#include "group.h"
#include "memory_store.h"

using namespace collx;

namespace {

using test::Group;

// A ring over plain memory: one thread writes 40 MB in random pieces of
// random iovecs, another reads it in random sizes; the bytes must match.
void testRingStream() {
  const size_t cap = 64 << 10;
  std::vector<char> mem(sizeof(shm::RingControl) + cap);
  auto* control = new (mem.data()) shm::RingControl{};
  shm::Ring ring(control, mem.data() + sizeof(shm::RingControl), cap);
  const size_t total = 40 << 20;
  auto byteAt = [](size_t i) { return char((i * 131) ^ (i >> 13)); };
  std::thread writer([&] {
    std::mt19937 rng(1);
    std::vector<char> src(300000);
    size_t sent = 0;
    while (sent < total) {
      size_t a = std::min<size_t>(rng() % 100000, total - sent), b = std::min<size_t>(rng() % 200000, total - sent - a);
      for (size_t i = 0; i < a + b; ++i) src[i] = byteAt(sent + i);
      size_t done = 0;
      while (done < a + b) {  // resubmit the rest, as Pair does
        iovec rest[2];
        int n = 0;
        if (done < a) rest[n++] = {src.data() + done, a - done};
        rest[n++] = {src.data() + std::max(done, a), a + b - std::max(done, a)};
        bool wake = false;
        done += ring.write(rest, n, wake);
      }
      sent += a + b;
    }
  });
  std::mt19937 rng(2);
  std::vector<char> dst(200000);
  size_t got = 0;
  while (got < total) {
    bool wake = false;
    size_t n = ring.read(dst.data(), 1 + rng() % dst.size(), wake);
    for (size_t i = 0; i < n; ++i) CHECK(dst[i] == byteAt(got + i), "byte ", got + i);
    got += n;
  }
  writer.join();
  CHECK(ring.readable() == 0 && ring.writable() == cap, "ring not empty at the end");
}

// The sleep handshake: a sleeper with bytes waiting must not sleep; a writer
// that finds the reader asleep must be told to ring, once.
void testRingSleep() {
  const size_t cap = 4096;
  std::vector<char> mem(sizeof(shm::RingControl) + cap);
  auto* control = new (mem.data()) shm::RingControl{};
  shm::Ring ring(control, mem.data() + sizeof(shm::RingControl), cap);
  char b[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  iovec iov{b, sizeof(b)};
  bool wake = true;
  CHECK(ring.sleepAsReader(), "an empty ring lets its reader sleep");
  CHECK(ring.write(&iov, 1, wake) == 8 && wake, "the writer must wake a sleeping reader");
  CHECK(ring.write(&iov, 1, wake) == 8 && !wake, "the reader was woken once already");
  CHECK(!ring.sleepAsReader(), "a reader with bytes waiting must not sleep");
  char out[4096];
  CHECK(ring.read(out, sizeof(out), wake) == 16 && !wake, "read everything, no writer asleep");
  std::vector<char> big(cap);
  iovec full{big.data(), big.size()};
  CHECK(ring.write(&full, 1, wake) == cap, "fill the ring");
  CHECK(ring.sleepAsWriter(), "a full ring lets its writer sleep");
  CHECK(ring.read(out, 1, wake) == 1 && wake, "the reader must wake a sleeping writer");
  CHECK(!ring.sleepAsWriter(), "a writer with space must not sleep");
}

tcp::DeviceOptions over(shm::Mode mode, bool readPeers = true) {
  tcp::DeviceOptions o;
  o.transport = mode;
  o.readPeers = readPeers;
  return o;
}

void testSetupNotes() {
  Group shm(3, over(shm::Mode::kShm));
  for (auto& d : shm.devices) {
    CHECK(d->transportNote().find("shared memory with 2 local peer(s), 1024 KiB rings") == 0, d->transportNote());
    CHECK(!d->shmUnavailable(), "shm available");
    CHECK(d->transportNote().find("cross-memory attach") != std::string::npos, d->transportNote());
    CHECK(d->sharedWindows()->canReadPeers(), "the ranks (threads of one process) can read each other");
  }
  Group noCma(2, over(shm::Mode::kShm, false));
  for (auto& d : noCma.devices) {
    CHECK(d->transportNote().find("cross-memory attach") == std::string::npos, d->transportNote());
    CHECK(d->sharedWindows() && !d->sharedWindows()->canReadPeers(), "COLLX_SHM_CMA=0 turns it off");
  }
  Group tcp(2, over(shm::Mode::kTcp));
  CHECK(tcp.devices[0]->transportNote().empty(), tcp.devices[0]->transportNote());
  // 32 MiB per rank for its inbound rings, two per local peer: 1 MiB each up to 17 local ranks.
  CHECK(shm::ringBytes(2) == (1 << 20) && shm::ringBytes(17) == (1 << 20) && shm::ringBytes(18) == (512 << 10),
        "ring sizes");
  CHECK(shm::ringBytes(1024) == (64 << 10), "ring floor");
}

using AllreduceFn = void (*)(const Collective&, void*, size_t, ReduceFn);

// Rank 0 of a new 2-rank group runs `allreduce` over `count` floats while
// rank 1 closes its device after 50 ms (as a killed process's sockets
// close); returns rank 0's error.
std::string errorWhenPeerLeaves(AllreduceFn allreduce, size_t count) {
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

// A peer that leaves while this rank waits on it: the error comes at once
// and says so, not at the deadline.
void testPeerGoneMidOp() {
  auto start = Clock::now();
  const std::string error = errorWhenPeerLeaves(ringAllreduce, 1 << 20);
  CHECK(error.find("closed by the peer") != std::string::npos, "got: ", error);
  CHECK(Clock::now() - start < std::chrono::seconds(5), "the dead peer was noticed only at the deadline");
}

// Rank 1 rejects rank 0's frame and aborts while rank 0 still has most of a
// large message to write into a full ring and nothing to receive: rank 0
// must read the abort frame waiting in its inbound ring and fail with its
// reason, at once (it once spun on that unread frame, never sleeping).
void testAbortWhileSenderBlocked() {
  Group g(2, over(shm::Mode::kShm));
  std::string error;
  auto start = Clock::now();
  test::runRanks(2, [&](int r) {
    tcp::Device& d = *g.devices[r];
    std::vector<char> buf(4 << 20);
    const Deadline deadline = Clock::now() + std::chrono::seconds(20);
    try {
      if (r == 0) {
        d.postSend(1, Frame{OpKind::kAllToAll, DataType::kUInt8, 7, 0}, buf.data(), buf.size(), 1);
      } else {
        d.postRecv(0, Frame{OpKind::kAllToAll, DataType::kUInt8, 7, 0}, buf.data(), buf.size() - 1, 1);
      }
      waitAll(d, deadline);
    } catch (const Error& e) {
      if (r == 0) error = e.what();
    }
  });
  CHECK(error.find("peer 1 failed and aborted the group") != std::string::npos, "got: ", error);
  CHECK(Clock::now() - start < std::chrono::seconds(5), "the abort was seen only at the deadline");
}

// The all-reduce in shared windows: a count mismatch fails every rank before
// a byte of its buffer is written; a peer that never comes is a timeout that
// names it; one that goes away fails the waiter at once.
void testWindowsAllreduceFailures() {
  Group g(3, over(shm::Mode::kShm));
  std::vector<std::string> errors(3);
  std::vector<char> untouched(3, 0);  // not vector<bool>: each rank writes its own element
  test::runRanks(3, [&](int r) {
    CHECK(g.devices[r]->sharedWindows() != nullptr, "a group on one host has shared windows");
    std::vector<float> buf(r == 2 ? 1000 : 1001, float(r + 1));
    Workspace ws;
    Collective c{*g.devices[r], OpKind::kAllreduce, DataType::kFloat32, 1, Clock::now() + std::chrono::seconds(20),
                 1 << 16, 2, ws};
    try {
      shmAllreduce(c, buf.data(), buf.size(), cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
    } catch (const Error& e) {
      errors[r] = e.what();
    }
    untouched[r] = std::all_of(buf.begin(), buf.end(), [&](float v) { return v == float(r + 1); });
  });
  for (int r = 0; r < 3; ++r) {
    CHECK(errors[r].find("mismatched collective") != std::string::npos ||
              errors[r].find("aborted the group") != std::string::npos,
          "rank ", r, ": ", errors[r]);
    CHECK(untouched[r], "rank ", r, ": its buffer was written despite the mismatch");
  }

  Group lone(2, over(shm::Mode::kShm));
  std::vector<float> buf(10, 1.0f);
  Workspace ws;
  Collective c{*lone.devices[0], OpKind::kAllreduce, DataType::kFloat32, 1,
               Clock::now() + std::chrono::milliseconds(300), 1 << 16, 2, ws};
  std::string error;
  try {
    shmAllreduce(c, buf.data(), buf.size(), cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
  } catch (const TimeoutError& e) {
    error = e.what();
  }
  CHECK(error.find("Timed out waiting for peer(s) 1 to have posted") != std::string::npos, "got: ", error);

  auto start = Clock::now();
  error = errorWhenPeerLeaves(shmAllreduce, 10);
  CHECK(error.find("closed by the peer") != std::string::npos, "got: ", error);
  CHECK(Clock::now() - start < std::chrono::seconds(5), "the departed peer was noticed only at the deadline");

  // Shut down (Backend::shutdown calls interrupt) while waiting on a peer
  // that never comes: the op fails at once, not at its deadline.
  Group down(2, over(shm::Mode::kShm));
  start = Clock::now();
  error.clear();
  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    down.devices[0]->interrupt();
  });
  Collective c1{*down.devices[0], OpKind::kAllreduce, DataType::kFloat32, 1, Clock::now() + std::chrono::seconds(20),
                1 << 16, 2, ws};
  try {
    shmAllreduce(c1, buf.data(), buf.size(), cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
  } catch (const Error& e) {
    error = e.what();
  }
  stopper.join();
  CHECK(error.find("shut down") != std::string::npos, "got: ", error);
  CHECK(Clock::now() - start < std::chrono::seconds(5), "a shutdown was noticed only at the deadline");
}

// The other collectives in shared windows check the op's identity too, the
// root of a broadcast included: ranks that disagree fail before any of them
// writes a byte of its buffer; through the windows, or reading the peers'
// memory.
void testWindowsMismatch(bool readPeers) {
  Group g(3, over(shm::Mode::kShm, readPeers));
  std::vector<std::string> errors(3);
  std::vector<char> untouched(3, 0);
  test::runRanks(3, [&](int r) {
    const size_t block = readPeers ? 300000 : 5000;  // over a half: all-gather reads in place
    std::vector<int32_t> buf(3 * block, r + 1);
    Workspace ws;
    Collective c{*g.devices[r], r == 2 ? OpKind::kAllgather : OpKind::kBroadcast, DataType::kInt32, 1,
                 Clock::now() + std::chrono::seconds(20), 1 << 16, 2, ws};
    try {
      if (r == 2) {
        shmAllgather(c, buf.data(), block);
      } else {
        shmBroadcast(c, buf.data(), buf.size(), r);  // each thinks itself the root
      }
    } catch (const Error& e) {
      errors[r] = e.what();
    }
    untouched[r] = std::all_of(buf.begin(), buf.end(), [&](int32_t v) { return v == r + 1; });
  });
  for (int r = 0; r < 3; ++r) {
    CHECK(errors[r].find("mismatched collective") != std::string::npos ||
              errors[r].find("aborted the group") != std::string::npos,
          "rank ", r, ": ", errors[r]);
    CHECK(untouched[r], "rank ", r, ": its buffer was written despite the mismatch");
  }
  CHECK(errors[0].find("root 1") != std::string::npos || errors[0].find("all_gather") != std::string::npos,
        "rank 0 names what the peer runs: ", errors[0]);
}

// The shared-memory collectives back to back, each rank running on without
// waiting for the others between ops, one of them lagging now and then: a
// rank may post its next op's first chunk before a slower peer has checked
// this one's identity (which once read as a mismatch), and every value must
// still come out right. All-gather and broadcast run through the windows
// or, with readPeers, straight from the peers' buffers, whose owners must
// not move on (and overwrite them) before every peer has read.
void testWindowsBackToBack(bool readPeers) {
  const int n = 3;
  Group g(n, over(shm::Mode::kShm, readPeers));
  test::runRanks(n, [&](int r) {
    Workspace ws;
    const ReduceFn sum = cpuReduceFn(DataType::kInt32, ReduceOp::kSum);
    for (uint64_t seq = 1; seq <= 600; ++seq) {
      if (r == int(seq % n) && seq % 7 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
      // Some blocks are over a half, so that all-gather reads in place.
      const size_t block = seq % 10 == 9 ? 300000 : 1 + seq % 5 * 1000;
      const OpKind kinds[] = {OpKind::kReduceScatter, OpKind::kAllgather, OpKind::kBroadcast, OpKind::kAllreduce};
      const OpKind kind = kinds[seq % 4];
      Collective c{*g.devices[r], kind, DataType::kInt32, seq, Clock::now() + std::chrono::seconds(20), 1 << 16, 2,
                   ws};
      std::vector<int32_t> buf(n * block);
      for (size_t i = 0; i < buf.size(); ++i) buf[i] = int32_t(i % 101) * (r + 1);
      const int root = int(seq % n);
      auto want = [&](size_t i) {  // element i of the result, where this rank has one
        const int32_t v = int32_t(i % 101);
        switch (kind) {
          case OpKind::kBroadcast: return v * (root + 1);
          case OpKind::kAllgather: return v * int32_t(i / block + 1);
          default: return v * (n * (n + 1) / 2);
        }
      };
      size_t lo = 0, hi = buf.size();
      switch (kind) {
        case OpKind::kReduceScatter: {
          std::vector<const void*> blocks;
          for (int q = 0; q < n; ++q) blocks.push_back(buf.data() + size_t(q) * block);
          shmReduceScatter(c, blocks, buf.data() + size_t(r) * block, block, sum);
          lo = r * block, hi = lo + block;
          break;
        }
        case OpKind::kAllgather: shmAllgather(c, buf.data(), block); break;
        case OpKind::kBroadcast: shmBroadcast(c, buf.data(), buf.size(), root); break;
        default: shmAllreduce(c, buf.data(), buf.size(), sum);
      }
      for (size_t i = lo; i < hi; ++i) {
        CHECK(buf[i] == want(i), name(kind), " #", seq, " rank ", r, " element ", i, ": ", buf[i], " != ", want(i));
      }
    }
  });
}

// All-gathers that read the peers' buffers in place, each rank refilling
// its buffer for the next op as soon as one returns (as a training loop
// does): no rank may return while a peer still reads its buffer, or that
// peer copies some of the next op's values.
void testReadInPlaceKeepsBuffers() {
  const int n = 3;
  const size_t block = 300000;  // over a half
  Group g(n, over(shm::Mode::kShm));
  test::runRanks(n, [&](int r) {
    Workspace ws;
    std::vector<int32_t> buf(n * block);
    for (uint64_t seq = 1; seq <= 100; ++seq) {
      std::fill(buf.begin(), buf.end(), int32_t(seq * 10 + r));
      Collective c{*g.devices[r], OpKind::kAllgather, DataType::kInt32, seq, Clock::now() + std::chrono::seconds(20),
                   1 << 16, 2, ws};
      shmAllgather(c, buf.data(), block);
      for (int q = 0; q < n; ++q) {
        const auto from = buf.begin() + q * block;
        CHECK(std::all_of(from, from + block, [&](int32_t v) { return v == int32_t(seq * 10 + q); }),
              "all_gather #", seq, " rank ", r, ": block ", q, " holds another op's values");
      }
    }
  });
}

// Rank 1 rejects op #1 (cancels it) while rank 0, its root, sends and so
// finishes it; both then run a one-round shm all-reduce #2, which needs no
// message. Both must fail it, as they would over TCP, with the cause:
// rank 0 with rank 1's reason, rank 1 because rank 0 ran what it rejected.
void testCancelBeforeWindowsOp() {
  Group g(2, over(shm::Mode::kShm));
  std::vector<std::string> errors(2);
  test::runRanks(2, [&](int r) {
    tcp::Device& d = *g.devices[r];
    Workspace ws;
    const Deadline deadline = Clock::now() + std::chrono::seconds(20);
    std::vector<float> buf(8, 1.0f);
    try {
      if (r == 1) {
        d.cancel(1, OpKind::kBroadcast, "the root was out of range here", deadline);
      } else {
        Collective c{d, OpKind::kBroadcast, DataType::kFloat32, 1, deadline, 1 << 16, 2, ws};
        broadcast(c, buf.data(), buf.size(), 0);
      }
    } catch (const Error& e) {
      errors[r] = str("#1: ", e.what());
      return;
    }
    Collective c{d, OpKind::kAllreduce, DataType::kFloat32, 2, deadline, 1 << 16, 2, ws};
    try {
      shmAllreduce(c, buf.data(), buf.size(), cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
    } catch (const Error& e) {
      errors[r] = e.what();
    }
  });
  CHECK(errors[0].find("peer 1 did not run broadcast #1, which failed there: the root was out of range here") !=
            std::string::npos,
        "rank 0: ", errors[0]);
  CHECK(errors[1].find("which this rank rejected") != std::string::npos ||
            errors[1].find("aborted the group") != std::string::npos,
        "rank 1: ", errors[1]);
}

// A Store as one rank sees it, where a peer's segment address reads as a
// failure to create it: the pair of that rank and peer cannot link.
class HidingStore : public Store {
 public:
  HidingStore(Store& inner, std::string key) : inner_(inner), key_(std::move(key)) {}
  void set(const std::string& key, const std::vector<uint8_t>& value) override { inner_.set(key, value); }
  std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override {
    auto value = inner_.get(key, timeout);
    if (key.size() >= key_.size() && key.compare(key.size() - key_.size(), key_.size(), key_) == 0) {
      const std::string failed = "-hidden by the test";
      return {failed.begin(), failed.end()};
    }
    return value;
  }
  int64_t add(const std::string& key, int64_t delta) override { return inner_.add(key, delta); }

 private:
  Store& inner_;
  std::string key_;
};

// Pair 1-2 cannot link while 0-1 and 0-2 can: rank 0 alone would have every
// window and run the shm all-reduce while 1 and 2 ran another, until the
// deadline. The ranks agree instead: no rank has windows, and auto runs
// alike everywhere.
void testOnePairUnlinked() {
  const int n = 3;
  test::MemoryStore store;
  HidingStore hiding(store, "shm/2");
  std::vector<std::unique_ptr<tcp::Device>> devices(n);
  test::runRanks(n, [&](int r) {
    devices[r] = std::make_unique<tcp::Device>(r == 1 ? static_cast<Store&>(hiding) : store, r, n, over(shm::Mode::kAuto));
  });
  CHECK(devices[0]->transportNote().find("shared memory with 2 local peer(s)") == 0, devices[0]->transportNote());
  CHECK(devices[1]->shmUnavailable() && devices[2]->shmUnavailable(), "pair 1-2 fell back to TCP");
  test::runRanks(n, [&](int r) {
    CHECK(devices[r]->sharedWindows() == nullptr, "rank ", r, " has shared windows, though pair 1-2 did not link");
    std::vector<float> buf(1 << 20, float(r + 1));
    Workspace ws;
    Collective c{*devices[r], OpKind::kAllreduce, DataType::kFloat32, 1, Clock::now() + std::chrono::seconds(20),
                 1 << 16, 2, ws};
    allreduce(c, Algorithm::kAuto, buf.data(), buf.size(), cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
    CHECK(buf.front() == 6.0f && buf.back() == 6.0f, "rank ", r, ": got ", buf.front());
  });
}

void testAttachErrors() {
  bool threw = false;
  try {
    shm::Segment::attach(::getpid(), 987654, 4096);
  } catch (const Error& e) {
    threw = std::string(e.what()).find("/proc/") != std::string::npos;
  }
  CHECK(threw, "attaching a missing fd names the path");
  threw = false;
  try {
    shm::parseMode("udp");
  } catch (const Error& e) {
    threw = std::string(e.what()).find("COLLX_TRANSPORT") != std::string::npos;
  }
  CHECK(threw, "a bad mode names the variable");
}

size_t countEntries(const char* dir) {
  size_t n = 0;
  DIR* d = ::opendir(dir);
  while (::readdir(d)) ++n;
  ::closedir(d);
  return n;
}

size_t countMappings() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  size_t n = 0;
  while (std::getline(maps, line)) n += line.find("memfd:collx") != std::string::npos;
  return n;
}

void testNoLeaks() {
  { Group warm(3, over(shm::Mode::kShm)); }
  const size_t fds = countEntries("/proc/self/fd");
  for (int i = 0; i < 50; ++i) {
    Group g(3, over(shm::Mode::kShm));
    CHECK(countMappings() == 3 * 3, "each rank maps its segment and its 2 peers'");
    test::runRanks(3, [&](int r) {
      std::vector<int32_t> buf(1000, r);
      Workspace ws;
      Collective c{*g.devices[r], OpKind::kAllreduce, DataType::kInt32, 1, Clock::now() + std::chrono::seconds(30),
                   1 << 16, 2, ws};
      ringAllreduce(c, buf.data(), buf.size(), cpuReduceFn(DataType::kInt32, ReduceOp::kSum));
      CHECK(buf[999] == 3, "sum");
    });
  }
  CHECK(countEntries("/proc/self/fd") == fds, "descriptors leaked: ", countEntries("/proc/self/fd"), " vs ", fds);
  CHECK(countMappings() == 0, "segments still mapped: ", countMappings());
}

}  // namespace

int main() {
  testRingStream();
  testRingSleep();
  std::printf("shm: ring ok\n");
  testSetupNotes();
  testPeerGoneMidOp();
  testAbortWhileSenderBlocked();
  testWindowsAllreduceFailures();
  for (bool readPeers : {false, true}) {
    testWindowsMismatch(readPeers);
    testWindowsBackToBack(readPeers);
  }
  testReadInPlaceKeepsBuffers();
  testOnePairUnlinked();
  testCancelBeforeWindowsOp();
  testAttachErrors();
  testNoLeaks();
  std::printf("shm: group setup, peer gone, errors, leaks ok\n");
  return 0;
}

// The shared-memory path: the ring alone (wrap-around, concurrent copies in
// odd sizes, the sleep handshake), a group's setup and its note, a peer that
// goes away during setup or mid-op, an abort that cannot enter the stream, a
// pair that cannot link, errors of attaching, and no descriptor or mapping
// leaked over many groups. The collectives in the shared windows:
// test_shm_windows.cc.
#include <dirent.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <thread>

#include "../../csrc/core/algorithms/algorithms.h"
#include "../../csrc/core/error.h"
#include "../../csrc/core/transport/shm/links.h"
#include "../../csrc/core/transport/device.h"
#include "check.h"
#include "group.h"
#include "memory_store.h"

using namespace collx;

namespace {

using test::Group;
using test::errorWhenPeerLeaves;
using test::over;

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

void testSetupNotes() {
  Group shm(3, over(shm::Mode::kShm));
  for (auto& d : shm.devices) {
    CHECK(d->transportNote().find("shared memory with 2 local peer(s), 1024 KiB rings") == 0, d->transportNote());
    CHECK(!d->shmUnavailable(), "shm available");
    CHECK(d->transportNote().find("cross-memory attach") != std::string::npos, d->transportNote());
    CHECK(d->sharedWindows()->peerReads() == PeerReads::kAll,
          "the ranks (threads of one process) can read each other");
  }
  Group noCma(2, over(shm::Mode::kShm, false));
  for (auto& d : noCma.devices) {
    CHECK(d->transportNote().find("cross-memory attach") == std::string::npos, d->transportNote());
    CHECK(d->sharedWindows() && d->sharedWindows()->peerReads() == PeerReads::kNone,
          "COLLX_SHM_CMA=0 turns it off");
  }
  // By default the ranks read in place only what a read, as they measure it
  // at setup, pays for; all decide on the dearest.
  tcp::DeviceOptions measured;
  measured.transport = shm::Mode::kShm;
  Group byCost(3, measured);
  const std::string note = byCost.devices[0]->transportNote();
  const PeerReads reads = byCost.devices[0]->sharedWindows()->peerReads();
  const char* const said[] = {", the windows: a read of a peer's memory costs over 2 copies",
                              ", cross-memory attach for copies: a read to reduce costs over 1.4 copies",
                              ", cross-memory attach"};
  CHECK(note.find(said[int(reads)]) != std::string::npos, note);
  for (auto& d : byCost.devices) {
    CHECK(d->transportNote() == note, "every rank decides alike: ", d->transportNote(), " / ", note);
    CHECK(d->sharedWindows()->peerReads() == reads, note);
    // The calibration cache's key leaves out what was measured, which may
    // come out otherwise in the next run; it keeps whether the ranks may read.
    CHECK(d->transportKey() == "shared memory with 2 local peer(s), 1024 KiB rings, may read in place",
          d->transportKey());
  }
  for (auto& d : noCma.devices) CHECK(d->transportKey() == d->transportNote(), d->transportKey());
  Group tcp(2, over(shm::Mode::kTcp));
  CHECK(tcp.devices[0]->transportNote().empty(), tcp.devices[0]->transportNote());
  // 32 MiB per rank for its inbound rings, two per local peer: 1 MiB each up to 17 local ranks.
  CHECK(shm::ringBytes(2) == (1 << 20) && shm::ringBytes(17) == (1 << 20) && shm::ringBytes(18) == (512 << 10),
        "ring sizes");
  CHECK(shm::ringBytes(1024) == (64 << 10), "ring floor");
}

void testReadCost() {
  std::vector<char> theirs(256 << 10, 7);
  const double cost = shm::readCostOf(::getpid(), uintptr_t(theirs.data()), theirs.data(), theirs.size());
  CHECK(cost > 0 && cost < 1e6, "a read of this process's own memory: ", cost);
  CHECK(shm::readCostOf(::getpid(), 0, theirs.data(), theirs.size()) > 1e6, "an unreadable address costs everything");
  CHECK(shm::readsAtCost(0) == PeerReads::kAll && shm::readsAtCost(1.4) == PeerReads::kAll &&
            shm::readsAtCost(1.7) == PeerReads::kCopies && shm::readsAtCost(2) == PeerReads::kCopies &&
            shm::readsAtCost(3) == PeerReads::kNone && shm::readsAtCost(1e300) == PeerReads::kNone,
        "what a read's cost pays for");
  CHECK(shm::parseReadPeers("0") == shm::ReadPeers::kNever && shm::parseReadPeers("1") == shm::ReadPeers::kAlways &&
            shm::parseReadPeers("auto") == shm::ReadPeers::kWherePays &&
            shm::parseReadPeers("") == shm::ReadPeers::kWherePays,
        "COLLX_SHM_CMA's values");
  std::string error;
  try {
    shm::parseReadPeers("yes");
  } catch (const Error& e) {
    error = e.what();
  }
  CHECK(error == "COLLX_SHM_CMA must be 0, 1 or auto, not 'yes'", error);
}

// A peer that leaves while this rank waits on it: the error comes at once
// and says so, not at the deadline.
void testPeerGoneMidOp() {
  auto start = Clock::now();
  const std::string error = errorWhenPeerLeaves(ringAllreduce, 1 << 20);
  CHECK(error.find("Connection closed by peer") != std::string::npos, "got: ", error);
  CHECK(Clock::now() - start < std::chrono::seconds(5), "the dead peer was noticed only at the deadline");
}

// A local peer that leaves after its socket connected but before it set its
// segment's key (a rank killed just after init, whose group connects in the
// background, or one that closed its group at once): the wait for that key
// ends when the socket closes, not at the group's deadline, and the setup
// goes on without the peer, noting it as departed with its note; a local
// peer with no socket (its dial was refused) is departed from the start.
void testPeerGoneDuringSetup() {
  int pair[2];
  CHECK(::socketpair(AF_UNIX, SOCK_STREAM, 0, pair) == 0, "socketpair");
  test::MemoryStore store;
  std::thread victim([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ::close(pair[0]);
  });
  const auto start = Clock::now();
  shm::LocalLinks links =
      shm::connectLocal(store, "setup/", 7, 1, {0, 0, 0}, {pair[1], -1, -1}, shm::Mode::kAuto, shm::ReadPeers::kNever,
                        start + std::chrono::seconds(30), [](int peer) { return str("note of ", peer); });
  victim.join();
  ::close(pair[1]);
  const std::string& why = links.departed[0];
  CHECK(why.find("Connection closed by peer 0") == 0 && why.find("peer 0 had failed: note of 0") != std::string::npos,
        "got: '", why, "'");
  CHECK(links.departed[1].empty(), "this rank departed: ", links.departed[1]);
  CHECK(!links.departed[2].empty(), "a peer with no socket is not departed");
  CHECK(!links.collectives[0] && !links.collectives[2] && !links.windows[1], "links to departed peers");
  CHECK(Clock::now() - start < std::chrono::seconds(5), "the dead peer was noticed only at the deadline");
}

// A local peer that is stopped (SIGSTOP) mid-setup keeps its socket open and
// answers nothing. The group shut down meanwhile (its wake fd written) ends
// this rank's wait for the peer's status at once, not at the deadline.
void testSetupInterruptedWhilePeerSilent() {
  int pair[2];
  CHECK(::socketpair(AF_UNIX, SOCK_STREAM, 0, pair) == 0, "socketpair");
  const int wake = ::eventfd(0, EFD_CLOEXEC);
  test::MemoryStore store;
  store.set("setup/shm/0", {'-', 'x'});  // the peer's key is there; its status byte never comes
  std::thread shutdown([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const uint64_t one = 1;
    CHECK(::write(wake, &one, sizeof one) == sizeof one, "eventfd write");
  });
  const auto start = Clock::now();
  std::string error;
  try {
    shm::connectLocal(store, "setup/", 7, 1, {0, 0}, {pair[1], -1}, shm::Mode::kAuto, shm::ReadPeers::kNever,
                      start + std::chrono::seconds(30), nullptr, wake);
  } catch (const Error& e) {
    error = e.what();
  }
  shutdown.join();
  for (int fd : {pair[0], pair[1], wake}) ::close(fd);
  CHECK(error == "interrupted", "got: '", error, "'");
  CHECK(Clock::now() - start < std::chrono::seconds(5), "the shutdown was seen only at the deadline");
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

// Rank 0 times out with half of a 4 MiB message in the 1 MiB ring while
// rank 1 is not reading: the rest cannot go in within the abort's grace, so
// no abort frame can follow it. Rank 1 must still fail with rank 0's reason,
// read from the note beside the ring, not just "Connection closed by peer".
void testAbortNoteBehindHalfMessage() {
  Group g(2, over(shm::Mode::kShm));
  std::string error;
  test::runRanks(2, [&](int r) {
    tcp::Device& d = *g.devices[r];
    std::vector<char> buf(4 << 20);
    const Frame frame{OpKind::kAllToAll, DataType::kUInt8, 7, 0};
    try {
      if (r == 0) {
        d.postSend(1, frame, buf.data(), buf.size(), 1);
        waitAll(d, Clock::now() + std::chrono::milliseconds(100));
      } else {
        d.postRecv(0, frame, buf.data(), buf.size(), 1);
        std::this_thread::sleep_for(std::chrono::seconds(1));  // past rank 0's timeout and grace
        waitAll(d, Clock::now() + std::chrono::seconds(20));
      }
    } catch (const Error& e) {
      if (r == 1) error = e.what();
    }
  });
  CHECK(error.find("peer 0 failed and aborted the group") != std::string::npos &&
            error.find("Timed out") != std::string::npos,
        "got: ", error);
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
  std::optional<std::vector<uint8_t>> tryGet(const std::string& key) override { return inner_.tryGet(key); }
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
  testReadCost();
  testPeerGoneMidOp();
  testPeerGoneDuringSetup();
  testSetupInterruptedWhilePeerSilent();
  testAbortWhileSenderBlocked();
  testAbortNoteBehindHalfMessage();
  testOnePairUnlinked();
  testAttachErrors();
  testNoLeaks();
  std::printf("shm: group setup, peer gone, errors, leaks ok\n");
  return 0;
}

// Lazy connections (socket/connector.h) over loopback TCP: a group connects
// only the pairs its ops use; ranks that dial each other at the same moment
// keep one connection; a receive from any source posted before anyone
// connected gets its messages; a peer that left fails a dial at once, and
// one whose group broke first names its reason, whether it refused the dial
// or closed it unanswered; a rank's death reaches every rank waiting in a
// ring all-reduce, though each holds sockets to its two neighbours only;
// ranks whose COLLX_CONNECT differs fail at creation; a member that closes
// its group during setup fails only the ops that need it.
#include <dirent.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <future>

#include "../../csrc/core/algorithms/algorithms.h"
#include "../../csrc/core/transport/socket/connector.h"
#include "check.h"
#include "group.h"

using namespace collx;
using namespace std::chrono_literals;

namespace {

tcp::DeviceOptions lazyTcp(bool lazy = true) {
  tcp::DeviceOptions o;
  o.transport = shm::Mode::kTcp;
  o.lazy = lazy;
  return o;
}

// Runs an all-reduce of `count` int32 (rank r contributes r + 1) with `algo` on every rank; checks the sum.
void allreduceOn(test::Group& g, Algorithm algo, size_t count, uint64_t seq) {
  const int n = int(g.devices.size());
  test::runRanks(n, [&](int r) {
    Workspace ws;
    Collective c{*g.devices[r], OpKind::kAllreduce, DataType::kInt32, seq, Clock::now() + 30s, 1 << 12, 2, ws};
    std::vector<int32_t> buf(count, r + 1);
    allreduce(c, algo, buf.data(), buf.size(), cpuReduceFn(DataType::kInt32, ReduceOp::kSum));
    for (int32_t v : buf) CHECK(v == n * (n + 1) / 2, "rank ", r, " got ", v);
  });
}

int openFds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  while (d && readdir(d)) ++n;
  if (d) closedir(d);
  return n;
}

void testConnectsWhatItUses() {
  const int n = 5;
  test::Group g(n, lazyTcp());
  for (auto& d : g.devices) CHECK(d->connectedPeers() == 0, "a lazy group connected at creation");
  allreduceOn(g, Algorithm::kRing, 10007, 1);
  for (int r = 0; r < n; ++r) {
    CHECK(g.devices[r]->connectedPeers() == 2, "rank ", r, " holds ", g.devices[r]->connectedPeers(),
          " connections after a ring all-reduce, not its two neighbours'");
  }
  allreduceOn(g, Algorithm::kDirect, 1000, 2);
  for (int r = 0; r < n; ++r) CHECK(g.devices[r]->connectedPeers() == n - 1, "rank ", r, " after direct");

  test::Group eager(n, lazyTcp(false));
  for (auto& d : eager.devices) CHECK(d->connectedPeers() == n - 1, "an eager group connects every peer at creation");
  allreduceOn(eager, Algorithm::kRing, 10007, 1);
  std::printf("lazy: a ring holds 2 connections per rank, direct %d; eager holds %d\n", n - 1, n - 1);
}

// Every rank sends to and receives from every other at once (direct), on
// fresh groups: each pair dials both ways at the same moment and must keep
// one connection, which the process's open descriptors show.
void testSimultaneousDials() {
  const int n = 6;
  for (int round = 0; round < 5; ++round) {
    const int before = openFds();
    {
      test::Group g(n, lazyTcp());
      const int idle = openFds();
      allreduceOn(g, Algorithm::kDirect, 3000, 1);
      allreduceOn(g, Algorithm::kRing, 3000, 2);
      const int pairs = n * (n - 1) / 2;
      // Two ends per connection, all in this process; refused duplicates are closed.
      CHECK(openFds() - idle == 2 * pairs, "round ", round, ": ", openFds() - idle, " descriptors for ", pairs,
            " pairs");
    }
    CHECK(openFds() == before, "round ", round, ": ", openFds() - before, " descriptors left after close");
  }
  std::printf("lazy: simultaneous dials keep one connection per pair\n");
}

// A receive from any source, posted before any rank connected: the senders
// dial, and their connections reach the receiver's engine unasked.
void testAnySourceFirst() {
  const int n = 4;
  test::Group g(n, lazyTcp());
  std::vector<std::vector<float>> got(n - 1, std::vector<float>(100));
  std::vector<std::promise<int>> sources(n - 1);
  for (int i = 0; i < n - 1; ++i) {
    g.devices[0]->p2p().postRecv(kAnySource, 7, {got[size_t(i)].data(), 400, DataType::kFloat32}, Clock::now() + 30s,
                                 [&, i](int src, std::exception_ptr e) { sources[size_t(i)].set_value(e ? -1 : src); });
  }
  test::runRanks(n - 1, [&](int i) {
    const int r = i + 1;
    std::vector<float> data(100, float(r));
    std::promise<bool> sent;
    g.devices[r]->p2p().postSend(0, 7, {data.data(), 400, DataType::kFloat32}, Clock::now() + 30s,
                                 [&](int, std::exception_ptr e) { sent.set_value(!e); });
    CHECK(sent.get_future().get(), "rank ", r, "'s send failed");
  });
  std::vector<bool> seen(n);
  for (int i = 0; i < n - 1; ++i) {
    auto f = sources[size_t(i)].get_future();
    CHECK(f.wait_for(30s) == std::future_status::ready, "receive ", i, " pending");
    const int src = f.get();
    CHECK(src > 0 && src < n && !seen[size_t(src)], "receive ", i, " from ", src);
    seen[size_t(src)] = true;
    CHECK(got[size_t(i)][99] == float(src), "receive ", i, " holds ", got[size_t(i)][99], " from ", src);
  }
  std::printf("lazy: a receive from any source gets the senders' new connections\n");
}

// A p2p op's callback that sets `why` to the op's error ("" if it succeeded).
P2PDone whyInto(std::promise<std::string>& why) {
  return [&why](int, std::exception_ptr e) {
    std::string text;
    try {
      if (e) std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      text = ex.what();
    }
    why.set_value(text);
  };
}

// The error of a p2p send from `from` to peer `to` ("" if it succeeded).
std::string sendError(tcp::Device& from, int to) {
  std::promise<std::string> failed;
  std::vector<float> data(10);
  from.p2p().postSend(to, 1, {data.data(), 40, DataType::kFloat32}, Clock::now() + 30s, whyInto(failed));
  return failed.get_future().get();
}

// Each error of a direct all-reduce run by ranks 0 .. ranks-1 alone ("" where it succeeded).
std::vector<std::string> directAllreduceErrors(const std::vector<std::unique_ptr<tcp::Device>>& devices, int ranks) {
  std::vector<std::string> errors(static_cast<size_t>(ranks));
  test::runRanks(ranks, [&](int r) {
    Workspace ws;
    Collective c{*devices[r], OpKind::kAllreduce, DataType::kInt32, 1, Clock::now() + 30s, 1 << 12, 2, ws};
    std::vector<int32_t> buf(100, 1);
    try {
      allreduce(c, Algorithm::kDirect, buf.data(), buf.size(), cpuReduceFn(DataType::kInt32, ReduceOp::kSum));
    } catch (const Error& e) {
      errors[size_t(r)] = e.what();
    }
  });
  return errors;
}

// A peer that closed its group: a dial to it fails at once, naming it.
void testPeerGone() {
  const int n = 3;
  test::Group g(n, lazyTcp());
  g.devices[2]->close();
  const auto start = Clock::now();
  const std::string why = sendError(*g.devices[0], 2);
  CHECK(why.find("Connection closed by peer 2") != std::string::npos, "p2p: '", why, "'");
  const std::string collective = directAllreduceErrors(g.devices, 2)[0];
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
  CHECK(!collective.empty(), "an all-reduce with a departed rank succeeded");
  CHECK(ms < 5000, "failing took ", ms, " ms");
  std::printf("lazy: a departed peer fails dials at once (%lld ms): %s\n", (long long)ms, collective.c_str());
}

// A member that closes its group while the group is still being set up
// (torchft's tests shut a rank's group down right after creating it) fails
// only the ops that need it: the others finish their setup without it,
// send and receive among themselves, and a collective fails at once with
// "peer 2 closed its group". Over shared memory (its peers dial it at
// setup) and over eager TCP.
void testMemberClosedDuringSetup(shm::Mode mode, bool lazy) {
  const int n = 3, leaver = 2;
  auto store = std::make_shared<test::MemoryStore>();
  tcp::DeviceOptions options = test::over(mode);
  options.lazy = lazy;
  options.notes = store;
  std::vector<std::unique_ptr<tcp::Device>> devices(n);
  std::string leaverError;
  test::runRanks(n, [&](int r) {
    tcp::DeviceOptions o = options;
    int closing = -1;
    if (r == leaver) {  // shut down before its setup connected: the wake fd is set
      closing = ::eventfd(1, EFD_CLOEXEC);
      o.wakeFd = closing;
    }
    try {
      devices[r] = std::make_unique<tcp::Device>(*store, r, n, o);
    } catch (const Error& e) {
      leaverError = e.what();
    }
    if (closing >= 0) ::close(closing);
  });
  CHECK(!devices[leaver], "the closed member's setup succeeded");
  // Its peers on the host dial it at setup and see it leave; an eager TCP
  // peer may have connected before it left, and sees the close at its op.
  const bool local = mode != shm::Mode::kTcp;
  CHECK(!local || (devices[0]->departedPeers() == 1 && devices[1]->departedPeers() == 1), "departed: ",
        devices[0]->departedPeers(), " and ", devices[1]->departedPeers());
  // Send and receive between the others.
  std::vector<float> sent(100, 7.0f), got(100, 0.0f);
  std::promise<std::string> sendDone, recvDone;
  devices[1]->p2p().postRecv(0, 5, {got.data(), 400, DataType::kFloat32}, Clock::now() + 30s, whyInto(recvDone));
  devices[0]->p2p().postSend(1, 5, {sent.data(), 400, DataType::kFloat32}, Clock::now() + 30s, whyInto(sendDone));
  const std::string sendWhy = sendDone.get_future().get(), recvWhy = recvDone.get_future().get();
  CHECK(sendWhy.empty() && recvWhy.empty(), "send: '", sendWhy, "', recv: '", recvWhy, "'");
  CHECK(got == sent, "the received values differ");
  // Its own ops fail, naming it, at once.
  const auto start = Clock::now();
  if (local) {
    const std::string p2p = sendError(*devices[0], leaver);
    CHECK(p2p.find("peer 2 closed its group") != std::string::npos, "p2p: '", p2p, "'");
  }
  const auto errors = directAllreduceErrors(devices, 2);
  for (int r = 0; r < 2; ++r) {
    CHECK(errors[size_t(r)].find("peer 2 closed its group") != std::string::npos, "rank ", r, "'s all-reduce: '",
          errors[size_t(r)], "'");
  }
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
  CHECK(ms < 5000, "failing took ", ms, " ms");
}

// A rank whose group broke and closed before a peer ever dialed it leaves
// its reason in the Store: the peer's refused dial names it, for p2p and
// for collectives alike, where without the note it could only say that the
// peer left.
void testDepartedPeerLeavesItsReason() {
  const int n = 3;
  auto store = std::make_shared<test::MemoryStore>();
  tcp::DeviceOptions options = lazyTcp();
  options.notes = store;
  std::vector<std::unique_ptr<tcp::Device>> devices(n);
  test::runRanks(n, [&](int r) { devices[r] = std::make_unique<tcp::Device>(*store, r, n, options); });
  const std::string reason = "collx rank 2: Connection closed by peer 7 (the first cause)";
  devices[2]->abort(reason);
  devices[2]->close();
  const std::string p2p = sendError(*devices[0], 2);
  CHECK(p2p.find("Connection closed by peer 2") != std::string::npos, "p2p: '", p2p, "'");
  CHECK(p2p.find("peer 2 had failed: " + reason) != std::string::npos, "p2p lacks the note: '", p2p, "'");
  const std::string collective = directAllreduceErrors(devices, 2)[1];
  CHECK(collective.find("had failed: " + reason) != std::string::npos, "all-reduce lacks the note: '", collective,
        "'");
}

// A peer that fails while this rank's dial sits in its listener's queue
// closes the connection unanswered (closing a listener resets what it never
// accepted): the dial names the peer's note, as a refused one does. Here
// the "peer" is a bare listener that takes the hello and closes.
void testUnansweredDialReadsTheNote() {
  auto store = std::make_shared<test::MemoryStore>();
  tcp::Directory dir;
  dir.size = 2;
  dir.prefix = "unanswered/";
  dir.connect = "lazy";
  tcp::Address mine = tcp::Address::parse("127.0.0.1:0"), peer = tcp::Address::parse("127.0.0.1:0");
  dir.listener = tcp::listenOn(mine);
  tcp::Socket peerListener = tcp::listenOn(peer);
  dir.addrs = {mine, peer};
  dir.hosts = {0, 0};
  tcp::Connector connector(0, std::move(dir), "");
  connector.setNotes(store);
  const std::string reason = "collx rank 1: Connection closed by peer 7 (the first cause)";
  std::thread fake([&] {
    pollfd p{peerListener.fd(), POLLIN, 0};
    CHECK(::poll(&p, 1, 10000) == 1, "the dial never reached the listener");
    tcp::Socket s(::accept(peerListener.fd(), nullptr, nullptr));
    char hello[64];
    CHECK(::recv(s.fd(), hello, sizeof(hello), 0) > 0, "no hello");
    store->set("unanswered/left/1", std::vector<uint8_t>(reason.begin(), reason.end()));
  });  // `s` closes here, unanswered
  std::string why;
  try {
    connector.take(1, tcp::kCollectives, Clock::now() + 30s);
  } catch (const PeerClosedError& e) {
    why = e.what();
  }
  fake.join();
  CHECK(why.find("Connection closed by peer 1") != std::string::npos, "the dial: '", why, "'");
  CHECK(why.find("peer 1 had failed: " + reason) != std::string::npos, "the dial lacks the note: '", why, "'");
}

// A ring all-reduce on n ranks, each connected to its two neighbours only;
// one rank's connections close mid-op (a killed process's do): every other
// rank fails within seconds, the news travelling along the ring.
void testDeathReachesEveryRank() {
  const int n = 8, victim = 3;
  test::Group g(n, lazyTcp());
  allreduceOn(g, Algorithm::kRing, 1000, 1);
  std::vector<int64_t> failedMs(n, -1);
  const auto start = Clock::now();
  test::runRanks(n, [&](int r) {
    if (r == victim) {
      std::this_thread::sleep_for(100ms);
      g.devices[r]->close();
      return;
    }
    Workspace ws;
    Collective c{*g.devices[r], OpKind::kAllreduce, DataType::kInt32, 2, Clock::now() + 60s, 1 << 12, 2, ws};
    std::vector<int32_t> buf(1000, 1);
    try {
      allreduce(c, Algorithm::kRing, buf.data(), buf.size(), cpuReduceFn(DataType::kInt32, ReduceOp::kSum));
    } catch (const Error&) {
      failedMs[size_t(r)] = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
    }
  });
  int64_t worst = 0;
  for (int r = 0; r < n; ++r) {
    if (r == victim) continue;
    CHECK(failedMs[size_t(r)] >= 0, "rank ", r, " finished an all-reduce its peer left");
    worst = std::max(worst, failedMs[size_t(r)]);
  }
  CHECK(worst < 5000, "the last rank failed after ", worst, " ms");
  std::printf("lazy: a death mid-ring reached all %d ranks in %lld ms\n", n - 1, (long long)worst);
}

// Ranks that connect differently fail at creation, every one of them,
// naming the setting: an eager rank would wait for lazy peers that never dial.
void testModesMustAgree() {
  const int n = 3;
  test::MemoryStore store;
  std::vector<std::string> errors(n);
  test::runRanks(n, [&](int r) {
    try {
      tcp::Device d(store, r, n, lazyTcp(r != 2));
    } catch (const Error& e) {
      errors[size_t(r)] = e.what();
    }
  });
  for (int r = 0; r < n; ++r) {
    CHECK(errors[size_t(r)].find("COLLX_CONNECT") != std::string::npos, "rank ", r, ": '", errors[size_t(r)], "'");
  }
  std::printf("lazy: mixed modes fail at creation: %s\n", errors[0].c_str());
}

}  // namespace

int main() {
  testMemberClosedDuringSetup(shm::Mode::kAuto, true);
  testMemberClosedDuringSetup(shm::Mode::kTcp, false);
  testDepartedPeerLeavesItsReason();
  testUnansweredDialReadsTheNote();
  testModesMustAgree();
  testConnectsWhatItUses();
  testSimultaneousDials();
  testAnySourceFirst();
  testPeerGone();
  testDeathReachesEveryRank();
  std::printf("test_lazy: ok\n");
}

// Asynchronous point-to-point (transport/p2p.h) over real loopback TCP: N
// threads, one Device each. Ring shifts with every receive posted before
// any send, tags that match independently, receives from any source,
// mismatches caught before the buffer is written, timeouts, dead peers,
// close with receives pending, and p2p interleaved with collectives.
#include <condition_variable>
#include <cstring>
#include <mutex>

#include "../../csrc/core/algorithms/algorithms.h"
#include "check.h"
#include "group.h"

using namespace collx;

namespace {

// The transport every test below runs over; main() runs them all over both.
shm::Mode gTransport = shm::Mode::kShm;
tcp::DeviceOptions over() {
  tcp::DeviceOptions o;
  o.transport = gTransport;
  return o;
}

using test::Group;
using namespace std::chrono_literals;

// One op's outcome, filled by its P2PDone callback.
struct Outcome {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  int source = -1;
  std::string error;

  P2PDone callback() {
    return [this](int src, std::exception_ptr e) {
      std::lock_guard<std::mutex> lock(mu);
      source = src;
      if (e) {
        try {
          std::rethrow_exception(e);
        } catch (const std::exception& ex) {
          error = ex.what();
        }
      }
      done = true;
      cv.notify_all();
    };
  }
  bool finished() {
    std::lock_guard<std::mutex> lock(mu);
    return done;
  }
  // Waits up to `limit`; false if still pending.
  bool wait(std::chrono::milliseconds limit = 30s) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, limit, [&] { return done; });
  }
  void expectOk(const std::string& what) {
    CHECK(wait(), what, ": still pending after 30 s");
    CHECK(error.empty(), what, ": ", error);
  }
  void expectError(const std::string& what, const std::string& needle) {
    CHECK(wait(), what, ": still pending after 30 s");
    CHECK(error.find(needle) != std::string::npos, what, ": error '", error, "' lacks '", needle, "'");
  }
};

Deadline within(std::chrono::milliseconds ms) { return Clock::now() + ms; }
P2PBuffer floats(std::vector<float>& v) { return {v.data(), v.size() * sizeof(float), DataType::kFloat32}; }
float valueOf(int r, size_t i) { return float(r * 1000 + int(i % 997)); }

// irecv(prev); isend(next); wait both -- the user code that must not hang.
// Large messages go by request and clearance, whose steps may fall to the
// spinning waiter or to the progress thread, in any mix.
void testRingShift(int n, size_t count) {
  Group g(n, over());
  test::runRanks(n, [&](int r) {
    auto& p2p = g.devices[r]->p2p();
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    std::vector<float> in(count, -1.0f), out(count);
    for (size_t i = 0; i < count; ++i) out[i] = valueOf(r, i);
    Outcome recv, send;
    p2p.postRecv(prev, 0, floats(in), within(30s), recv.callback());
    p2p.postSend(next, 0, floats(out), within(30s), send.callback());
    // As a Work's wait() does: this thread drives the channel for a while,
    // then leaves the rest to the progress thread.
    p2p.spin([&] { return recv.finished() && send.finished(); }, std::chrono::microseconds(250));
    recv.expectOk(str("ring shift recv n=", n, " count=", count));
    send.expectOk(str("ring shift send n=", n, " count=", count));
    CHECK(recv.source == prev, "source ", recv.source);
    for (size_t i = 0; i < count; ++i) CHECK(in[i] == valueOf(prev, i), "n=", n, " count=", count, " i=", i);
  });
}

// Rank 0 sends tag 1 then tag 2; rank 1 waits for tag 2 before it even posts
// tag 1's receive. Also: three messages with one tag arrive in order.
void testTags(size_t count) {
  Group g(2, over());
  test::runRanks(2, [&](int r) {
    auto& p2p = g.devices[r]->p2p();
    std::vector<std::vector<float>> bufs(5, std::vector<float>(count));
    if (r == 0) {
      Outcome s[5];
      for (int k = 0; k < 5; ++k) {
        std::fill(bufs[k].begin(), bufs[k].end(), float(k + 1));
        p2p.postSend(1, k < 2 ? uint32_t(k + 1) : 9, floats(bufs[k]), within(30s), s[k].callback());
      }
      for (auto& o : s) o.expectOk("tagged send");
      return;
    }
    Outcome second, first;
    p2p.postRecv(0, 2, floats(bufs[1]), within(30s), second.callback());
    second.expectOk(str("tag 2 before tag 1, count=", count));
    p2p.postRecv(0, 1, floats(bufs[0]), within(30s), first.callback());
    first.expectOk("tag 1");
    CHECK(count == 0 || (bufs[0][0] == 1.0f && bufs[1][count - 1] == 2.0f), "tags crossed");
    Outcome same[3];
    for (int k = 2; k < 5; ++k) p2p.postRecv(0, 9, floats(bufs[k]), within(30s), same[k - 2].callback());
    for (int k = 2; k < 5; ++k) {
      same[k - 2].expectOk("same tag");
      CHECK(count == 0 || bufs[k][count / 2] == float(k + 1), "same-tag messages out of order at ", k);
    }
  });
}

// Every other rank sends to rank 0, which posts receives from any source.
void testAnySource(int n, size_t count) {
  Group g(n, over());
  test::runRanks(n, [&](int r) {
    auto& p2p = g.devices[r]->p2p();
    if (r != 0) {
      std::vector<float> out(count, float(r));
      Outcome s;
      p2p.postSend(0, 7, floats(out), within(30s), s.callback());
      s.expectOk("send to any-source receiver");
      return;
    }
    std::vector<std::vector<float>> bufs(size_t(n), std::vector<float>(count, -1.0f));
    std::vector<Outcome> outs(static_cast<size_t>(n));
    for (int k = 1; k < n; ++k) p2p.postRecv(kAnySource, 7, floats(bufs[k]), within(30s), outs[k].callback());
    std::vector<bool> seen(static_cast<size_t>(n));
    for (int k = 1; k < n; ++k) {
      outs[k].expectOk("any-source recv");
      const int src = outs[k].source;
      CHECK(src > 0 && src < n && !seen[src], "bad or repeated source ", src);
      seen[src] = true;
      CHECK(count == 0 || bufs[k][count - 1] == float(src), "data of ", src, " landed wrong");
    }
  });
}

// A size mismatch fails the receive without writing to it (and, for a large
// send, fails the sender with the reason); the pair stays usable.
void testMismatch(size_t count) {
  Group g(2, over());
  test::runRanks(2, [&](int r) {
    auto& p2p = g.devices[r]->p2p();
    std::vector<float> buf(count, 5.0f), wrong(count + 3, -7.0f);
    Outcome a, b;
    if (r == 0) {
      p2p.postSend(1, 4, floats(buf), within(30s), a.callback());
      if (count > tcp::P2PEngine::kEagerBytes / sizeof(float)) {
        a.expectError("refused large send", "refused");
      } else {
        a.expectOk("small send");
      }
      p2p.postSend(1, 4, floats(buf), within(30s), b.callback());
      b.expectOk("send after mismatch");
    } else {
      p2p.postRecv(0, 4, floats(wrong), within(30s), a.callback());
      a.expectError("mismatched recv", "mismatched send/recv with peer 0");
      for (float v : wrong) CHECK(v == -7.0f, "mismatched recv wrote to its buffer");
      std::vector<float> right(count);
      p2p.postRecv(0, 4, floats(right), within(30s), b.callback());
      b.expectOk("recv after mismatch");
      CHECK(count == 0 || right[0] == 5.0f, "recv after mismatch got wrong data");
    }
  });
}

void testTimeoutAndClose() {
  Group g(2, over());
  test::runRanks(2, [&](int r) {
    auto& p2p = g.devices[r]->p2p();
    std::vector<float> buf(100000);
    if (r == 0) {
      Outcome t;
      auto start = Clock::now();
      p2p.postRecv(1, 3, floats(buf), within(200ms), t.callback());
      t.expectError("recv timeout", "Timed out after 200 ms in recv from peer 1 with tag 3");
      CHECK(Clock::now() - start < 5s, "timeout came late");
      Outcome large;
      p2p.postSend(1, 3, floats(buf), within(200ms), large.callback());  // never received: withdrawn
      large.expectError("large send timeout", "Timed out");
    }
    g.store.add("timeouts-done", 1);
    while (g.store.add("timeouts-done", 0) < 2) std::this_thread::sleep_for(1ms);
    if (r == 1) {
      // Unmatched receives at close fail at once with the reason.
      Outcome pending[3];
      for (auto& o : pending) p2p.postRecv(0, 11, floats(buf), within(60s), o.callback());
      auto start = Clock::now();
      g.devices[1]->close();
      for (auto& o : pending) o.expectError("recv pending at close", "shut down");
      CHECK(Clock::now() - start < 2s, "close took too long");
    } else {
      // The peer closed: a pending receive from it fails promptly.
      Outcome dead;
      p2p.postRecv(1, 12, floats(buf), within(60s), dead.callback());
      dead.expectError("recv from a closed peer", "Connection closed by peer");
      Outcome later;
      p2p.postSend(1, 12, floats(buf), within(60s), later.callback());
      later.expectError("send to a closed peer", "Connection closed by peer");
    }
  });
}

// A message that fully arrived before its sender left is still received,
// even when the receive is posted after the connection closed.
void testReceiveAfterSenderLeft() {
  Group g(2, over());
  test::runRanks(2, [&](int r) {
    auto& p2p = g.devices[r]->p2p();
    std::vector<float> buf(10, float(r + 1));
    if (r == 1) {
      Outcome s;
      p2p.postSend(0, 6, floats(buf), within(30s), s.callback());
      s.expectOk("send before leaving");
      g.devices[1]->close();
      return;
    }
    Outcome probe;  // fails once this rank has seen the connection close
    std::vector<float> other(3);
    p2p.postRecv(1, 99, floats(other), within(30s), probe.callback());
    probe.expectError("recv from a peer that left", "Connection closed by peer");
    Outcome late;
    p2p.postRecv(1, 6, floats(buf), within(30s), late.callback());
    late.expectOk("recv of a message that arrived before its sender left");
    CHECK(buf[9] == 2.0f, "wrong data ", buf[9]);
  });
}

// A posted, unmatched receive holds back neither collectives nor sends.
void testWithCollectives(int n) {
  Group g(n, over());
  test::runRanks(n, [&](int r) {
    auto& p2p = g.devices[r]->p2p();
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    std::vector<float> in(1 << 20, 0.0f), out(1 << 20, float(r));
    Outcome recv, send;
    p2p.postRecv(prev, 1, floats(in), within(30s), recv.callback());
    Workspace ws;
    for (uint64_t seq = 1; seq <= 3; ++seq) {
      std::vector<float> x(1000, 1.0f);
      Collective c{*g.devices[r], OpKind::kAllreduce, DataType::kFloat32, seq, within(30s), 512 << 10, 2, ws};
      allreduce(c, Algorithm::kRing, x.data(), x.size(), cpuReduceFn(DataType::kFloat32, ReduceOp::kSum));
      CHECK(x[999] == float(n), "all-reduce beside p2p");
    }
    p2p.postSend(next, 1, floats(out), within(30s), send.callback());
    recv.expectOk("recv posted before the collectives");
    send.expectOk("send after the collectives");
    CHECK(in[12345] == float(prev), "p2p data beside collectives");
  });
}

}  // namespace

int main() {
  for (shm::Mode transport : {shm::Mode::kShm, shm::Mode::kTcp}) {
    gTransport = transport;
    for (int n : {2, 3, 4}) {
      for (size_t count : {size_t(0), size_t(1), size_t(1000), size_t(100003), size_t(4) << 20}) testRingShift(n, count);
    }
    for (size_t count : {size_t(0), size_t(7), size_t(100003)}) {
      testTags(count);
      testMismatch(count);
    }
    for (int n : {2, 4}) {
      testAnySource(n, 5);
      testAnySource(n, 70000);
    }
    testTimeoutAndClose();
    testReceiveAfterSenderLeft();
    for (int n : {2, 3}) testWithCollectives(n);
    std::printf("test_p2p: all passed over %s\n", shm::name(transport));
  }
  return 0;
}

#include "rendezvous.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>
#include <string>

#include "../../error.h"
#include "wire.h"

namespace collx::tcp {

namespace {

std::vector<uint8_t> bytesOf(const std::string& s) { return {s.begin(), s.end()}; }
std::string stringOf(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

uint64_t randomToken() {
  std::random_device rd;
  return (uint64_t(rd()) << 32) ^ rd();
}

// How long one accepted connection may take to say hello before we drop it.
constexpr auto kHelloTimeout = std::chrono::seconds(10);
// Connections still saying hello at once; beyond that the oldest is dropped.
constexpr size_t kMaxPending = 64;

// An accepted connection whose hello has not fully arrived.
struct Pending {
  Socket socket;
  Hello hello{};
  size_t got = 0;
  Deadline until;
};

// Accepts until `missing` connections from higher ranks have said hello, reading every
// accepted connection at once: a stranger that stays silent or sends half a
// hello holds up nobody; it is dropped after kHelloTimeout, as is anything
// that is not our hello (wrong magic, token, generation, rank; garbage).
void acceptPeers(const Socket& listener, std::vector<Socket>* sockets, int rank, int size, uint64_t generation,
                 uint64_t token, int missing, Deadline deadline, std::chrono::milliseconds timeout) {
  std::vector<Pending> pending;
  std::vector<pollfd> fds;
  while (missing > 0) {
    const Deadline now = Clock::now();
    if (now >= deadline) {
      throw TimeoutError(str("collx rank ", rank, ": Timed out after ", timeout.count(), " ms waiting for ", missing,
                             " connection(s) from higher ranks"));
    }
    pending.erase(std::remove_if(pending.begin(), pending.end(), [&](const Pending& p) { return p.until <= now; }),
                  pending.end());
    Deadline wake = deadline;
    fds.assign(1, pollfd{listener.fd(), POLLIN, 0});
    for (const auto& p : pending) {
      fds.push_back({p.socket.fd(), POLLIN, 0});
      wake = std::min(wake, p.until);
    }
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(wake - now).count() + 1;
    if (::poll(fds.data(), fds.size(), int(std::min<int64_t>(ms, 1 << 30))) < 0 && errno != EINTR) {
      throw Error(str("collx rank ", rank, ": poll failed while accepting peers: ", strerror(errno)));
    }
    // Read what arrived; a hello completes a peer, anything else drops the connection.
    std::vector<Pending> still;
    for (size_t i = 0; i < pending.size(); ++i) {
      Pending& p = pending[i];
      if (fds[i + 1].revents) {
        ssize_t rc = ::recv(p.socket.fd(), reinterpret_cast<char*>(&p.hello) + p.got, sizeof(Hello) - p.got,
                            MSG_DONTWAIT);
        if (rc == 0 || (rc < 0 && errno != EINTR && errno != EAGAIN)) continue;  // closed: drop
        if (rc > 0) p.got += size_t(rc);
      }
      if (p.got < sizeof(Hello)) {
        still.push_back(std::move(p));
        continue;
      }
      const Hello& h = p.hello;
      bool ours = h.magic == kHelloMagic && h.token == token && h.generation == generation && h.size == size &&
                  h.rank > rank && h.rank < size && h.channel < kChannels &&
                  !sockets[h.channel][h.rank].valid();
      if (!ours) continue;  // a stranger or a stale peer: drop it
      sockets[h.channel][h.rank] = std::move(p.socket);
      --missing;
    }
    pending.swap(still);
    if (fds[0].revents & POLLIN) {
      int fd = ::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) {
        if (pending.size() >= kMaxPending) pending.erase(pending.begin());
        pending.push_back(Pending{Socket(fd), Hello{}, 0, Clock::now() + kHelloTimeout});
      } else if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED) {
        throw Error(str("collx rank ", rank, ": accept failed: ", strerror(errno)));
      }
    }
  }
}

}  // namespace

Mesh connectMesh(Store& store, int rank, int size, const std::string& ifname, int family,
                 std::chrono::milliseconds timeout, const std::string& localCongestion) {
  Mesh mesh;
  for (auto& channel : mesh.sockets) channel.resize(size);
  if (size == 1) {
    mesh.hosts = {0};
    return mesh;
  }
  const Deadline deadline = Clock::now() + timeout;

  const uint64_t generation = uint64_t(store.add("collx/generation", 1) - 1) / uint64_t(size);
  const std::string prefix = str("collx/", generation, "/");
  mesh.prefix = prefix;

  uint64_t token;
  if (rank == 0) {
    token = randomToken();
    store.set(prefix + "token", bytesOf(std::to_string(token)));
  } else {
    token = std::stoull(stringOf(store.get(prefix + "token", timeout)));
  }
  mesh.token = token;

  Address self = chooseAddress(ifname, family);
  Socket listener = listenOn(self);
  mesh.address = self.str();
  store.set(prefix + "addr/" + std::to_string(rank), bytesOf(mesh.address));

  std::vector<Address> addrs(size);
  std::vector<std::string> hostNames;  // by host index
  for (int peer = 0; peer < size; ++peer) {
    if (peer != rank) {
      addrs[peer] = Address::parse(stringOf(store.get(prefix + "addr/" + std::to_string(peer), timeout)));
    }
    const std::string host = peer == rank ? self.host() : addrs[peer].host();
    auto it = std::find(hostNames.begin(), hostNames.end(), host);
    mesh.hosts.push_back(int(it - hostNames.begin()));
    if (it == hostNames.end()) hostNames.push_back(host);
  }

  for (int peer = 0; peer < rank; ++peer) {
    for (uint32_t channel = 0; channel < kChannels; ++channel) {
      const Hello mine{kHelloMagic, rank, size, channel, generation, token};
      const Address& addr = addrs[peer];
      Socket s = connectTo(addr, deadline);
      COLLX_CHECK(writeAll(s, &mine, sizeof(mine), deadline), "collx rank ", rank,
                  ": could not send hello to peer ", peer, " at ", addr.str());
      mesh.sockets[channel][peer] = std::move(s);
    }
  }

  listener.setNonBlocking(true);  // accept4 must not block on a connection reset before it
  acceptPeers(listener, mesh.sockets, rank, size, generation, token, (size - 1 - rank) * int(kChannels), deadline,
              timeout);
  // Between ranks on one host nothing congests, and a pacing congestion
  // control (BBR, the default on some systems) spaces every burst at its own
  // estimate of the link, an estimate each connection makes apart: at n=2 a
  // 256 KiB direct all-reduce took 170 us under bbr and 103 us under reno,
  // and under bbr some groups ran 1.7x slower than others doing the same.
  // Reno, which does not pace and which every kernel allows, is used there
  // by default (COLLX_TCP_CONGESTION). Across hosts the system's choice stands.
  //
  // The send buffer is fixed there too: autotuning grows it for large ops
  // (to 4 MiB) and never shrinks it, and a grown one slowed the group's later
  // ops (n=2, ring, 1 MiB: 1.3x after five 64 MiB all-reduces,
  // benchmarks/group_history.py; 64 MiB itself ran 1.37x faster capped).
  constexpr int kLocalSendBuffer = 256 << 10;  // the kernel doubles it
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank || mesh.hosts[size_t(peer)] != mesh.hosts[size_t(rank)]) continue;
    for (auto& channel : mesh.sockets) {
      channel[size_t(peer)].setSendBuffer(kLocalSendBuffer);
      COLLX_CHECK(localCongestion.empty() || channel[size_t(peer)].setCongestionControl(localCongestion.c_str()),
                  "collx rank ", rank, ": the kernel refuses congestion control '", localCongestion,
                  "' (COLLX_TCP_CONGESTION): ", strerror(errno));
    }
  }
  return mesh;  // the listener closes here: nobody can connect any more
}

}  // namespace collx::tcp

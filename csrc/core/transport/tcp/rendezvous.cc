#include "rendezvous.h"

#include <algorithm>
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

}  // namespace

Mesh connectMesh(Store& store, int rank, int size, const std::string& ifname,
                 std::chrono::milliseconds timeout) {
  Mesh mesh;
  mesh.sockets.resize(size);
  std::vector<Socket>& sockets = mesh.sockets;
  if (size == 1) {
    mesh.hosts = {0};
    return mesh;
  }
  const Deadline deadline = Clock::now() + timeout;

  const uint64_t generation = uint64_t(store.add("collx/generation", 1) - 1) / uint64_t(size);
  const std::string prefix = str("collx/", generation, "/");

  uint64_t token;
  if (rank == 0) {
    token = randomToken();
    store.set(prefix + "token", bytesOf(std::to_string(token)));
  } else {
    token = std::stoull(stringOf(store.get(prefix + "token", timeout)));
  }

  Address self = chooseAddress(ifname);
  Socket listener = listenOn(self);
  store.set(prefix + "addr/" + std::to_string(rank), bytesOf(self.str()));

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
    if (peer != rank && host == self.host()) ++mesh.localRanks;
  }

  const Hello mine{kHelloMagic, rank, size, 0, generation, token};
  for (int peer = 0; peer < rank; ++peer) {
    const Address& addr = addrs[peer];
    Socket s = connectTo(addr, deadline);
    COLLX_CHECK(writeAll(s, &mine, sizeof(mine), deadline), "collx rank ", rank,
                ": could not send hello to peer ", peer, " at ", addr.str());
    sockets[peer] = std::move(s);
  }

  int missing = size - 1 - rank;
  while (missing > 0) {
    Socket s;
    try {
      s = acceptFrom(listener, deadline);
    } catch (const TimeoutError&) {
      throw TimeoutError(str("collx rank ", rank, ": timed out after ", timeout.count(),
                             " ms waiting for ", missing, " higher rank(s) to connect"));
    }
    Hello h{};
    auto helloDeadline = std::min(deadline, Deadline(Clock::now() + kHelloTimeout));
    if (!readAll(s, &h, sizeof(h), helloDeadline)) continue;
    bool ours = h.magic == kHelloMagic && h.token == token && h.generation == generation &&
                h.size == size && h.rank > rank && h.rank < size && !sockets[h.rank].valid();
    if (!ours) continue;  // a stranger or a stale peer: drop it
    sockets[h.rank] = std::move(s);
    --missing;
  }
  return mesh;
}

}  // namespace collx::tcp

#include "rendezvous.h"

#include <algorithm>
#include <optional>
#include <random>
#include <sstream>
#include <string>

#include "../../error.h"
#include "connector.h"

namespace collx::tcp {

namespace {

std::vector<uint8_t> bytesOf(const std::string& s) { return {s.begin(), s.end()}; }
std::string stringOf(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

uint64_t randomToken() {
  std::random_device rd;
  return (uint64_t(rd()) << 32) ^ rd();
}

// How long a rank waits for the table between checks that rank 0 lives.
constexpr auto kRelayCheck = std::chrono::milliseconds(1000);

// Rank 0 relays the table: had it died after announcing itself, the others
// would wait for the table until their timeout. So every kRelayCheck they
// dial its listener, whose address it set before it could die: a refused
// dial fails the wait at once. A rank 0 that never announced itself never
// came, and the wait runs to the timeout.
std::string awaitTable(Store& store, const Directory& dir, std::chrono::milliseconds timeout) {
  const Deadline end = Clock::now() + timeout;
  std::optional<Address> relay;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now());
    try {
      return stringOf(store.get(dir.prefix + "table", std::clamp(left, std::chrono::milliseconds(0), kRelayCheck)));
    } catch (const TimeoutError&) {
      if (left <= kRelayCheck) {
        throw TimeoutError(str("collx rank ", dir.rank, ": timed out after ", timeout.count(),
                               " ms waiting in the Store for ", dir.prefix,
                               "table (a rank of the group never created it?)"));
      }
    }
    if (!relay) {
      if (auto record = store.tryGet(dir.prefix + "addr/0")) {
        const std::string line = stringOf(*record);
        relay = Address::parse(line.substr(0, line.find_first_of("@ ")));
      }
    }
    if (!relay) continue;
    try {
      connectTo(*relay, Clock::now() + kRelayCheck, /*retryRefused=*/false);
    } catch (const TimeoutError&) {  // alive but busy: the wait goes on
    } catch (const Error& e) {
      throw PeerClosedError(str("Connection closed by peer 0 (collx rank ", dir.rank,
                                " waited for the group's table, which rank 0 relays, and rank 0 is gone: ", e.what(),
                                ")"));
    }
  }
}

}  // namespace

Directory announce(Store& store, int rank, int size, const std::string& ifname, int family,
                   const std::string& hostLabel, const std::string& connect) {
  Directory dir;
  dir.rank = rank;
  dir.size = size;
  dir.connect = connect;
  if (size == 1) {
    dir.hosts = {0};
    return dir;
  }
  dir.generation = uint64_t(store.add("collx/generation", 1) - 1) / uint64_t(size);
  dir.prefix = str("collx/", dir.generation, "/");

  Address self = chooseAddress(ifname, family);
  dir.listener = listenOn(self);
  dir.listener.setNonBlocking(true);  // accept4 must not block on a connection reset before it
  dir.address = self.str();
  const std::string record = (hostLabel.empty() ? dir.address : dir.address + "@" + hostLabel) + " " + connect;
  store.set(dir.prefix + "addr/" + std::to_string(rank), bytesOf(record));
  return dir;
}

void readTable(Store& store, Directory& dir, std::chrono::milliseconds timeout) {
  if (dir.size == 1) return;
  const int rank = dir.rank;
  // The table: the token, then one record per rank, a line each.
  std::string table;
  if (rank == 0) {
    std::vector<std::string> keys;
    for (int r = 0; r < dir.size; ++r) keys.push_back(dir.prefix + "addr/" + std::to_string(r));
    table = std::to_string(randomToken()) + "\n";
    for (const auto& v : store.getMany(keys, timeout)) table += stringOf(v) + "\n";
    store.set(dir.prefix + "table", bytesOf(table));
  } else {
    table = awaitTable(store, dir, timeout);
  }
  std::istringstream lines(table);
  std::string line;
  std::getline(lines, line);
  dir.token = std::stoull(line);
  std::vector<std::string> hostNames;  // by host index
  while (std::getline(lines, line)) {
    const size_t space = line.find(' ');
    const std::string theirs = line.substr(space + 1);
    COLLX_CHECK(theirs == dir.connect, "collx rank ", rank, ": the ranks connect differently (COLLX_CONNECT): rank ",
                dir.addrs.size(), " is ", theirs, ", this rank ", dir.connect, "; set it alike on every rank");
    line.resize(space);
    const size_t at = line.find('@');
    const Address a = Address::parse(line.substr(0, at));
    const std::string host = at == std::string::npos ? a.host() : line.substr(at + 1);
    auto it = std::find(hostNames.begin(), hostNames.end(), host);
    dir.hosts.push_back(int(it - hostNames.begin()));
    if (it == hostNames.end()) hostNames.push_back(host);
    dir.addrs.push_back(a);
  }
}

Directory publish(Store& store, int rank, int size, const std::string& ifname, int family,
                  std::chrono::milliseconds timeout, const std::string& hostLabel, const std::string& connect) {
  Directory dir = announce(store, rank, size, ifname, family, hostLabel, connect);
  readTable(store, dir, timeout);
  return dir;
}

Mesh connectMesh(Store& store, int rank, int size, const std::string& ifname, int family,
                 std::chrono::milliseconds timeout, const std::string& localCongestion) {
  const Deadline deadline = Clock::now() + timeout;
  Connector connector(rank, publish(store, rank, size, ifname, family, timeout, "", "eager"), localCongestion);
  Mesh mesh;
  for (auto& channel : mesh.sockets) channel.resize(size_t(size));
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    for (uint32_t ch = 0; ch < kFirstLane; ++ch) {
      mesh.sockets[ch][size_t(peer)] = connector.take(peer, Channel(ch), deadline);
    }
  }
  connector.stop();  // nobody can connect any more
  const Directory& dir = connector.directory();
  mesh.hosts = dir.hosts;
  mesh.address = dir.address;
  mesh.prefix = dir.prefix;
  mesh.token = dir.token;
  return mesh;
}

}  // namespace collx::tcp

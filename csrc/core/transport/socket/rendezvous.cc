#include "rendezvous.h"

#include <algorithm>
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
    table = stringOf(store.get(dir.prefix + "table", timeout));
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
    for (uint32_t ch = 0; ch < kChannels; ++ch) {
      mesh.sockets[ch][size_t(peer)] = connector.take(peer, Channel(ch), deadline, -1, peer < rank);
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

// What the ranks of one group tell each other through the Store, in a
// number of requests linear in the group's size:
//
//   1. generation = (store.add("collx/generation", 1) - 1) / size. Group names
//      are reused after destroy; the generation keeps a re-init from reading
//      the addresses of the previous incarnation.
//   2. every rank listens on an ephemeral port and sets "addr/<rank>" to
//      "host:port" (or "host:port@label", see DeviceOptions::hostLabel) and
//      how it connects ("lazy" or "eager", which must agree: an eager rank
//      would wait at creation for lazy peers that never dial).
//   3. rank 0 reads them all at once (Store::getMany: one wait, one
//      multi-get), draws the group's random token, and sets "table": the
//      token, then every rank's record.
//   4. every other rank reads "table".
//
// That is 4n+1 requests per group, where each rank reading each address
// took 2n² (rank 0's Store serves them all, one at a time). Rank 0 relays,
// so the Store watches n keys for one rank and one key for the others: had
// every rank waited on every address, it would watch n² (measured: group
// creation at n=1024 in benchmarks/scale/harness.cc took 4.2 s, not 0.7).
//
// The addresses also tell which ranks share a machine: ranks that publish
// the same host (or label) get the same host index (ranks on loopback are
// one host; two network namespaces, or two machines, are two).
//
// The connections themselves are made by a Connector (connector.h), all at
// once (connectMesh) or each when first needed.
#pragma once

#include <vector>

#include "../../store.h"
#include "socket.h"

namespace collx::tcp {

// Channels: independent connections between each pair, for traffic that must
// not queue behind another's (kCollectives in op order, kP2P by tag), and
// the further lanes of a pair whose large collective messages are striped
// (DeviceOptions::lanes): lane 0 is kCollectives, lane i >= 1 channel
// kFirstLane + i - 1.
enum Channel : uint32_t { kCollectives = 0, kPointToPoint = 1, kFirstLane = 2 };
constexpr uint32_t kMaxLanes = 8;
constexpr uint32_t kChannels = kFirstLane + kMaxLanes - 1;
inline Channel laneChannel(int lane) { return lane == 0 ? kCollectives : Channel(kFirstLane + uint32_t(lane) - 1); }

struct Directory {
  int rank = 0;
  int size = 1;
  uint64_t generation = 0;
  uint64_t token = 0;           // the group's secret (every hello carries it)
  std::string prefix;           // the group's Store prefix for this generation
  std::string address;          // the "host:port" this rank published (empty for a group of 1)
  std::vector<Address> addrs;   // per rank
  std::vector<int> hosts;       // host index per rank: equal published host, equal index
  Socket listener;              // non-blocking; invalid for a group of 1
  std::string connect;          // how this rank connects: "lazy" or "eager"
};

// Steps 1 and 2: waits for nobody, so a group's creation can return here
// and leave steps 3 and 4 to its first op. `hostLabel`: stands for the host
// in the host indices (a simulated host of a scale test); empty: the
// address's host. `connect`: "lazy" or "eager".
Directory announce(Store& store, int rank, int size, const std::string& ifname, int family,
                   const std::string& hostLabel, const std::string& connect);
// Steps 3 and 4, on what announce() returned: fills in the token, the
// addresses and the hosts. Throws where another rank connects differently.
void readTable(Store& store, Directory& dir, std::chrono::milliseconds timeout);
// Steps 1 to 4.
Directory publish(Store& store, int rank, int size, const std::string& ifname, int family,
                  std::chrono::milliseconds timeout, const std::string& hostLabel, const std::string& connect);

struct Mesh {
  std::vector<Socket> sockets[kFirstLane];  // collectives and p2p, one per peer; invalid at index `rank`
  std::vector<int> hosts;
  std::string address;
  std::string prefix;
  uint64_t token = 0;
};

// Every rank connected to every other on both channels (no lanes), then the listener
// closed (Connector::take on each). `localCongestion`: the
// congestion control of connections between ranks on one host ("" leaves
// the system's); throws where the kernel refuses it.
Mesh connectMesh(Store& store, int rank, int size, const std::string& ifname, int family,
                 std::chrono::milliseconds timeout, const std::string& localCongestion = "reno");

}  // namespace collx::tcp

// Builds the full mesh of connections for one group through the Store.
//
//   1. generation = (store.add("collx/generation", 1) - 1) / size. Group names
//      are reused after destroy; the generation keeps a re-init from reading
//      the addresses of the previous incarnation.
//   2. rank 0 draws a random token and publishes it; every hello carries it.
//   3. every rank listens on an ephemeral port and publishes "host:port".
//   4. rank r connects to every rank below it and accepts every rank above
//      it, once per channel (the hello names the channel). A connection whose hello is not ours (wrong magic, token, rank or
//      generation; garbage; closed early) is dropped and accepting goes on;
//      hellos are read from all accepted connections at once, so a silent or
//      half-sent one holds up nobody (it is dropped after 10 s).
//   5. the listener closes; nobody else can connect afterwards.
//
// The published addresses also tell which ranks share a machine: ranks that
// publish the same host address get the same host index (ranks on loopback
// are one host; two network namespaces, or two machines, are two).
#pragma once

#include <vector>

#include "../../store.h"
#include "socket.h"

namespace collx::tcp {

// Channels: independent connections between each pair, for traffic that must
// not queue behind another's (kCollectives in op order, kP2P by tag).
enum Channel : uint32_t { kCollectives = 0, kPointToPoint = 1, kChannels = 2 };

struct Mesh {
  std::vector<Socket> sockets[kChannels];  // per channel, one per peer; invalid at index `rank`
  std::vector<int> hosts;       // host index per rank: equal published host address, equal index
  std::string address;          // the "host:port" this rank published (empty for a group of 1)
  std::string prefix;           // the group's Store prefix for this generation
  uint64_t token = 0;           // the group's secret (every hello carries it)
};

// `localCongestion`: the congestion control of connections between ranks
// on one host ("" leaves the system's); throws where the kernel refuses it.
Mesh connectMesh(Store& store, int rank, int size, const std::string& ifname, int family,
                 std::chrono::milliseconds timeout, const std::string& localCongestion = "reno");

}  // namespace collx::tcp

// The shared-memory rings between this rank and each peer on its host. They
// are set up after the TCP mesh, whose sockets stay open beside them: as the
// doorbell of a sleeping side (ring.h) and as the sign of a dead peer (the
// kernel closes a dead process's sockets).
//
//   1. each rank creates one segment that holds its inbound ring from each
//      local peer and publishes "pid fd bytes" (or why it could not) under
//      the group's Store prefix;
//   2. it maps each local peer's segment and checks its header: magic, the
//      group's secret token, owner rank and layout;
//   3. over the pair's TCP socket it says whether step 2 worked and reads the
//      peer's answer: a pair uses shared memory only if both sides can;
//   4. it closes its segment's fd; from then on nobody can attach;
//   5. where every rank is on this host, the ranks agree whether every pair
//      linked: only then does the group get shared windows; and whether
//      every pair can read the other's memory (cross-memory attach, which
//      the ptrace policy may refuse; each rank tried it in step 2 on the
//      peer's segment header, through the address it published).
//
// Each pair has rings for both channels of the mesh: the ordered collectives
// and point-to-point. Memory is bounded per group, whatever the tensor
// sizes: 2 (local ranks - 1) inbound rings per rank, each of
// ringBytes(local ranks).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../../store.h"
#include "../shared_windows.h"
#include "../transport.h"
#include "ring.h"
#include "segment.h"

namespace collx::shm {

// COLLX_TRANSPORT: auto uses shared memory between ranks on one host where
// it can (and says why not); shm requires it there; tcp never uses it.
enum class Mode { kAuto, kTcp, kShm };
Mode parseMode(const std::string& name);  // throws Error naming COLLX_TRANSPORT
const char* name(Mode mode);

// Whether the shared-memory collectives read the peers' memory in place
// (cross-memory attach, COLLX_SHM_CMA): never; where the ranks may and the
// read pays, by its cost as each rank measures it at setup (a multiple of a
// copy of the same bytes); or wherever the ranks may (PeerReads::kAll).
enum class ReadPeers { kNever, kWherePays, kAlways };
ReadPeers parseReadPeers(const std::string& value);  // 0, auto, 1; throws Error naming COLLX_SHM_CMA
// A read that stands for two copies (PeerReads::kCopies) pays while it costs
// less than those two; one that stands for a copy in and is reduced from a
// scratch (kAll) pays only near one copy's cost. Where process_vm_readv pins
// pages slowly (a virtual machine's), a read has cost 3-5 copies; where
// reductions lost and gathers won, 1.7 (docs/measurements.md).
constexpr double kMaxCopyReadCost = 2.0, kMaxReduceReadCost = 1.4;
// What the ranks read in place where the dearest read costs `cost` copies.
PeerReads readsAtCost(double cost);

// Ring capacity for a group with `localRanks` ranks on one host: 1 MiB,
// less for many local ranks so that a rank's inbound rings stay within 32 MiB.
size_t ringBytes(int localRanks);

struct Link {
  Ring in;   // from the peer, in this rank's segment
  Ring out;  // to the peer, in the peer's segment
  std::shared_ptr<Segment> inSegment, outSegment;  // keep the mappings
};

// Each segment also holds its owner's shared window (transport/shared_windows.h):
// a control page, then two halves of kWindowHalfBytes.
constexpr size_t kWindowHalfBytes = 1 << 20;

struct LocalLinks {
  // Per rank, for each channel; null: TCP (other host, self, or no shm).
  std::vector<std::unique_ptr<Link>> collectives, p2p;
  // Per rank: its window area (control page, then the halves), mapped here;
  // null where there are no rings (and for self when there are none at all),
  // and for every rank unless every pair of an all-local group linked.
  std::vector<char*> windows;
  std::vector<std::shared_ptr<Segment>> segments;  // keep `windows` mapped
  // With the windows: every rank's process, and what the collectives read
  // of each other's memory with process_vm_readv (the ranks agreed on it).
  std::vector<pid_t> pids;
  PeerReads peerReads = PeerReads::kNone;
  std::string note;  // one line on what was set up or why not, for the log
  // The note less what the ranks measured (which collectives read in place):
  // what the calibration cache is keyed by, the same from run to run where a
  // read's cost lies near a threshold (the tuning's saved choices are
  // checked before they are kept anyway).
  std::string key;
  bool unavailable = false;  // some local pair could not use shared memory
  // Per rank: why a local peer left during setup (its socket closed, or it
  // had none: it refused the dial), "" for the others. The rest link
  // without it, and no rank gets the windows.
  std::vector<std::string> departed;
};

// What a peer that failed left as its reason ("" if nothing).
using NoteOf = std::function<std::string(int peer)>;

// This process's cost of reading `bytes` of process `pid`'s memory at
// `remote` with process_vm_readv, as a multiple of a copy of the same bytes
// from `mapped`, its mapping here: the best of a few alternating tries.
double readCostOf(pid_t pid, uint64_t remote, const char* mapped, size_t bytes);

// `fds`: the connected TCP socket per peer (blocking; -1 for self, and for a
// local peer that left before it connected). `readPeers`: whether to read
// in place (COLLX_SHM_CMA). A local peer whose socket closes during setup
// leaves it at once, with its note (LocalLinks::departed). `wakeFd`
// readable (the group was shut down) ends every wait with Error
// "interrupted": a stopped peer answers nothing until the deadline.
LocalLinks connectLocal(Store& store, const std::string& prefix, uint64_t token, int rank,
                        const std::vector<int>& hosts, const std::vector<int>& fds, Mode mode,
                        ReadPeers readPeers, Deadline deadline, const NoteOf& noteOf = nullptr, int wakeFd = -1);

}  // namespace collx::shm

#include "links.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "../../error.h"

namespace collx::shm {

namespace {

constexpr uint64_t kSegmentMagic = 0x436c5853686d3031;  // "ClXShm01"
constexpr size_t kPage = 4096;
constexpr size_t kMaxRingBytes = 1 << 20;
constexpr size_t kMinRingBytes = 64 << 10;
constexpr size_t kRingBudget = 32 << 20;  // per rank: all its inbound rings
constexpr size_t kPopulatedRanks = 8;      // local ranks up to which setup maps the collectives' memory
constexpr size_t kReadCostBytes = 1 << 20;  // what a read's cost is measured on: a window's half, as a chunk is

struct SegmentHeader {
  uint64_t magic;
  uint64_t token;
  int32_t owner;
  int32_t slots;
  uint64_t ringBytes;
};

// A slot holds a writer's two rings (collectives, p2p); a ring is its
// control block on a page of its own, then the data.
size_t ringStride(size_t ring) { return kPage + ring; }
size_t slotBytes(size_t ring) { return 2 * ringStride(ring); }

// Where writer `from` finds its ring in the segment of `owner`: its place
// among the owner's local peers.
int slotOf(const std::vector<int>& hosts, int owner, int from) {
  int slot = 0;
  for (int r = 0; r < from; ++r) slot += r != owner && hosts[r] == hosts[owner];
  return slot;
}

Ring ringAt(const Segment& s, int slot, int channel, size_t ring) {
  char* base = s.data() + kPage + size_t(slot) * slotBytes(ring) + size_t(channel) * ringStride(ring);
  return Ring(reinterpret_cast<RingControl*>(base), base + kPage, ring);
}

std::vector<uint8_t> bytesOf(const std::string& s) { return {s.begin(), s.end()}; }

// The setup line's words on reading in place, where every rank may. They
// name the choice, not the measured cost, which moves from run to run.
std::string readNote(bool everyRankMayRead, PeerReads reads) {
  auto copies = [](double cost) {
    char s[16];
    std::snprintf(s, sizeof s, "%g", cost);
    return str(s, " copies");
  };
  if (!everyRankMayRead) return "";
  switch (reads) {
    case PeerReads::kAll: return ", cross-memory attach";
    case PeerReads::kCopies:
      return ", cross-memory attach for copies: a read to reduce costs over " + copies(kMaxReduceReadCost);
    case PeerReads::kNone: break;
  }
  return ", the windows: a read of a peer's memory costs over " + copies(kMaxCopyReadCost);
}

// Whether this process may read the peer's memory (process_vm_readv needs
// ptrace-attach rights, which Yama or a seccomp policy may refuse): reads
// the header of its segment where the peer says it lies, and compares it
// with the mapping.
bool canReadMemoryOf(pid_t pid, uint64_t address, const SegmentHeader& mapped) {
  SegmentHeader read{};
  iovec local{&read, sizeof read};
  iovec remote{reinterpret_cast<void*>(uintptr_t(address)), sizeof read};
  return ::process_vm_readv(pid, &local, 1, &remote, 1, 0) == ssize_t(sizeof read) &&
         std::memcmp(&read, &mapped, sizeof read) == 0;
}

// Whether the group's setup was interrupted (it was shut down meanwhile):
// a wait on a peer, which may be stopped and answer nothing, ends then.
bool interrupted(int wakeFd) {
  pollfd p{wakeFd, POLLIN, 0};
  return wakeFd >= 0 && ::poll(&p, 1, 0) > 0;
}

// Whether the peer's end of the pair's socket is closed (its process is
// gone): end of stream, not data, which is left where it is.
bool closedByPeer(int fd) {
  pollfd p{fd, POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLHUP | POLLERR | POLLRDHUP)) return true;
  char byte;
  return ::recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

// How long a wait for a local peer's key runs between checks that it lives.
constexpr auto kLivenessCheck = std::chrono::milliseconds(500);

// What a rank sees when a local peer's socket closes during setup: the
// peer's process is gone, or its setup failed and it left a note.
PeerClosedError peerLeft(int rank, int peer, const NoteOf& noteOf) {
  const std::string note = noteOf ? noteOf(peer) : "";
  return PeerClosedError(str(peerClosed(rank, peer, "shared-memory setup").what(), noteOfPeer(peer, note)));
}

// A local peer's key. The wait runs in slices, and between them the pair's
// socket tells whether the peer lives: a peer killed while the group
// connects ends the wait at once, naming it, not at the group's deadline. A
// peer sets its keys before it closes, so a key it set is read even then.
std::vector<uint8_t> awaitKey(Store& store, const std::string& key, int rank, int peer, int fd, Deadline deadline,
                              const NoteOf& noteOf, int wakeFd) {
  const auto start = Clock::now();
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    try {
      return store.get(key, std::clamp(left, std::chrono::milliseconds(0), kLivenessCheck));
    } catch (const TimeoutError&) {
      if (interrupted(wakeFd)) throw Error("interrupted");
      if (closedByPeer(fd)) {
        if (auto value = store.tryGet(key)) return *value;
        throw peerLeft(rank, peer, noteOf);
      }
      if (left <= kLivenessCheck) {
        const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
        throw TimeoutError(str("collx rank ", rank, ": timed out after ", waited.count(),
                               " ms waiting in the Store for ", key, ", which peer ", peer, " sets"));
      }
    }
  }
}

// One status byte each way over the pair's socket, with the group deadline;
// `wakeFd` readable interrupts the wait.
bool exchangeStatus(int rank, int peer, int fd, bool mine, Deadline deadline, const NoteOf& noteOf, int wakeFd,
                    std::string& why) {
  const char out = mine ? 1 : 0;
  if (::send(fd, &out, 1, MSG_NOSIGNAL) != 1) {
    why = str("could not tell the peer: ", strerror(errno));
    return false;
  }
  char in = 0;
  for (;;) {
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (ms <= 0) throw TimeoutError("Timed out waiting for a peer's shared-memory status");
    pollfd p[2] = {{fd, POLLIN, 0}, {wakeFd, POLLIN, 0}};
    int rc = ::poll(p, wakeFd >= 0 ? 2 : 1, int(std::min<int64_t>(ms, 1 << 30)));
    if (rc < 0 && errno == EINTR) continue;
    if (rc > 0 && p[1].revents) throw Error("interrupted");
    ssize_t got = rc > 0 ? ::recv(fd, &in, 1, 0) : 0;
    if (got == 1) break;
    if (rc > 0) throw peerLeft(rank, peer, noteOf);
  }
  if (!in && mine) why = "the peer could not map this rank's segment";
  return mine && in;
}

}  // namespace

Mode parseMode(const std::string& s) {
  if (s.empty() || s == "auto") return Mode::kAuto;
  if (s == "tcp") return Mode::kTcp;
  if (s == "shm") return Mode::kShm;
  throw Error(str("COLLX_TRANSPORT must be auto, tcp or shm, not '", s, "'"));
}

ReadPeers parseReadPeers(const std::string& s) {
  if (s == "0") return ReadPeers::kNever;
  if (s.empty() || s == "auto") return ReadPeers::kWherePays;
  if (s == "1") return ReadPeers::kAlways;
  throw Error(str("COLLX_SHM_CMA must be 0, 1 or auto, not '", s, "'"));
}

PeerReads readsAtCost(double cost) {
  if (cost <= kMaxReduceReadCost) return PeerReads::kAll;
  return cost <= kMaxCopyReadCost ? PeerReads::kCopies : PeerReads::kNone;
}

double readCostOf(pid_t pid, uint64_t remote, const char* mapped, size_t bytes) {
  std::vector<char> into(bytes, 1);  // its pages faulted in before any try
  iovec local{into.data(), bytes};
  iovec from{reinterpret_cast<void*>(uintptr_t(remote)), bytes};
  double copy = 1e300, read = 1e300;
  for (int i = 0; i < 4; ++i) {
    const auto t0 = Clock::now();
    std::memcpy(into.data(), mapped, bytes);
    const auto t1 = Clock::now();
    if (::process_vm_readv(pid, &local, 1, &from, 1, 0) != ssize_t(bytes)) return 1e300;
    const auto t2 = Clock::now();
    copy = std::min(copy, std::chrono::duration<double>(t1 - t0).count());
    read = std::min(read, std::chrono::duration<double>(t2 - t1).count());
  }
  return read / std::max(copy, 1e-9);
}

const char* name(Mode mode) {
  switch (mode) {
    case Mode::kAuto: return "auto";
    case Mode::kTcp: return "tcp";
    case Mode::kShm: return "shm";
  }
  return "?";
}

size_t ringBytes(int localRanks) {
  const size_t rings = 2 * size_t(std::max(1, localRanks - 1));
  size_t ring = kMaxRingBytes;
  while (ring > kMinRingBytes && ring * rings > kRingBudget) ring /= 2;
  return ring;
}

LocalLinks connectLocal(Store& store, const std::string& prefix, uint64_t token, int rank,
                        const std::vector<int>& hosts, const std::vector<int>& fds, Mode mode,
                        ReadPeers readPeers, Deadline deadline, const NoteOf& noteOf, int wakeFd) {
  const int size = int(hosts.size());
  LocalLinks result;
  result.collectives.resize(size_t(size));
  result.p2p.resize(size_t(size));
  result.windows.resize(size_t(size));
  result.departed.resize(size_t(size));
  std::vector<int> peers;
  for (int r = 0; r < size; ++r) {
    if (r != rank && hosts[r] == hosts[rank]) peers.push_back(r);
  }
  if (mode == Mode::kTcp || peers.empty()) return result;

  const size_t ring = ringBytes(int(peers.size()) + 1);
  const size_t windowAt = kPage + peers.size() * slotBytes(ring);
  const size_t bytes = windowAt + kPage + 2 * kWindowHalfBytes;
  const std::string key = prefix + "shm/";

  // 1. This rank's inbound rings.
  auto own = std::make_shared<Segment>();
  std::string ownError;
  try {
    *own = Segment::create(bytes);
    auto* h = reinterpret_cast<SegmentHeader*>(own->data());
    *h = SegmentHeader{kSegmentMagic, token, rank, int32_t(peers.size()), ring};
    store.set(key + std::to_string(rank),
              bytesOf(str(::getpid(), " ", own->fd(), " ", bytes, " ", uintptr_t(own->data()))));
  } catch (const Error& e) {
    ownError = e.what();
    store.set(key + std::to_string(rank), bytesOf("-" + ownError));
  }

  // 2. Map every local peer's segment and check it is the one it claims.
  std::vector<std::shared_ptr<Segment>> theirs(hosts.size());
  std::vector<std::string> why(hosts.size());
  result.pids.assign(hosts.size(), 0);
  result.pids[size_t(rank)] = ::getpid();
  bool readAll = readPeers != ReadPeers::kNever;
  const bool allLocal = int(peers.size()) == size - 1;
  double readCost = 0;  // this rank's, where measured
  // A peer that leaves (its socket closes) goes on the departed list and
  // out of the setup: the others link without it.
  auto leaves = [&](int peer, const PeerClosedError& e) { result.departed[size_t(peer)] = e.what(); };
  auto present = [&](int peer) { return result.departed[size_t(peer)].empty(); };
  for (int peer : peers) {
    if (fds[size_t(peer)] < 0) result.departed[size_t(peer)] = str("peer ", peer, " left before it connected");
  }
  for (int peer : peers) {
    if (!present(peer)) continue;
    std::string s;
    try {
      const auto v = awaitKey(store, key + std::to_string(peer), rank, peer, fds[size_t(peer)], deadline, noteOf, wakeFd);
      s.assign(v.begin(), v.end());
    } catch (const PeerClosedError& e) {
      leaves(peer, e);
      continue;
    }
    try {
      if (!ownError.empty()) throw Error(ownError);
      if (!s.empty() && s[0] == '-') throw Error("the peer could not create its segment: " + s.substr(1));
      long long pid = 0, fd = 0, len = 0;
      unsigned long long address = 0;
      COLLX_CHECK(std::sscanf(s.c_str(), "%lld %lld %lld %llu", &pid, &fd, &len, &address) == 4 &&
                      size_t(len) == bytes,
                  "malformed segment address '", s, "'");
      auto seg = std::make_shared<Segment>(Segment::attach(pid_t(pid), int(fd), bytes));
      const auto* h = reinterpret_cast<const SegmentHeader*>(seg->data());
      COLLX_CHECK(h->magic == kSegmentMagic && h->token == token && h->owner == peer &&
                      h->slots == int32_t(peers.size()) && h->ringBytes == ring,
                  "the segment at pid ", pid, " fd ", fd, " is not this group's");
      readAll = readAll && canReadMemoryOf(pid_t(pid), address, *h);
      if (readAll && readPeers == ReadPeers::kWherePays && readCost == 0 && allLocal) {
        // The host's cost, measured once: on the first half of a peer's window.
        const size_t half = windowAt + kPage;
        seg->populate(half, kReadCostBytes);
        readCost = readCostOf(pid_t(pid), address + half, seg->data() + half, kReadCostBytes);
      }
      result.pids[size_t(peer)] = pid_t(pid);
      theirs[size_t(peer)] = std::move(seg);
    } catch (const Error& e) {
      why[size_t(peer)] = e.what();
    }
  }

  // 3. Agree per pair; 4. nobody needs to attach any more.
  int linked = 0;
  std::string failures;
  for (int peer : peers) {
    if (!present(peer)) continue;
    bool both = false;
    try {
      both = exchangeStatus(rank, peer, fds[size_t(peer)], bool(theirs[size_t(peer)]), deadline, noteOf, wakeFd,
                            why[size_t(peer)]);
    } catch (const PeerClosedError& e) {
      leaves(peer, e);
      continue;
    }
    if (!both) {
      failures += str(failures.empty() ? "" : "; ", "peer ", peer, ": ", why[size_t(peer)]);
      continue;
    }
    for (int channel = 0; channel < 2; ++channel) {
      auto link = std::make_unique<Link>();
      link->in = ringAt(*own, slotOf(hosts, rank, peer), channel, ring);
      link->out = ringAt(*theirs[size_t(peer)], slotOf(hosts, peer, rank), channel, ring);
      link->inSegment = own;
      link->outSegment = theirs[size_t(peer)];
      (channel == 0 ? result.collectives : result.p2p)[size_t(peer)] = std::move(link);
    }
    result.windows[size_t(peer)] = theirs[size_t(peer)]->data() + windowAt;
    result.segments.push_back(theirs[size_t(peer)]);
    ++linked;
  }
  own->closeFd();
  if (linked > 0) {
    result.windows[size_t(rank)] = own->data() + windowAt;
    result.segments.push_back(own);
  }
  // 5. The windows serve collectives of the whole group, which every rank
  //    must run alike: when all ranks share this host, they use them only if
  //    every pair linked, and read each other's memory only if every rank
  //    can, where the dearest read any rank measured pays, which each rank
  //    tells the others ("0": not linked, "1": linked, "2 <cost>": linked
  //    and can read every peer, at that cost; 0 where reads are forced).
  //    Every rank decides on the same words, its own among them; a peer
  //    that left without its word stands for "0" with every rank that
  //    waited for it.
  const bool everyPeer = std::all_of(peers.begin(), peers.end(), present);
  if (allLocal) {
    char mine[48] = "0";
    if (failures.empty() && everyPeer && readAll) std::snprintf(mine, sizeof mine, "2 %.3g", readCost);
    if (failures.empty() && everyPeer && !readAll) std::snprintf(mine, sizeof mine, "1");
    store.set(key + "linked/" + std::to_string(rank), bytesOf(mine));
    bool everyPair = failures.empty();
    double cost = 0;
    auto hear = [&](const std::string& said) {
      everyPair = everyPair && said != "0";
      readAll = readAll && said.rfind("2 ", 0) == 0;
      if (readAll) cost = std::max(cost, std::strtod(said.c_str() + 2, nullptr));
    };
    hear(mine);
    for (int peer : peers) {
      if (!present(peer)) continue;
      try {
        const auto said =
            awaitKey(store, key + "linked/" + std::to_string(peer), rank, peer, fds[size_t(peer)], deadline, noteOf, wakeFd);
        hear(std::string(said.begin(), said.end()));
      } catch (const PeerClosedError& e) {
        leaves(peer, e);
        hear("0");
      }
    }
    if (!everyPair) std::fill(result.windows.begin(), result.windows.end(), nullptr);
    if (everyPair && readAll) result.peerReads = readsAtCost(cost);
  }

  // What the collectives write and read, mapped now, for few local ranks
  // (the first ops of 1 MiB and more touch all of it anyway): the
  // collectives' rings each way, and the windows where the group has them.
  if (linked > 0 && peers.size() < kPopulatedRanks) {
    const bool windows = int(peers.size()) == size - 1 && result.windows[size_t(rank)] != nullptr;
    for (int peer : peers) {
      if (!result.collectives[size_t(peer)]) continue;
      own->populate(kPage + size_t(slotOf(hosts, rank, peer)) * slotBytes(ring), ringStride(ring));
      theirs[size_t(peer)]->populate(kPage + size_t(slotOf(hosts, peer, rank)) * slotBytes(ring), ringStride(ring));
      if (windows) theirs[size_t(peer)]->populate(windowAt, bytes - windowAt);
    }
    if (windows) own->populate(windowAt, bytes - windowAt);
  }

  if (!failures.empty()) {
    result.unavailable = true;
    result.note = result.key = str("shared memory unavailable (", failures, "); those pairs use TCP");
    COLLX_CHECK(mode != Mode::kShm, "collx rank ", rank, ": COLLX_TRANSPORT=shm, but ", result.note);
  } else {
    std::string linkedNote = str("shared memory with ", linked, " local peer(s), ", ring >> 10, " KiB rings");
    for (int peer : peers) {
      if (!present(peer)) linkedNote += str("; peer ", peer, " left during setup");
    }
    result.note = linkedNote + readNote(allLocal && readAll, result.peerReads);
    result.key = linkedNote + (allLocal && readAll ? ", may read in place" : "");
  }
  return result;
}

}  // namespace collx::shm

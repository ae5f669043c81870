// Direct exchanges: every message posted at once, then one wait.
//
//   all-to-all      rank r sends block j to rank j, receives block j from j
//   gather          every rank sends to the root
//   scatter         the root sends block j to rank j
//   all-gather      (small) every rank sends its block to every other rank
//   send/recv       a batch of point-to-point ops
//
// The transport keeps each pair's messages in post order on both sides, so a
// single step suffices and nothing waits on a round trip it does not need.
#include <algorithm>
#include <cstring>

#include "../error.h"
#include "algorithms.h"
#include "tuning.h"

namespace collx {

void exchange(const Collective& c, const std::vector<Transfer>& sends,
              const std::vector<Transfer>& recvs, const std::function<void()>& meanwhile) {
  uint64_t cookie = 0;
  for (const Transfer& t : recvs) c.transport.postRecv(t.peer, t.frame, t.data, t.bytes, cookie++);
  for (const Transfer& t : sends) c.transport.postSend(t.peer, t.frame, t.data, t.bytes, cookie++);
  if (meanwhile) meanwhile();
  waitAll(c.transport, c.deadline);
}

const void* allgatherSource(const void* in, const std::vector<void*>& blocks, int rank, size_t blockBytes) {
  for (size_t r = 0; r < blocks.size(); ++r) {
    if (int(r) != rank && overlaps(in, blocks[r], blockBytes)) {
      std::memmove(blocks[size_t(rank)], in, blockBytes);
      return blocks[size_t(rank)];
    }
  }
  return in;
}

void allgather(const Collective& c, const void* in, const std::vector<void*>& blocks, size_t blockCount) {
  const int n = c.size(), rank = c.rank();
  COLLX_CHECK(int(blocks.size()) == n, "collx rank ", rank, ": all_gather needs ", n, " blocks, got ", blocks.size());
  const size_t blockBytes = blockCount * elementSize(c.dtype);
  if (allgatherInShm(c.transport, blockBytes)) return shmAllgather(c, in, blocks, blockCount);
  if (!allgatherDirect(n, blockBytes)) {
    char* const flat = static_cast<char*>(blocks[0]);
    bool endToEnd = true;
    for (int r = 0; r < n; ++r) endToEnd = endToEnd && blocks[size_t(r)] == flat + size_t(r) * blockBytes;
    char* const out = endToEnd ? flat : c.workspace.get(std::max<size_t>(1, blockBytes * size_t(n)));
    if (out + size_t(rank) * blockBytes != in) std::memmove(out + size_t(rank) * blockBytes, in, blockBytes);
    ringAllgather(c, out, blockCount);
    if (!endToEnd) {
      for (int r = 0; r < n; ++r) std::memcpy(blocks[size_t(r)], out + size_t(r) * blockBytes, blockBytes);
    }
    return;
  }
  const void* const source = allgatherSource(in, blocks, rank, blockBytes);
  std::vector<Transfer> sends, recvs;
  for (int peer = 0; peer < n; ++peer) {
    if (peer == rank) continue;
    sends.push_back({peer, const_cast<void*>(source), blockBytes, c.frame(0)});
    recvs.push_back({peer, blocks[size_t(peer)], blockBytes, c.frame(0)});
  }
  exchange(c, sends, recvs);
  if (blockBytes > 0 && blocks[size_t(rank)] != source) std::memmove(blocks[size_t(rank)], source, blockBytes);
}

void allgather(const Collective& c, void* out, size_t blockCount) {
  const size_t blockBytes = blockCount * elementSize(c.dtype);
  const auto blocks = blocksAt(out, c.size(), blockBytes);
  allgather(c, blocks[size_t(c.rank())], blocks, blockCount);
}

}  // namespace collx

namespace collx {

// Direct all-reduce: one step. Every rank sends its buffer to every other and
// folds all n buffers in rank order, so each computes the bit-identical
// ((b0 + b1) + b2) + ... The cheapest in latency, the dearest in bytes
// (n-1 copies out and in): the choice for tiny messages.
void directAllreduce(const Collective& c, void* buf, size_t count, ReduceFn fn) {
  const int n = c.size(), rank = c.rank();
  if (n == 1) return;
  const size_t bytes = count * elementSize(c.dtype);
  char* slots = c.workspace.get(bytes * size_t(n - 1));  // a slot per peer
  auto slot = [&](int r) { return slots + size_t(r < rank ? r : r - 1) * bytes; };  // r != rank
  std::vector<Transfer> sends, recvs;
  for (int peer = 0; peer < n; ++peer) {
    if (peer == rank) continue;
    sends.push_back({peer, buf, bytes, c.frame(0)});
    recvs.push_back({peer, slot(peer), bytes, c.frame(0)});
  }
  exchange(c, sends, recvs);
  // Rank 0 folds into buf; the others into slot 0, copied to buf at the end,
  // so buf is written only by fn until its last reduction (algorithms.h).
  char* acc = rank == 0 ? static_cast<char*>(buf) : slot(0);
  for (int r = 1; r < n; ++r) fn(acc, r == rank ? buf : slot(r), count);
  if (rank != 0) std::memcpy(buf, acc, bytes);
}

}  // namespace collx

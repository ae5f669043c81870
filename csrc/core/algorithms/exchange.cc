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

#include "../copy.h"
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
      moveBytes(blocks[size_t(rank)], in, blockBytes);
      return blocks[size_t(rank)];
    }
  }
  return in;
}

void allgather(const Collective& c, const void* in, const std::vector<void*>& blocks, size_t blockCount) {
  const int n = c.size(), rank = c.rank();
  COLLX_CHECK(int(blocks.size()) == n, "collx rank ", rank, ": all_gather needs ", n, " blocks, got ", blocks.size());
  const size_t blockBytes = blockCount * elementSize(c.dtype);
  if (movesInShm(c.transport)) return shmAllgather(c, in, blocks, blockCount);
  if (twoLevelMoves(c.transport)) return twoLevelAllgather(c, in, blocks, blockCount);
  if (!allgatherDirect(n, blockBytes)) {
    char* const flat = static_cast<char*>(blocks[0]);
    bool endToEnd = true;
    for (int r = 0; r < n; ++r) endToEnd = endToEnd && blocks[size_t(r)] == flat + size_t(r) * blockBytes;
    char* const out = endToEnd ? flat : c.workspace.get(std::max<size_t>(1, blockBytes * size_t(n)));
    if (out + size_t(rank) * blockBytes != in) moveBytes(out + size_t(rank) * blockBytes, in, blockBytes);
    ringAllgather(c, out, blockCount);
    if (!endToEnd) {
      for (int r = 0; r < n; ++r) copyBytes(blocks[size_t(r)], out + size_t(r) * blockBytes, blockBytes);
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
  if (blockBytes > 0 && blocks[size_t(rank)] != source) moveBytes(blocks[size_t(rank)], source, blockBytes);
}

void allgather(const Collective& c, void* out, size_t blockCount) {
  const size_t blockBytes = blockCount * elementSize(c.dtype);
  const auto blocks = blocksAt(out, c.size(), blockBytes);
  allgather(c, blocks[size_t(c.rank())], blocks, blockCount);
}

}  // namespace collx

namespace collx {

// Direct all-reduce: one step per piece. Every rank sends its buffer to
// every other and folds all n buffers in rank order, so each computes the
// bit-identical ((b0 + b1) + b2) + ... The cheapest in latency, the dearest
// in bytes (n-1 copies out and in): the choice for tiny messages.
//
// A buffer over kDirectPieceBytes goes in pieces. Every send is posted at
// once; the receives go two pieces ahead, into two slots of a piece per peer
// rather than a whole buffer per peer (bounded memory, and slots that stay
// in cache where a buffer of many MiB would not), so piece j+1 arrives while
// piece j is folded:
//
//   post every piece's sends, and the receives of pieces 0 and 1
//   for each piece j: wait for j's sends and receives; fold j; post the
//   receives of piece j+2
void directAllreduce(const Collective& c, void* buf, size_t count, ReduceFn fn) {
  const int n = c.size(), rank = c.rank();
  if (n == 1) return;
  const size_t es = elementSize(c.dtype);
  const size_t pieceElems = std::max<size_t>(1, kDirectPieceBytes / es);
  const size_t pieces = std::max<size_t>(1, (count + pieceElems - 1) / pieceElems);
  const size_t slotBytes = std::min(count, pieceElems) * es;
  const size_t sets = std::min<size_t>(pieces, 2), peers = size_t(n - 1);
  char* const slots = c.workspace.get(slotBytes * peers * sets);
  char* const data = static_cast<char*>(buf);
  // Piece j's slot of peer r != rank.
  auto slot = [&](size_t j, int r) { return slots + ((j % 2) * peers + size_t(r < rank ? r : r - 1)) * slotBytes; };
  auto lengthOf = [&](size_t j) { return std::min(pieceElems, count - j * pieceElems); };
  auto bytesOf = [&](size_t j) { return count == 0 ? 0 : lengthOf(j) * es; };
  auto postRecvs = [&](size_t j) {
    for (int peer = 0; peer < n; ++peer) {
      if (peer != rank) c.transport.postRecv(peer, c.frame(uint32_t(j)), slot(j, peer), bytesOf(j), j);
    }
  };
  std::vector<size_t> left(pieces, 2 * peers);  // piece j's transfers not yet done
  for (size_t j = 0; j < sets; ++j) postRecvs(j);
  for (size_t j = 0; j < pieces; ++j) {
    for (int peer = 0; peer < n; ++peer) {
      if (peer != rank) c.transport.postSend(peer, c.frame(uint32_t(j)), data + j * pieceElems * es, bytesOf(j), j);
    }
  }
  std::vector<uint64_t> done;
  for (size_t j = 0; j < pieces; ++j) {
    while (left[j] > 0) {
      done.clear();
      c.transport.waitSome(done, c.deadline);
      for (uint64_t piece : done) --left[piece];
    }
    // Rank 0 folds into buf; the others into peer 0's slot, copied to buf at
    // the end, so buf is written only by fn until its last reduction
    // (algorithms.h). Piece j's sends are done, so buf's piece may change.
    const size_t len = count == 0 ? 0 : lengthOf(j);
    char* const mine = data + j * pieceElems * es;
    char* const acc = rank == 0 ? mine : slot(j, 0);
    for (int r = 1; r < n; ++r) fn(acc, r == rank ? mine : slot(j, r), len);
    if (rank != 0 && len > 0) copyBytes(mine, acc, len * es);
    if (j + 2 < pieces) postRecvs(j + 2);
  }
}

}  // namespace collx

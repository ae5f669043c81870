// All-reduce in shared memory, for a group whose ranks all share this host
// (Transport::sharedWindows). No byte goes through a message: each rank
// reduces 1/n of every chunk, reading the peers' data where it lies.
//
//   for each chunk k of the buffer (at most half a window), in half k % 2:
//     1. wait until every rank has gathered chunk k-2 (this half is free)
//     2. copy my part of the buffer into my window; post k, with the op's
//        identity (sequence number, count, kind, dtype)
//     3. wait until every rank has posted k; check that all run this op,
//        before any byte of the result is written
//     4. reduce my slice of the chunk in my window, in rank order, from the
//        same slice of every peer's window; post reduced k
//     5. wait until every rank has reduced k; copy every rank's slice into
//        the buffer; post gathered k
//
//   rank 0 window  [ s0 | s1 | s2 ]   rank 1 reduces s1 of all three windows
//   rank 1 window  [ s0 | s1 | s2 ]   into its own s1, then everyone copies
//   rank 2 window  [ s0 | s1 | s2 ]   s0 from rank 0, s1 from 1, s2 from 2.
//
// The counters grow across ops, so the two halves alternate between them.
// An empty buffer still runs one empty chunk: its identity is checked too.
#include <algorithm>
#include <cstring>

#include "../error.h"
#include "../transport/shared_windows.h"
#include "algorithms.h"

namespace collx {

namespace {

std::string describeOp(uint64_t seq, uint64_t count, uint32_t kind, uint32_t dtype) {
  return str(name(OpKind(kind)), " #", seq, " (", count, " x ", name(DataType(dtype)), ")");
}

}  // namespace

void shmAllreduce(const Collective& c, void* buf, size_t count, ReduceFn fn) {
  SharedWindows* w = c.transport.sharedWindows();
  const int n = c.size(), me = c.rank();
  COLLX_CHECK(w, "collx rank ", me, ": the shm all-reduce needs every rank on this host, linked by shared memory "
              "(COLLX_TRANSPORT=auto or shm)");
  const size_t es = elementSize(c.dtype);
  const size_t chunkElems = std::max<size_t>(1, w->halfBytes() / es);
  WindowControl& mine = w->control(me);
  char* const out = static_cast<char*>(buf);

  // Every rank's counter `which` has reached `k`.
  auto all = [&](std::atomic<uint64_t> WindowControl::*which, uint64_t k) {
    return [=] {
      for (int r = 0; r < n; ++r) {
        if ((w->control(r).*which).load(std::memory_order_seq_cst) < k) return false;
      }
      return true;
    };
  };
  auto lagging = [&](std::atomic<uint64_t> WindowControl::*which, uint64_t k, const char* step) {
    return [=] {
      std::string who;
      for (int r = 0; r < n; ++r) {
        if ((w->control(r).*which).load() < k) who += str(who.empty() ? "" : ", ", r);
      }
      return str("peer(s) ", who, " to have ", step, " ", k, " chunk(s) in shared memory (", name(c.kind), " #",
                 c.seq, ")");
    };
  };

  for (size_t done = 0; done < count || done == 0;) {
    const size_t len = std::min(chunkElems, count - done);
    const uint64_t k = mine.posted.load(std::memory_order_relaxed);  // this chunk's number, from 0
    const size_t halfAt = size_t(k % 2) * w->halfBytes();

    // 1. The half is free once everyone has gathered the chunk before last.
    if (k >= 2) {
      w->waitFor(all(&WindowControl::gathered, k - 1), c.deadline, lagging(&WindowControl::gathered, k - 1, "gathered"));
    }
    // 2. Post my part, with the op's identity.
    std::memcpy(w->window(me) + halfAt, out + done * es, len * es);
    mine.seq.store(c.seq, std::memory_order_relaxed);
    mine.count.store(count, std::memory_order_relaxed);
    mine.kind.store(uint32_t(c.kind), std::memory_order_relaxed);
    mine.dtype.store(uint32_t(c.dtype), std::memory_order_relaxed);
    mine.posted.store(k + 1, std::memory_order_seq_cst);
    w->publish();
    // 3. Everyone's part is in; all of them run this op.
    w->waitFor(all(&WindowControl::posted, k + 1), c.deadline, lagging(&WindowControl::posted, k + 1, "posted"));
    for (int r = 0; r < n; ++r) {
      WindowControl& p = w->control(r);
      const uint64_t seq = p.seq.load(), cnt = p.count.load();
      const uint32_t kind = p.kind.load(), dtype = p.dtype.load();
      if (seq != c.seq || cnt != count || kind != uint32_t(c.kind) || dtype != uint32_t(c.dtype)) {
        w->fail(str("collx rank ", me, ": mismatched collective with peer ", r, ": peer runs ",
                    describeOp(seq, cnt, kind, dtype), ", this rank ",
                    describeOp(c.seq, count, uint32_t(c.kind), uint32_t(c.dtype)),
                    ". Every rank must call the same collectives in the same order with the same sizes and dtypes."));
      }
    }
    // 4. Reduce my slice from every window into mine.
    auto sliceAt = [&](int r) { return len * size_t(r) / size_t(n); };
    const size_t lo = sliceAt(me), hi = sliceAt(me + 1);
    if (hi > lo) {
      char* dst = w->window(me) + halfAt + lo * es;
      for (int r = 0; r < n; ++r) {
        if (r != me) fn(dst, w->window(r) + halfAt + lo * es, hi - lo);
      }
    }
    mine.reduced.store(k + 1, std::memory_order_seq_cst);
    w->publish();
    // 5. Gather every slice into the buffer.
    w->waitFor(all(&WindowControl::reduced, k + 1), c.deadline, lagging(&WindowControl::reduced, k + 1, "reduced"));
    for (int r = 0; r < n; ++r) {
      const size_t a = sliceAt(r), b = sliceAt(r + 1);
      std::memcpy(out + (done + a) * es, w->window(r) + halfAt + a * es, (b - a) * es);
    }
    mine.gathered.store(k + 1, std::memory_order_seq_cst);
    w->publish();
    done += std::max<size_t>(len, 1);
  }
}

}  // namespace collx

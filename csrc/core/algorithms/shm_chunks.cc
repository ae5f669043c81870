#include "shm_chunks.h"

#include "../error.h"

namespace collx {

namespace {

SharedWindows& windowsOf(const Collective& c) {
  SharedWindows* w = c.transport.sharedWindows();
  COLLX_CHECK(w, "collx rank ", c.rank(), ": ", name(c.kind), " in shared memory needs every rank on this host, ",
              "linked by shared memory (COLLX_TRANSPORT=auto or shm)");
  return *w;
}

// `shape` as WindowControl::shapeOf packs it.
std::string describeOp(uint64_t seq, uint64_t count, uint64_t shape) {
  const OpKind kind = OpKind(shape & 0xff);
  return str(name(kind), " #", seq, " (", count, " x ", name(DataType(shape >> 8 & 0xff)),
             kind == OpKind::kBroadcast ? str(", root ", uint32_t(shape >> 32)) : std::string(), ")");
}

}  // namespace

ShmChunks::ShmChunks(const Collective& c, uint64_t count, uint32_t root)
    : c_(c), w_(windowsOf(c)), mine_(w_.control(c.rank())), count_(count),
      shape_(WindowControl::shapeOf(uint32_t(c.kind), uint32_t(c.dtype), root)) {}

void ShmChunks::waitAll(Counter which, uint64_t k, const char* step) {
  const int n = c_.size();
  SharedWindows& w = w_;
  w.waitFor(
      [&w, which, k, n] {
        for (int r = 0; r < n; ++r) {
          if ((w.control(r).*which).load(std::memory_order_seq_cst) < k) return false;
        }
        return true;
      },
      c_.deadline,
      [&] {
        std::string who;
        std::vector<int> lagging;
        for (int r = 0; r < n; ++r) {
          if ((w.control(r).*which).load() >= k) continue;
          who += str(who.empty() ? "" : ", ", r);
          lagging.push_back(r);
        }
        w.noteMissing(std::move(lagging));
        return str("peer(s) ", who, " to have ", step, " ", k, " chunk(s) in shared memory (", name(c_.kind), " #",
                   c_.seq, ")");
      });
}

void ShmChunks::begin() {
  w_.checkGroup(c_.seq);
  // No wait: this rank's last post() saw every peer post chunk k_, so every
  // peer has gathered chunk k_ - 1, whose half chunk k_ + 1 takes (shm_chunks.h).
  k_ = mine_.posted.load(std::memory_order_relaxed);
}

void ShmChunks::post() {
  WindowControl::Op& op = mine_.op[k_ % 2];
  op.seq.store(c_.seq, std::memory_order_relaxed);
  op.count.store(count_, std::memory_order_relaxed);
  op.shape.store(shape_, std::memory_order_relaxed);
  mine_.posted.store(k_ + 1, std::memory_order_seq_cst);
  w_.publish();
  waitAll(&WindowControl::posted, k_ + 1, "posted");
  // A peer posts after its earlier messages left: a cancel of an op it
  // rejected, or the data of one this rank rejected, is in its channel now.
  w_.checkGroup(c_.seq);
  checkIdentity();
}

void ShmChunks::checkIdentity() {
  for (int r = 0; r < c_.size(); ++r) {
    const WindowControl::Op& p = w_.control(r).op[k_ % 2];
    const uint64_t seq = p.seq.load(), count = p.count.load(), shape = p.shape.load();
    if (seq != c_.seq || count != count_ || shape != shape_) {
      w_.fail(str("collx rank ", c_.rank(), ": mismatched collective with peer ", r, ": peer runs ",
                  describeOp(seq, count, shape), ", this rank ", describeOp(c_.seq, count_, shape_),
                  ". Every rank must call the same collectives in the same order with the same sizes and dtypes."));
    }
  }
}

void ShmChunks::postAddresses(const void* const* addresses, size_t count) {
  COLLX_CHECK(count * sizeof(uint64_t) <= w_.halfBytes(), "collx rank ", c_.rank(),
              ": a shared window is too small for ", count, " addresses");
  auto* table = reinterpret_cast<uint64_t*>(half(c_.rank()));  // post() publishes it
  for (size_t i = 0; i < count; ++i) table[i] = uint64_t(uintptr_t(addresses[i]));
}

void ShmChunks::readReduce(int r, size_t i, size_t offset, char* dst, size_t count, const ReduceFn& fn,
                           const char* from) {
  // Per thread, apart from the group's workspace, which the caller's data
  // may lie in. Each piece lands at its source's page offset, where the
  // kernel's copy does not crawl (copy.h); pieces are whole pages.
  alignas(4096) thread_local char scratch[kReadPieceBytes + 4096];
  const uint64_t source = reinterpret_cast<const uint64_t*>(half(r))[i] + offset;
  char* const at = scratch + source % 4096;
  const size_t es = elementSize(c_.dtype), pieceElems = std::max<size_t>(1, kReadPieceBytes / es);
  for (size_t done = 0; done < count; done += pieceElems) {
    const size_t len = std::min(pieceElems, count - done);
    read(r, i, offset + done * es, at, len * es);
    fn.fused(dst + done * es, from + done * es, at, nullptr, len, es);
  }
}

void ShmChunks::reduced() {
  mine_.reduced.store(k_ + 1, std::memory_order_seq_cst);
  w_.publish();
  waitAll(&WindowControl::reduced, k_ + 1, "reduced");
}

void ShmChunks::gathered() {
  // Ops without a reduction step move `reduced` along too, so that an
  // all-reduce after them waits for the right count.
  mine_.reduced.store(k_ + 1, std::memory_order_relaxed);
  mine_.gathered.store(k_ + 1, std::memory_order_seq_cst);
  w_.publish();
}

}  // namespace collx

#include "peer_allreduce.h"

#include <algorithm>

#include "core/algorithms/algorithms.h"
#include "core/error.h"

namespace collx::torch_glue {

namespace {

// A rank's vote at a barrier; the group takes the smallest.
enum Vote : int32_t {
  kFailed = 0,  // a CUDA call failed: every rank raises
  kWhole = 1,   // stage, without the pipeline (see Outcome)
  kStage = 2,   // stage
  kGo = 3,
};

// The host barrier: a tiny all-reduce of every rank's vote, on the op's own
// frames (every rank runs the same steps) and without the refiner, which
// learns the group's own ops. It also carries a key of the op's count and
// dtype, so that ranks whose ops differ raise, as any mismatched collective
// does (a rank in a plain all-reduce beside it fails on the frames), and
// never map buffers of different sizes.
struct Votes {
  Vote least, most;
  bool flagged;  // a rank raised its flag (what it means is the caller's)
};
Votes agree(const Collective& c, Vote mine, size_t count, bool flag = false) {
  const int64_t key = int64_t(count) * 32 + int64_t(c.dtype);
  // MIN of each: the least and the largest vote and key, and whether a rank flags.
  int64_t x[5] = {mine, -int64_t(mine), key, -key, -int64_t(flag)};
  Collective v = c;
  v.dtype = DataType::kInt64;
  v.refiner = nullptr;
  collx::allreduce(v, Algorithm::kAuto, x, 5, cpuReduceFn(DataType::kInt64, ReduceOp::kMin));
  if (x[2] != key || -x[3] != key) {
    auto op = [](int64_t k) { return collx::str(k / 32, " x ", name(DataType(k % 32))); };
    throw Error(collx::str("collx rank ", c.rank(), ": mismatched collective: the ranks run all_reduce #", c.seq,
                           " on ", op(x[2]), " to ", op(-x[3]), ", this rank on ", op(key),
                           ". Every rank must call the same collectives in the same order with the same sizes "
                           "and dtypes."));
  }
  return {Vote(x[0]), Vote(-x[1]), x[4] < 0};
}

// Runs fn; a failure turns the vote to kFailed and keeps the reason.
template <typename Fn>
void attempt(Vote& vote, std::string& why, Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    vote = kFailed;
    why = e.what();
  }
}

[[noreturn]] void failed(const std::string& why) {
  throw Error(why.empty() ? std::string("another rank failed its part of the device all-reduce (see its error)")
                          : why);
}

}  // namespace

PeerAllreduce::Outcome PeerAllreduce::run(Staging* st, bool claimed, const Collective& c, const at::Tensor& tensor,
                                           DataType dtype, ReduceOp op) {
  const size_t bytes = size_t(tensor.nbytes());
  if (bytes == 0) return Outcome::kDone;
  const size_t esize = elementSize(dtype), count = bytes / esize;
  if (hostGroup_) return Outcome::kStageWhole;
  // Without buffers, a rank whose tensor cannot be pipelined still makes
  // every rank stage in one piece.
  const Vote v = noBuffers_ ? agree(c, st && claimed ? kStage : kWhole, count).least
                            : Vote(ready(st, c, count, std::min(bytes, maxBytes_)));
  if (v == kWhole) return Outcome::kStageWhole;
  if (v == kStage) return Outcome::kStage;
  const size_t step = buffers_->bytes() / esize * esize;
  char* data = static_cast<char*>(tensor.data_ptr());
  // The buffers are mapped for one device; a tensor elsewhere is staged.
  Vote mine = !st || !claimed ? kWhole : st->device() == device_ ? kGo : kStage;
  for (size_t at = 0; at < bytes; at += step) {
    const size_t len = std::min(step, bytes - at);
    std::string why;
    if (mine == kGo) {
      attempt(mine, why, [&] {
        st->deviceCopy(buffers_->mine(), data + at, len);
        st->synchronize();
      });
    }
    // At the first chunk: a rank's kWhole or kStage holds for the whole op.
    const Vote all = agree(c, mine, count).least;
    if (all == kWhole) return Outcome::kStageWhole;
    if (all == kStage) return Outcome::kStage;
    if (all == kFailed) failed(why);
    attempt(mine, why, [&] {
      st->deviceCopy(data + at, buffers_->of(0), len);
      for (int r = 1; r < c.size(); ++r) st->deviceReduce(dtype, op, data + at, buffers_->of(r), len / esize);
      st->synchronize();
    });
    if (agree(c, mine, count).least != kGo) failed(why);
    counters_.add(Carrier::kDevicePeers, len, size_t(c.size() - 1) * len);  // sent: in this rank's buffer
  }
  return Outcome::kDone;
}

bool PeerAllreduce::stagesWhole(const Collective& c, bool host, bool pipelines, size_t count) {
  if (hostGroup_) return true;
  // The flag: this rank has a device tensor.
  const Votes all = agree(c, pipelines ? kStage : kWhole, count, !host);
  if (!all.flagged) hostGroup_ = true;
  return all.least == kWhole;
}

int PeerAllreduce::ready(Staging* st, const Collective& c, size_t count, size_t bytes) {
  if (buffers_ && buffers_->bytes() >= bytes) return kGo;
  // Every rank gets here at the same op, for the same size. No rank reads
  // the old buffers any more: the last op ended with barrier 2.
  buffers_.reset();
  size_t want = 1 << 20;
  while (want < bytes) want *= 2;
  want = std::min(want, maxBytes_);

  // A vote first: a rank that cannot take part says so before any exchange.
  // The flag: this rank cannot make or map its buffer.
  std::string why;
  std::unique_ptr<PeerBuffers> made;
  Votes all{};
  if (!st) {
    all = agree(c, kWhole, count);
  } else {
    PeerBuffers::Blob mine{};
    try {
      made = st->newPeerBuffers(want, c.rank(), c.size());
      mine = made->exported();
    } catch (const std::exception& e) {
      why = e.what();
    }
    all = agree(c, why.empty() ? kGo : kStage, count, !why.empty());
    if (all.least == kGo) {
      std::vector<PeerBuffers::Blob> blobs(size_t(c.size()));
      blobs[size_t(c.rank())] = mine;
      collx::allgather(c, blobs.data(), PeerBuffers::kBlobBytes / elementSize(c.dtype));
      try {
        why = made->attach(blobs);
      } catch (const std::exception& e) {
        why = e.what();
      }
      all = agree(c, why.empty() ? kGo : kStage, count, !why.empty());
      made->attached();
    }
  }
  if (all.least == kGo) {
    buffers_ = std::move(made);
    device_ = st->device();
    if (logLevel_ >= LogLevel::kInfo) {
      logLine(LogLevel::kInfo, c.rank(), c.size(),
              collx::str("all_reduce of device tensors through the ranks' mapped device buffers (", want, " B each)"));
    }
    return kGo;
  }
  // A CPU tensor beside device ones: this op only. Every rank's a CPU
  // tensor: from now on. A device rank that cannot make or map its buffer
  // (also beside CPU tensors): from now on, and it says why once.
  if (all.flagged) {
    noBuffers_ = true;
    if (st && logLevel_ >= LogLevel::kInfo) {
      logLine(LogLevel::kInfo, c.rank(), c.size(),
              collx::str("all_reduce of device tensors is staged through host memory: ",
                         why.empty() ? std::string("another rank cannot make or map its device buffer") : why));
    }
  } else if (all.most == kWhole) {
    hostGroup_ = true;
  }
  return all.least;
}

}  // namespace collx::torch_glue

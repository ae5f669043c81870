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
// A blob's byte 1: the rank's tensor is a host tensor.
constexpr int kHostTensor = 1;

// The host barrier: a tiny all-reduce of the votes, on the op's own frames
// (every rank runs the same steps) and without the refiner, which learns
// the group's own ops.
Vote agree(const Collective& c, Vote mine) {
  Collective v = c;
  v.dtype = DataType::kInt32;
  v.refiner = nullptr;
  int32_t x = mine;
  collx::allreduce(v, Algorithm::kAuto, &x, 1, cpuReduceFn(DataType::kInt32, ReduceOp::kMin));
  return Vote(x);
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
  if (unavailable_ || !ready(st, c, std::min(bytes, maxBytes_))) return staged();
  const size_t esize = elementSize(dtype);
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
    const Vote all = agree(c, mine);
    if (all == kWhole) return Outcome::kStageWhole;
    if (all == kStage) return Outcome::kStage;
    if (all == kFailed) failed(why);
    attempt(mine, why, [&] {
      st->deviceCopy(data + at, buffers_->of(0), len);
      for (int r = 1; r < c.size(); ++r) st->deviceReduce(dtype, op, data + at, buffers_->of(r), len / esize);
      st->synchronize();
    });
    if (agree(c, mine) != kGo) failed(why);
  }
  return Outcome::kDone;
}

bool PeerAllreduce::ready(Staging* st, const Collective& c, size_t bytes) {
  if (buffers_ && buffers_->bytes() >= bytes) return true;
  // Every rank gets here at the same op, for the same size. No rank reads
  // the old buffers any more: the last op ended with barrier 2.
  buffers_.reset();
  size_t want = 1 << 20;
  while (want < bytes) want *= 2;
  want = std::min(want, maxBytes_);

  std::string why;
  std::unique_ptr<PeerBuffers> made;
  std::vector<PeerBuffers::Blob> blobs(size_t(c.size()));
  if (!st) {
    why = "this rank's tensor is a CPU tensor";
    blobs[size_t(c.rank())][1] = kHostTensor;
  } else {
    try {
      made = st->newPeerBuffers(want, c.rank(), c.size());
      blobs[size_t(c.rank())] = made->exported();
    } catch (const std::exception& e) {
      why = e.what();
    }
  }
  collx::allgather(c, blobs.data(), PeerBuffers::kBlobBytes / elementSize(c.dtype));
  for (int r = 0; r < c.size(); ++r) {
    const PeerBuffers::Blob& b = blobs[size_t(r)];
    hostRank_ = hostRank_ || b[1] == kHostTensor;
    if (why.empty() && b[0] != 1) {
      why = b[1] == kHostTensor ? collx::str("rank ", r, "'s tensor is a CPU tensor")
                                : collx::str("rank ", r, " could not make its device buffer");
    }
  }
  if (why.empty()) {
    try {
      why = made->attach(blobs);
    } catch (const std::exception& e) {
      why = e.what();
    }
  }
  const bool ok = agree(c, why.empty() ? kGo : kStage) == kGo;
  if (made) made->attached();
  if (!ok) {
    unavailable_ = true;
    if (st && logLevel_ >= LogLevel::kInfo) {  // ranks of host tensors expect nothing else
      logLine(LogLevel::kInfo, c.rank(), c.size(),
              collx::str("all_reduce of device tensors is staged through host memory: ",
                         why.empty() ? std::string("another rank cannot map the group's device buffers") : why));
    }
    return false;
  }
  buffers_ = std::move(made);
  device_ = st->device();
  if (logLevel_ >= LogLevel::kInfo) {
    logLine(LogLevel::kInfo, c.rank(), c.size(),
            collx::str("all_reduce of device tensors through the ranks' mapped device buffers (", want, " B each)"));
  }
  return true;
}

}  // namespace collx::torch_glue

// All-reduce of a device tensor that stays on the device: the ranks of an
// all-local group map each other's device buffers (CUDA IPC), so no byte
// crosses PCIe or a socket. Staging it through host memory instead costs a
// D2H and an H2D copy of the whole tensor around the host op, which with
// ranks sharing a GPU cost about as much as the op itself.
//
// Per chunk of at most one buffer (every rank runs the same steps, on its
// op stream, and the host barriers are tiny all-reduces of a vote):
//
//   rank r                                      every rank
//   copy chunk of its tensor -> buf[r], sync
//                                               barrier 1: every buf is full
//   tensor chunk = buf[0]; op= buf[1] ...
//   op= buf[n-1] (rank order, so every rank
//   gets bit-identical results), sync
//                                               barrier 2: no one reads bufs
//
// The buffers are made at the first such op (a collective exchange of the
// blobs of peer_buffers.h), grown as tensors grow, up to maxBytes. Every rank
// of an op that may go this way takes part, also one whose tensor is a CPU
// tensor (gloo reduces such mixed groups, so collx must too): it votes no,
// and every rank stages that op. A group where every rank's tensor is a CPU
// tensor stages every later op in one piece, with no vote. A group where a
// device rank cannot make or map its buffer (no memory, another GPU, no
// IPC), also beside CPU tensors, stages every later op too, without trying
// the buffers again. An op where a rank's tensor cannot go this way (on
// another device, not contiguous) is staged by the same vote.
#pragma once

#include <ATen/ATen.h>

#include <memory>

#include "core/algorithms/collective.h"
#include "log.h"
#include "peer_buffers.h"
#include "staging.h"

namespace collx::torch_glue {

class PeerAllreduce {
 public:
  // maxBytes: the largest buffer a rank maps (COLLX_PEER_BUFFER_BYTES).
  PeerAllreduce(size_t maxBytes, LogLevel logLevel) : maxBytes_(maxBytes), logLevel_(logLevel) {}

  enum class Outcome {
    kDone,        // all-reduced
    kStage,       // stage on the host, pipelined or not, as each rank would
    kStageWhole,  // stage on the host in one piece: a rank's tensor cannot be
                  // pipelined (a CPU tensor), and the ops must match
  };
  // Executor thread; every rank of the op calls it. All-reduces `tensor` in
  // place with `op`, or says how every rank stages it instead (then the
  // tensor is untouched). `st`: the op's staging, null for a host tensor;
  // `claimed`: its mirror is left to this op (Staging::claim), so `tensor` is
  // the contiguous device tensor. Throws Error when a rank failed (the tensor
  // may then be partly reduced).
  Outcome run(Staging* st, bool claimed, const Collective& c, const at::Tensor& tensor, DataType dtype,
              ReduceOp op);

  // Executor thread; every rank of an all-reduce of `count` elements that
  // does not take run() but that a rank may pipeline calls it. Whether every
  // rank stages it in one piece: true when a rank cannot pipeline (a CPU
  // tensor beside device ones), so that the ranks run the same ops. Votes
  // until a vote finds every rank on host tensors.
  bool stagesWhole(const Collective& c, bool host, bool pipelines, size_t count);
  // Bytes moved through the mapped buffers (Carrier::kDevicePeers); any thread.
  TransportCounters counters() const { return counters_.snapshot(); }

 private:
  // Maps buffers of >= `bytes` (grown to a power of two) for an op on
  // `count` elements. Returns the group's vote, alike on every rank: go, or
  // how to stage this op (peer_allreduce.cc's Vote).
  int ready(Staging* st, const Collective& c, size_t count, size_t bytes);

  SharedCounters counters_;
  const size_t maxBytes_;
  const LogLevel logLevel_;
  std::unique_ptr<PeerBuffers> buffers_;
  c10::Device device_{at::kCPU};  // of buffers_
  bool hostGroup_ = false;        // every rank had a host tensor: stage whole from now on
  bool noBuffers_ = false;        // a rank cannot make or map a buffer: stage from now on
};

}  // namespace collx::torch_glue

// Point-to-point ops of CollxBackend. A send or receive runs on the group's
// executor in issue order, like a collective (NCCL's rule), so one that is
// waiting for its peer holds back later ops of the group. Between
// startCoalescing and endCoalescing (batch_isend_irecv) the ops are recorded
// and then posted all at once, so a batch may hold sends and receives that
// depend on each other.
#include "backend.h"
#include "op_helpers.h"
#include "work.h"

namespace collx::torch_glue {

namespace {

void checkPeer(int peer, int rank, int size, const char* op) {
  if (peer < 0 || peer >= size) {
    fail(op, rank, collx::str("peer rank ", peer, " is out of range for a group of size ", size));
  }
  if (peer == rank) fail(op, rank, "a rank cannot send to or receive from itself");
}

}  // namespace

c10::intrusive_ptr<c10d::Work> CollxBackend::runP2P(std::vector<P2POp> ops, c10d::OpType type) {
  auto source = std::make_shared<std::atomic<int>>(-1);
  std::vector<at::Tensor> outputs;
  for (const auto& op : ops) {
    if (!op.isSend) outputs.push_back(op.tensor);
  }
  const DataType dtype = ops.empty() ? DataType::kUInt8 : coreDtype(ops[0].tensor, "send/recv", rank_);
  auto body = [this, ops, source](const Collective& c) {
    std::vector<Transfer> sends, recvs;
    std::vector<at::Tensor> bufs;
    for (const auto& op : ops) {
      int peer = op.peer;
      if (peer < 0) {
        peer = c.transport.waitForMessage(OpKind::kP2P, uint32_t(op.tag), c.deadline);
        source->store(peer);
      }
      bufs.push_back(contiguousOf(op.tensor));
      const at::Tensor& b = bufs.back();
      uint64_t seq = op.isSend ? p2pSent_[peer]++ : p2pReceived_[peer]++;
      Frame f{OpKind::kP2P, coreDtype(b, "send/recv", rank_), seq, uint32_t(op.tag)};
      (op.isSend ? sends : recvs).push_back({peer, b.data_ptr(), size_t(b.nbytes()), f});
    }
    exchange(c, sends, recvs);
    for (size_t i = 0; i < ops.size(); ++i) {
      if (!ops[i].isSend && bufs[i].data_ptr() != ops[i].tensor.data_ptr()) ops[i].tensor.copy_(bufs[i]);
    }
    return std::string("send_recv/direct");
  };
  auto work = enqueue(type, OpKind::kP2P, dtype, outputs, timeout_, std::move(body), /*collective=*/false);
  if (ops.size() == 1 && !ops[0].isSend && ops[0].peer < 0) work->setSourceSlot(source);
  return work;
}

c10::intrusive_ptr<c10d::Work> CollxBackend::addP2P(P2POp op, c10d::OpType type) {
  const char* name = op.isSend ? "send" : "recv";
  std::unique_lock<std::mutex> lock(coalesceMutex_);
  if (coalescing_) {
    // The batch's device tensors share one staging, which goes with its one
    // Work; CPU tensors need none.
    if (!coalescedStaging_) coalescedStaging_ = stagingFor({op.tensor}, name);
    if (coalescedStaging_ && coalescedStaging_->owns(op.tensor.device())) {
      op.tensor = coalescedStaging_->mirror(op.tensor, op.isSend, !op.isSend);
    } else if (!op.tensor.device().is_cpu()) {
      fail(name, rank_, collx::str("a coalesced batch holds tensors of one device only, got ", op.tensor.device()));
    }
    checkTensor(op.tensor, name, rank_);  // the host tensor: a device one is mirrored by now
    coalesced_.push_back(std::move(op));
    return nullptr;  // the batch's Work comes from endCoalescing
  }
  lock.unlock();
  auto onHost = [&](at::Tensor& host) { return addP2P({op.isSend, op.peer, op.tag, host}, type); };
  if (auto w = onMirror(name, op.tensor, op.isSend, !op.isSend, onHost)) return w;
  checkTensor(op.tensor, name, rank_);
  return runP2P({op}, type);
}

c10::intrusive_ptr<c10d::Work> CollxBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  checkSingle(tensors, "send", rank_);
  checkPeer(dstRank, rank_, size_, "send");
  return addP2P({true, dstRank, tag, tensors[0]}, c10d::OpType::SEND);
}

c10::intrusive_ptr<c10d::Work> CollxBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  checkSingle(tensors, "recv", rank_);
  checkPeer(srcRank, rank_, size_, "recv");
  return addP2P({false, srcRank, tag, tensors[0]}, c10d::OpType::RECV);
}

c10::intrusive_ptr<c10d::Work> CollxBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  checkSingle(tensors, "recv", rank_);
  {
    std::lock_guard<std::mutex> lock(coalesceMutex_);
    if (coalescing_) fail("recv", rank_, "a receive from any source cannot be part of a coalesced batch");
  }
  if (auto w = onMirror("recv", tensors, false, true, [&](auto& host) { return recvAnysource(host, tag); })) {
    return w;
  }
  checkTensor(tensors[0], "recv", rank_);
  return runP2P({{false, -1, tag, tensors[0]}}, c10d::OpType::RECVANYSOURCE);
}

void CollxBackend::startCoalescing() {
  std::lock_guard<std::mutex> lock(coalesceMutex_);
  if (coalescing_) fail("start_coalescing", rank_, "coalescing already started");
  coalescing_ = true;
}

c10::intrusive_ptr<c10d::Work> CollxBackend::endCoalescing() {
  std::vector<P2POp> ops;
  std::shared_ptr<Staging> staging;
  {
    std::lock_guard<std::mutex> lock(coalesceMutex_);
    if (!coalescing_) fail("end_coalescing", rank_, "coalescing was not started");
    coalescing_ = false;
    ops.swap(coalesced_);
    staging.swap(coalescedStaging_);
  }
  // With no p2p recorded (collectives coalesce in Python), this still returns
  // a Work that completes after everything issued before it.
  if (staging) return runStaged(staging, [&] { return runP2P(std::move(ops), c10d::OpType::COALESCED); });
  return runP2P(std::move(ops), c10d::OpType::COALESCED);
}

}  // namespace collx::torch_glue

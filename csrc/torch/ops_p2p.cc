// Point-to-point ops of CollxBackend, with gloo's semantics: each send and
// receive is posted at once on the transport's p2p channel
// (core/transport/p2p.h) and progresses there on its own, beside the
// collectives and the other p2p ops; messages match by peer and tag. Between
// startCoalescing and endCoalescing (batch_isend_irecv) the ops are recorded,
// then posted together under one Work.
//
// Device tensors go through host mirrors (staging.h): a send's data is copied
// down before it is posted, in the caller's thread; a receive's is copied up
// when the last op of its Work completes.
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

// The ops of one Work in flight: they share it, and the last to complete
// finishes it. Holds the tensors (and their contiguous stand-ins) until then.
struct P2PBatch {
  std::vector<at::Tensor> tensors, bufs;
  std::vector<bool> isRecv;
  std::shared_ptr<Staging> staging;
  c10::intrusive_ptr<CollxWork> work;
  std::shared_ptr<OpTrace> trace;  // the flight recorder's entry, "started" once posted
  std::shared_ptr<std::atomic<int>> source;
  std::string describe;  // "collx send (float32) failed on rank 0: "
  // Stats and log lines, once finished; `failure`: a timeout or a peer's end
  // (for getError), else kNone.
  std::function<void(const std::string& error, tcp::Device::Failure failure)> report;
  std::atomic<size_t> left{0};
  std::mutex mu;
  std::string error;  // the first op's error, if any
  tcp::Device::Failure failure = tcp::Device::Failure::kNone;

  void onDone(int src, std::exception_ptr e) {
    if (e) {
      std::lock_guard<std::mutex> lock(mu);
      if (error.empty()) {
        try {
          std::rethrow_exception(e);
        } catch (const TimeoutError& ex) {
          error = ex.what();
          failure = tcp::Device::Failure::kTimeout;
        } catch (const PeerClosedError& ex) {
          error = ex.what();
          failure = tcp::Device::Failure::kRemote;
        } catch (const std::exception& ex) {
          error = ex.what();
        }
      }
    }
    if (source && src >= 0) source->store(src);
    if (--left == 0) finish();
  }

  void finish() {
    std::exception_ptr failure;
    try {
      if (error.empty()) {
        for (size_t i = 0; i < tensors.size(); ++i) {
          if (isRecv[i] && bufs[i].data_ptr() != tensors[i].data_ptr()) tensors[i].copy_(bufs[i]);
        }
        if (staging) staging->copyOut();
      }
    } catch (const std::exception& ex) {
      error = ex.what();
    }
    if (!error.empty()) failure = distError(describe + error);
    report(error, this->failure);
    if (trace) trace->retire(error.empty());
    work->complete(failure);
  }
};

}  // namespace

c10::intrusive_ptr<c10d::Work> CollxBackend::postP2P(std::vector<P2POp> ops, c10d::OpType type) {
  const char* what = ops.size() == 1 ? (ops[0].isSend ? "send" : "recv") : "batch_isend_irecv";
  auto batch = std::make_shared<P2PBatch>();
  std::vector<at::Tensor> outputs;
  for (const auto& op : ops) {
    if (!op.isSend) outputs.push_back(op.tensor);
  }
  const DataType dtype = ops.empty() ? DataType::kUInt8 : coreDtype(ops[0].tensor, what, rank_);
  batch->staging = Staging::current();
  std::vector<c10::Device> devices;
  if (batch->staging) {
    outputs = batch->staging->deviceOf(outputs);  // the user's tensors, not the mirrors
    devices = batch->staging->devices();
    asDistError(what, rank_, [&] {
      batch->staging->recordCaller();
      batch->staging->copyIn();  // the sends' data, before they leave
      return 0;
    });
  }
  batch->work = c10::make_intrusive<CollxWork>(type, nullptr, std::move(outputs), seq_.load(), std::move(devices));
  batch->work->spinOn(device().sharedP2P());
  if (config_.tracing && OpTrace::wanted()) {
    // NCCL's names: "send 0->1", "recv 1<-0" (group ranks).
    std::string op = what;
    if (ops.size() == 1) {
      const std::string peer = ops[0].peer == kAnySource ? "any" : std::to_string(ops[0].peer);
      op = ops[0].isSend ? collx::str("send ", rank_, "->", peer) : collx::str("recv ", rank_, "<-", peer);
    }
    std::vector<at::Tensor> sends;
    for (const auto& o : ops) {
      if (o.isSend) sends.push_back(o.tensor);
    }
    batch->trace = std::make_shared<OpTrace>(trace_, pgName(), rank_, size_, op, ++p2pSeq_, true,
                                             batch->staging ? batch->staging->deviceOf(sends) : sends,
                                             batch->work->result(), timeout());
  }
  if (ops.size() == 1 && !ops[0].isSend && ops[0].peer == kAnySource) {
    batch->source = std::make_shared<std::atomic<int>>(-1);
    batch->work->setSourceSlot(batch->source);
  }
  batch->describe = collx::str("collx ", what, " (", name(dtype), ") failed on rank ", rank_, ": ");
  for (const auto& op : ops) {
    batch->tensors.push_back(op.tensor);
    batch->bufs.push_back(contiguousOf(op.tensor));
    batch->isRecv.push_back(!op.isSend);
  }
  const auto start = Clock::now();
  batch->report = [this, what, dtype, n = ops.size(), staged = bool(batch->staging), start,
                   describe = batch->describe](const std::string& error, tcp::Device::Failure failure) {
    if (!error.empty()) {
      noteFailure(failure);
      if (logs(LogLevel::kWarn)) log(LogLevel::kWarn, describe + error);
      return;
    }
    const double secs = std::chrono::duration<double>(Clock::now() - start).count();
    {
      std::lock_guard<std::mutex> lock(statsMutex_);
      stats_.ops += n;
      if (staged) ++stats_.stagedOps;
      auto& s = stats_.perAlgorithm["send_recv/p2p"];
      s.calls += n;
      s.seconds += secs;
    }
    if (logs(LogLevel::kTrace)) {
      log(LogLevel::kTrace, collx::str(what, " (", name(dtype), "): ", n, " op(s), send_recv/p2p", staged ? " staged" : "",
                                       ", ", collx::str(secs * 1e3), " ms"));
    }
  };
  // Keeps the Work from completing before every op is posted.
  batch->left = ops.size() + 1;
  const Deadline deadline = Clock::now() + timeout();
  for (size_t i = 0; i < ops.size(); ++i) {
    const at::Tensor& b = batch->bufs[i];
    P2PBuffer buffer{b.data_ptr(), size_t(b.nbytes()), coreDtype(b, what, rank_)};
    auto done = [batch](int src, std::exception_ptr e) { batch->onDone(src, e); };
    if (ops[i].isSend) {
      device().p2p().postSend(ops[i].peer, uint32_t(ops[i].tag), buffer, deadline, std::move(done));
    } else {
      device().p2p().postRecv(ops[i].peer, uint32_t(ops[i].tag), buffer, deadline, std::move(done));
    }
  }
  if (batch->trace) batch->trace->posted();
  batch->onDone(-1, nullptr);
  return batch->work;
}

c10::intrusive_ptr<c10d::Work> CollxBackend::addP2P(P2POp op, c10d::OpType type) {
  const char* name = op.isSend ? "send" : "recv";
  std::unique_lock<std::mutex> lock(coalesceMutex_);
  if (coalescing_) {
    if (op.peer == kAnySource) fail("recv", rank_, "a receive from any source cannot be part of a coalesced batch");
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
  return postP2P({op}, type);
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
  return addP2P({false, kAnySource, tag, tensors[0]}, c10d::OpType::RECVANYSOURCE);
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
  if (ops.empty() && aborted_) {
    // _abort_process_group aborts inside a coalescing region: nothing to
    // wait for, and nothing may run.
    auto work = c10::make_intrusive<CollxWork>(c10d::OpType::COALESCED, nullptr, std::vector<at::Tensor>{}, seq_.load());
    work->complete(nullptr);
    return work;
  }
  if (ops.empty()) {
    // Collectives coalesce in Python: this Work completes after every op
    // issued before it, as the ordered executor runs them.
    auto none = [](const Collective&) { return std::string("coalesced/none"); };
    return enqueue(c10d::OpType::COALESCED, OpKind::kBarrier, DataType::kUInt8, {}, timeout(), none, false);
  }
  if (staging) return runStaged(staging, [&] { return postP2P(std::move(ops), c10d::OpType::COALESCED); });
  return postP2P(std::move(ops), c10d::OpType::COALESCED);
}

}  // namespace collx::torch_glue

// Reconfigure, torch 2.14's API as gloo has it. A handle names one process
// of one group:
//
//   collx:<group token>:<member>:<uuid>:<rank>
//
// The token is agreed in the group's store when a handle is first asked
// for, so a handle from another group (another store, or another group
// name) is refused; the member (host/pid/random) is the process's identity,
// which outlives reconfigures; uuid and rank are the current ones, for the
// reader. reconfigure(uuid, handles) fails whatever the old mesh had queued
// or in flight, then forms a new mesh of the handles' processes in the
// store, under the uuid: a list fixes the ranks in its order, a set ranks
// the handles in sorted order (every process sorts alike).
#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <optional>
#include <random>

#include "backend.h"
#include "op_helpers.h"
#include "work.h"

namespace collx::torch_glue {

namespace {

struct Handle {
  std::string token, member;
};

// Splits "collx:<token>:<member>:<uuid>:<rank>"; the member may hold no ':'.
std::optional<Handle> parse(const std::string& h) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (size_t i = 0; i <= h.size(); ++i) {
    if (i == h.size() || h[i] == ':') {
      parts.push_back(h.substr(start, i - start));
      start = i + 1;
    }
  }
  if (parts.size() != 5 || parts[0] != "collx" || parts[1].empty() || parts[2].empty()) return std::nullopt;
  return Handle{parts[1], parts[2]};
}

}  // namespace

std::string CollxBackend::get_reconfigure_handle() const {
  std::lock_guard<std::mutex> lock(hooksMutex_);
  if (groupToken_.empty()) {
    // The first process to ask sets the token; every other one reads it.
    std::random_device rd;
    const std::string mine = collx::str(rd(), rd());
    const std::vector<uint8_t> proposed(mine.begin(), mine.end());
    const std::vector<uint8_t> agreed = store_->compareSet("collx/reconfigure/token", {}, proposed);
    groupToken_.assign(agreed.begin(), agreed.end());
  }
  return collx::str("collx:", groupToken_, ":", member_, ":", uuid_, ":", rank_);
}

#ifdef C10D_BACKEND_HAS_RECONFIGURE
c10::intrusive_ptr<c10d::Work> CollxBackend::reconfigure(const c10d::ReconfigureOptions& opts) {
  auto fails = [&](const std::string& why) {
    C10_THROW_ERROR(DistBackendError, collx::str("collx reconfigure on rank ", rank_, ": ", why));
  };
  if (destroyed_) fails("the process group was destroyed");
  if (usedUuids_.count(opts.uuid)) {
    fails(collx::str("uuid ", opts.uuid, " was used before on this group: pass a fresh one each time"));
  }
  std::vector<std::string> handles;
  if (const auto* list = std::get_if<std::vector<std::string>>(&opts.handles)) {
    handles = *list;
  } else {
    const auto& set = std::get<std::unordered_set<std::string>>(opts.handles);
    handles.assign(set.begin(), set.end());
    std::sort(handles.begin(), handles.end());
  }
  if (handles.empty()) fails("no handles given");
  const std::string own = get_reconfigure_handle();
  int newRank = -1;
  std::vector<std::string> members;
  for (size_t i = 0; i < handles.size(); ++i) {
    const auto h = parse(handles[i]);
    if (!h) fails(collx::str("'", handles[i], "' is not a collx reconfigure handle"));
    if (h->token != groupToken_) {
      fails(collx::str("handle '", handles[i], "' belongs to another group (this group's token is ", groupToken_, ")"));
    }
    if (std::find(members.begin(), members.end(), h->member) != members.end()) {
      fails(collx::str("handle '", handles[i], "' is given twice"));
    }
    members.push_back(h->member);
    if (h->member == member_) newRank = int(i);
  }
  if (newRank < 0) fails(collx::str("this process's handle '", own, "' is not among the handles"));
  const auto limit = opts.timeout ? *opts.timeout : timeout();

  // Let go of the GIL first (see shutdown()); then the old mesh goes.
  std::optional<pybind11::gil_scoped_release> noGil;
  if (Py_IsInitialized() && PyGILState_Check()) noGil.emplace();
  {
    std::lock_guard<std::mutex> lock(lifecycleMutex_);
    const std::string why = collx::str("collx rank ", rank_, ": the process group was reconfigured (uuid ", opts.uuid,
                                       ") before this op finished");
    closeMesh(why, why, why, /*tellPeers=*/false);
    executor_ = std::make_shared<Executor>();
    {
      std::lock_guard<std::mutex> setup(setupMutex_);
      device_.reset();
      setupError_.clear();
      setupFailed_ = false;
    }
    setupInterrupted_ = false;
    refiner_ = std::make_unique<Refiner>();
    peers_ = std::make_unique<PeerAllreduce>(config_.peerBufferBytes, config_.logLevel);
    seq_ = 0;
    p2pFailure_ = tcp::Device::Failure::kNone;
    {
      std::lock_guard<std::mutex> hooks(hooksMutex_);
      hooksRan_ = false;
    }
    aborted_ = false;
    shutDown_ = false;
    usedUuids_.insert(opts.uuid);
    uuid_ = opts.uuid;
    rank_ = newRank;
    size_ = int(handles.size());
    const auto saved = timeout();
    timeout_ = limit;  // the mesh forms within the reconfigure's timeout
    try {
      connect(c10::make_intrusive<c10d::PrefixStore>(collx::str("collx/reconfigure/", opts.uuid, "/"), store_), rank_,
              size_);
    } catch (...) {
      timeout_ = saved;
      throw;
    }
    timeout_ = saved;
  }
  auto work = c10::make_intrusive<CollxWork>(c10d::OpType::UNKNOWN, nullptr, std::vector<at::Tensor>{}, 0);
  work->complete(nullptr);
  return work;
}
#endif

}  // namespace collx::torch_glue

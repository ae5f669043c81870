// The _C extension module: a backend factory and the stats accessor.
// Registration with torch.distributed happens in torchcollx/__init__.py.
#include <torch/python.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "backend.h"
#include "cast.h"
#include "core/algorithms/tuning.h"
#include "core/error.h"

namespace py = pybind11;
using collx::torch_glue::CollxBackend;

namespace {

// COLLX_DEVICE_REDUCE_MIN_BYTES, COLLX_STAGING_CHUNK_BYTES,
// COLLX_PEER_BUFFER_BYTES and COLLX_PEER_MIN_BYTES: a byte count, or "off"
// (SIZE_MAX: no reductions on the device; no pipelining; no all-reduce
// through peers' buffers).
size_t bytesOrOff(const char* name, size_t byDefault) {
  const char* v = std::getenv(name);
  if (!v) return byDefault;
  const std::string value(v);
  if (value == "off") return SIZE_MAX;
  const bool digits = !value.empty() && value.size() <= 18 &&
                      std::all_of(value.begin(), value.end(), [](unsigned char c) { return std::isdigit(c); });
  if (!digits) throw py::value_error(std::string("collx: ") + name + "=" + value + " must be a byte count or off");
  return size_t(std::stoull(value));
}

// An algorithm's name from Python; a bad one is a ValueError.
collx::Algorithm algorithmArg(const std::string& name) {
  try {
    return collx::parseAlgorithm(name.c_str());
  } catch (const collx::Error& e) {
    throw py::value_error(e.what());
  }
}

// COLLX_TUNING: calibrate (the default), table, or the path of a tuning file.
// Calibrations are cached under $XDG_CACHE_HOME/torchcollx, else
// ~/.cache/torchcollx.
collx::TuningPolicy tuningPolicy() {
  collx::TuningPolicy p;
  const char* home = std::getenv("HOME");
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) {
    p.cacheDir = std::string(xdg) + "/torchcollx";
  } else if (home && *home) {
    p.cacheDir = std::string(home) + "/.cache/torchcollx";
  }
  const char* v = std::getenv("COLLX_TUNING");
  const std::string value = v ? v : "calibrate";
  if (value == "calibrate") return p;
  if (value == "table") {
    p.mode = collx::TuningPolicy::Mode::kTable;
  } else if (value.empty()) {
    throw py::value_error("collx: COLLX_TUNING is empty: use calibrate, table, or the path of a tuning file");
  } else {
    p.mode = collx::TuningPolicy::Mode::kFile;
    p.file = value;
    try {
      collx::loadTuningFile(p);  // here, since the group tunes after its creation returned
    } catch (const collx::Error& e) {
      throw py::value_error(e.what());
    }
  }
  return p;
}

// A 0/1 environment variable, `unset` when it is not set.
bool flag(const char* name, bool unset) {
  const char* v = std::getenv(name);
  if (!v) return unset;
  const std::string value(v);
  if (value != "0" && value != "1") throw py::value_error(collx::str("collx: ", name, "=", value, " must be 0 or 1"));
  return value == "1";
}

c10::intrusive_ptr<c10d::Backend> createBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                int size, double timeoutSeconds, const std::string& algorithm,
                                                int treeArity, int64_t segmentBytes, const std::string& ifname,
                                                const std::string& family, const std::string& transport,
                                                bool connected, std::vector<uint64_t> globalRanks) {
  collx::torch_glue::Config config;
  try {
    config.algorithm = collx::parseAlgorithm(algorithm.c_str());
    config.family = collx::tcp::parseFamily(family);
    config.transport = collx::shm::parseMode(transport);
    const char* cma = std::getenv("COLLX_SHM_CMA");
    config.readPeers = collx::shm::parseReadPeers(cma ? cma : "");
  } catch (const collx::Error& e) {
    throw py::value_error(e.what());
  }
  config.treeArity = treeArity;
  config.segmentBytes = size_t(segmentBytes);
  config.ifname = ifname;
  config.globalRanks = std::move(globalRanks);
  // A test knob, so read here rather than in Options: CPU tensors take the
  // CUDA tensors' staging path (see staging.h).
  config.stageCpuTensors = flag("COLLX_STAGE_CPU_TENSORS", false);
  config.tracing = flag("COLLX_TRACING", true);
  // Between ranks on one host (rendezvous.cc); "system" keeps the system's,
  // e.g. where a limited loopback stands for a link between hosts.
  if (const char* cc = std::getenv("COLLX_TCP_CONGESTION"); cc && *cc) {
    config.localCongestion = std::string(cc) == "system" ? "" : cc;
  }
  if (const char* v = std::getenv("COLLX_CONNECT"); v && *v) {
    const std::string connect(v);
    if (connect != "lazy" && connect != "eager") {
      throw py::value_error(collx::str("collx: COLLX_CONNECT=", connect, " must be lazy or eager"));
    }
    config.lazy = connect == "lazy";
  }
  // Connections per peer on another host; every rank must set the same.
  if (const char* v = std::getenv("COLLX_SOCKETS_PER_PEER"); v && *v) {
    char* end = nullptr;
    const long lanes = std::strtol(v, &end, 10);
    if (*end || lanes < 1 || lanes > long(collx::tcp::kMaxLanes)) {
      throw py::value_error(collx::str("collx: COLLX_SOCKETS_PER_PEER=", v, " must be a number from 1 to ",
                                       collx::tcp::kMaxLanes));
    }
    config.lanes = int(lanes);
  }
  config.tuning = tuningPolicy();
  config.deviceReduceMinBytes = bytesOrOff("COLLX_DEVICE_REDUCE_MIN_BYTES", collx::torch_glue::kDeviceReduceMinBytes);
  config.stagingChunkBytes = bytesOrOff("COLLX_STAGING_CHUNK_BYTES", collx::torch_glue::kPipelineChunkBytes);
  if (config.stagingChunkBytes == 0) throw py::value_error("collx: COLLX_STAGING_CHUNK_BYTES=0: use off or a byte count");
  config.peerBufferBytes = bytesOrOff("COLLX_PEER_BUFFER_BYTES", collx::torch_glue::kPeerBufferBytes);
  config.peerMinBytes = bytesOrOff("COLLX_PEER_MIN_BYTES", collx::torch_glue::kPeerMinBytes);
  if (config.peerBufferBytes < collx::torch_glue::kPeerBufferMinBytes) {
    throw py::value_error(collx::str("collx: COLLX_PEER_BUFFER_BYTES=", config.peerBufferBytes, ": use off or at least ",
                                     collx::torch_glue::kPeerBufferMinBytes, " bytes"));
  }
  try {
    config.logLevel = collx::torch_glue::parseLogLevel(std::getenv("COLLX_DEBUG") ? std::getenv("COLLX_DEBUG") : "");
  } catch (const collx::Error& e) {
    throw py::value_error(e.what());
  }
  auto timeout = std::chrono::milliseconds(int64_t(timeoutSeconds * 1000));
  py::gil_scoped_release release;  // the rendezvous blocks on the Store and the peers
  return c10::make_intrusive<CollxBackend>(store, rank, size, timeout, std::move(config),
                                          connected ? CollxBackend::Connect::kLater : CollxBackend::Connect::kNone);
}

py::dict statsOf(const CollxBackend& b) {
  collx::torch_glue::Stats s = b.stats();
  py::dict algos;
  for (const auto& [label, op] : s.perAlgorithm) {
    py::dict d;
    d["calls"] = op.calls;
    d["seconds"] = op.seconds;
    algos[py::str(label)] = d;
  }
  py::dict out;
  out["ops"] = s.ops;
  out["bytes_sent"] = s.traffic.bytesSent();
  out["bytes_received"] = s.traffic.bytesReceived();
  py::dict carriers;  // only those that moved bytes
  for (int i = 0; i < collx::kCarriers; ++i) {
    if (s.traffic.sent[i] == 0 && s.traffic.received[i] == 0) continue;
    py::dict d;
    d["bytes_sent"] = s.traffic.sent[i];
    d["bytes_received"] = s.traffic.received[i];
    carriers[py::str(collx::name(collx::Carrier(i)))] = d;
  }
  out["carriers"] = carriers;
  out["staged_ops"] = s.stagedOps;
  out["device_reductions"] = s.deviceReductions;
  out["device_reductions_in_tensor"] = s.inTensorReductions;
  out["core_moves"] = s.coreMoves;
  out["algorithms"] = algos;
  return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "collx: a TCP collective backend for torch.distributed";
  py::class_<CollxBackend, c10d::Backend, c10::intrusive_ptr<CollxBackend>>(m, "CollxBackend")
      .def("stats", &statsOf, "Counters of this group: ops, bytes, calls and seconds per algorithm.")
      .def(
          "allreduce_with",
          [](CollxBackend& b, at::Tensor& t, const std::string& algorithm, bool average, bool blocking) {
            const collx::Algorithm a = algorithmArg(algorithm);
            c10d::ReduceOp op(average ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM);
            auto work = b.allreduceWith(t, op, a, blocking);
            if (blocking) work->wait();
            return work;
          },
          py::arg("tensor"), py::arg("algorithm") = "auto", py::arg("average") = false, py::arg("blocking") = false,
          py::call_guard<py::gil_scoped_release>(),
          "In-place SUM (or AVG) all-reduce with the algorithm picked for this call; returns the Work. "
          "blocking: returns once it is done, having run it in this thread, as a synchronous all_reduce does.")
      .def_property_readonly("hosts", &CollxBackend::hosts,
                             "Host index of every rank: ranks that published the same address share one.")
      .def(
          "choose_allreduce", [](const CollxBackend& b, size_t nbytes) { return std::string(collx::name(b.autoAllreduce(nbytes))); },
          py::arg("nbytes"), "The algorithm 'auto' runs for an all-reduce of nbytes on this group (hosts, then the cost model).")
      .def("refining", &CollxBackend::refining, py::arg("nbytes"),
           "Whether auto is still trying algorithms for all-reduces of nbytes (online refinement's trial).")
      .def_property_readonly("algorithm", [](const CollxBackend& b) { return collx::name(b.config().algorithm); })
      .def_property_readonly(
          "transport", [](const CollxBackend& b) { return b.transportNote(); },
          "How this rank reaches its peers on the same host: shared memory (with the ring size) or why not.")
      .def_property_readonly("tree_arity", [](const CollxBackend& b) { return b.config().treeArity; })
      .def_property_readonly("segment_bytes", [](const CollxBackend& b) { return b.config().segmentBytes; })
      .def(
          "predict_allreduce_us",
          [](const CollxBackend& b, size_t nbytes, const std::string& algorithm) {
            collx::Algorithm a = algorithmArg(algorithm);
            if (a == collx::Algorithm::kAuto) a = b.autoAllreduce(nbytes);
            return collx::predictAllreduceUs(b.tuning(), a, b.getSize(), b.config().treeArity, nbytes);
          },
          py::arg("nbytes"), py::arg("algorithm") = "auto",
          "This group's fitted model: the predicted microseconds of an all-reduce of nbytes.")
      .def_property_readonly(
          "tuning", [](const CollxBackend& b) { return b.describeTuning(); },
          "Where auto's cost model came from (calibration, cache, file, table), its constants, its choices, and "
          "what online refinement has kept.")
      .def_property_readonly("timeout_seconds", [](CollxBackend& b) {
        return std::chrono::duration<double>(b.getBackendOptions()->timeout).count();
      });
  m.def("create_backend", &createBackend, py::arg("store"), py::arg("rank"), py::arg("size"),
        py::arg("timeout_seconds"), py::arg("algorithm"), py::arg("tree_arity"), py::arg("segment_bytes"),
        py::arg("ifname"), py::arg("family") = "", py::arg("transport") = "auto", py::arg("connected") = true,
        py::arg("global_ranks") = std::vector<uint64_t>{});
  m.def(
      "dump_fr_trace",
      [](bool includeCollectives, bool includeStackTraces, bool onlyActive) {
        return py::bytes(collx::torch_glue::Recorder::get().dump(includeCollectives, includeStackTraces, onlyActive));
      },
      py::arg("include_collectives") = true, py::arg("include_stack_traces") = true, py::arg("only_active") = false,
      "collx's flight recorder (recorder.h) in torch's pickled dump format.");

  m.def(
      "choose_allreduce",
      [](int worldSize, int treeArity, size_t nbytes, int hosts) {
        return std::string(collx::name(collx::chooseAllreduce(collx::Tuning::table(), worldSize, hosts, treeArity, nbytes)));
      },
      py::arg("world_size"), py::arg("tree_arity"), py::arg("nbytes"), py::arg("hosts") = 1,
      "The algorithm 'auto' runs for an all-reduce of nbytes over world_size ranks on `hosts` machines\n"
      "with the static table (COLLX_TUNING=table): hier when several hosts and some host runs several\n"
      "ranks, else the cost model of tuning.cc. A group's own choice: its backend's choose_allreduce.");
  m.def(
      "predict_allreduce_us",
      [](const std::string& algorithm, int worldSize, int treeArity, size_t nbytes) {
        return collx::predictAllreduceUs(collx::Tuning::table(), algorithmArg(algorithm), worldSize, treeArity, nbytes);
      },
      py::arg("algorithm"), py::arg("world_size"), py::arg("tree_arity"), py::arg("nbytes"),
      "The static table's predicted microseconds for one all-reduce (a group's own: its backend's).");
  m.def("cast_scale", &collx::torch_glue::castScale, py::arg("dst"), py::arg("src"), py::arg("factor"),
        py::call_guard<py::gil_scoped_release>(),
        "dst = dst.dtype(src * factor) between float32 and float16/bfloat16, fused, no temporary.");
  m.def("reduce_into", &collx::torch_glue::reduceInto, py::arg("dst"), py::arg("src"), py::arg("op") = "sum",
        py::arg("post_scale") = 1.0, py::call_guard<py::gil_scoped_release>(), "dst = op(dst, src) with collx's CPU or CUDA reduce kernels.");
  m.attr("cuda_kernels") = py::bool_(
#ifdef COLLX_WITH_CUDA
      true
#else
      false
#endif
  );
}

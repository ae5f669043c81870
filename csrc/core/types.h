// Element types, reduce ops and op kinds shared by every core layer.
// Small integers on purpose: they travel in frame headers and index tables.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace collx {

enum class DataType : uint8_t {
  kFloat32 = 0,
  kFloat64,
  kFloat16,
  kBFloat16,
  kInt8,
  kUInt8,
  kInt32,
  kInt64,
  kBool,
  kCount,
};

enum class ReduceOp : uint8_t {
  kSum = 0,
  kProduct,
  kMin,
  kMax,
  kBand,
  kBor,
  kBxor,
  kCount,
};

// What a frame belongs to; a peer sending another kind than expected is a
// mismatched collective, reported instead of corrupting data.
enum class OpKind : uint8_t {
  kAllreduce = 0,
  kBroadcast,
  kAllgather,
  kBarrier,
  kHello,
  kReduce,
  kReduceScatter,
  kAllToAll,
  kGather,
  kScatter,
  kP2P,  // a small send, payload included (p2p channel; transport/p2p.h)
  kAbort,  // a rank failed; the payload says why
  kCancel,  // a rank could not start collective #seq (bad input); tag: its kind, payload: why.
            // On the p2p channel: the sender withdrew send #seq
  kP2PRequest,  // a large send asks to be cleared; bytes: its size, no payload
  kP2PClear,    // the receiver has matched send #seq: send its data
  kP2PData,     // the payload of cleared send #seq
  kP2PRefuse,   // the receiver refused send #seq (size or dtype mismatch); payload: why
  kCalibrate,   // an all-reduce timed at group creation (algorithms/calibrate.h)
  kCount,
};

// Sequence numbers from here on number the group's own collectives
// (calibration, refinement's agreements), never one of the user's ops: a
// rank's progress through the user's ops, which abort frames carry and are
// judged by, leaves them out.
constexpr uint64_t kInternalSeqs = uint64_t(1) << 62;

size_t elementSize(DataType t);
bool isFloating(DataType t);
const char* name(DataType t);
const char* name(ReduceOp op);
const char* name(OpKind k);

}  // namespace collx

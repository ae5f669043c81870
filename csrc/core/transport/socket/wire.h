// On-the-wire layouts: the fixed frame header in front of every message, and
// the hello a connecting rank sends once. Both are little-endian host order;
// every rank of a group runs the same binary on the same architecture.
#pragma once

#include <cstddef>
#include <cstdint>

namespace collx::tcp {

constexpr uint32_t kFrameMagic = 0x436c5846;  // "ClXF"
constexpr uint32_t kHelloMagic = 0x436c5848;  // "ClXH"
// The longest reason an abort or cancel frame carries; fits the receive buffer.
constexpr size_t kMaxReasonBytes = 2048;

struct FrameHeader {
  uint32_t magic;
  uint8_t kind;
  uint8_t dtype;
  uint16_t reserved;
  uint32_t tag;
  uint32_t reserved2;
  uint64_t seq;
  uint64_t bytes;
};
static_assert(sizeof(FrameHeader) == 32, "frame header is 32 bytes");

struct Hello {
  uint32_t magic;
  int32_t rank;
  int32_t size;
  uint32_t channel;  // which of the pair's connections this is (rendezvous.h)
  uint64_t generation;
  uint64_t token;  // per-group secret published through the Store
};
static_assert(sizeof(Hello) == 32, "hello is 32 bytes");

}  // namespace collx::tcp

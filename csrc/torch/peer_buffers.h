// One buffer per rank of an all-local group, each mapped into every rank:
// CUDA IPC memory on a GPU (staging_cuda.cc), a memfd segment for the CPU
// emulation (staging.cc). peer_allreduce.h reduces through them.
#pragma once

#include <array>
#include <string>
#include <vector>

namespace collx::torch_glue {

class PeerBuffers {
 public:
  // What a peer needs to map a rank's buffer.
  static constexpr size_t kBlobBytes = 128;  // a multiple of every element size
  using Blob = std::array<char, kBlobBytes>;

  virtual ~PeerBuffers() = default;

  // This rank's buffer, for the others to map.
  virtual Blob exported() const = 0;
  // Maps the other ranks' buffers from everyone's blobs (indexed by rank).
  // Returns why this rank cannot, or "" (e.g. a peer's tensor lies on
  // another GPU).
  virtual std::string attach(const std::vector<Blob>& blobs) = 0;
  // Every rank has attached (the memfd can close).
  virtual void attached() {}

  size_t bytes() const { return bytes_; }
  char* mine() const { return ptrs_[rank_]; }
  const char* of(int rank) const { return ptrs_[rank]; }

 protected:
  PeerBuffers(size_t bytes, int rank, int size) : bytes_(bytes), rank_(rank), ptrs_(size_t(size), nullptr) {}

  const size_t bytes_;
  const int rank_;
  std::vector<char*> ptrs_;  // every rank's buffer, mapped here
};

}  // namespace collx::torch_glue

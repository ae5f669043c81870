#include "ring.h"

#include <algorithm>
#include <cstring>

#include "../../copy.h"

namespace collx::shm {

namespace {
// Published piece by piece so the other side overlaps its copy with ours.
constexpr size_t kPieceBytes = 64 << 10;

// Takes the other side's flag back; true if it was asleep.
bool takeFlag(std::atomic<uint32_t>& flag) {
  return flag.load(std::memory_order_seq_cst) != 0 && flag.exchange(0, std::memory_order_seq_cst) != 0;
}
}  // namespace

size_t Ring::write(const iovec* iov, int n, bool& wake) {
  uint64_t head = c_->head.load(std::memory_order_relaxed);
  size_t total = 0;
  for (int i = 0; i < n; ++i) {
    const char* src = static_cast<const char*>(iov[i].iov_base);
    size_t left = iov[i].iov_len;
    while (left > 0) {
      const size_t space = cap_ - size_t(head - c_->tail.load(std::memory_order_acquire));
      if (space == 0) goto out;
      const size_t take = std::min({space, left, kPieceBytes});
      const size_t pos = size_t(head) & (cap_ - 1);
      const size_t first = std::min(take, cap_ - pos);
      copyBytes(data_ + pos, src, first);
      copyBytes(data_, src + first, take - first);
      head += take;
      c_->head.store(head, std::memory_order_seq_cst);
      src += take;
      left -= take;
      total += take;
    }
  }
out:
  wake = total > 0 && takeFlag(c_->readerAsleep);
  return total;
}

size_t Ring::read(void* dst, size_t len, bool& wake) {
  uint64_t tail = c_->tail.load(std::memory_order_relaxed);
  char* out = static_cast<char*>(dst);
  size_t total = 0;
  while (total < len) {
    const size_t avail = size_t(c_->head.load(std::memory_order_acquire) - tail);
    if (avail == 0) break;
    const size_t take = std::min({avail, len - total, kPieceBytes});
    const size_t pos = size_t(tail) & (cap_ - 1);
    const size_t first = std::min(take, cap_ - pos);
    copyBytes(out + total, data_ + pos, first);
    copyBytes(out + total + first, data_, take - first);
    tail += take;
    c_->tail.store(tail, std::memory_order_seq_cst);
    total += take;
  }
  wake = total > 0 && takeFlag(c_->writerAsleep);
  return total;
}

bool Ring::sleepAsReader() {
  c_->readerAsleep.store(1, std::memory_order_seq_cst);
  if (c_->head.load(std::memory_order_seq_cst) == c_->tail.load(std::memory_order_relaxed)) return true;
  wakeReader();
  return false;
}

bool Ring::sleepAsWriter() {
  c_->writerAsleep.store(1, std::memory_order_seq_cst);
  if (c_->head.load(std::memory_order_relaxed) - c_->tail.load(std::memory_order_seq_cst) == cap_) return true;
  wakeWriter();
  return false;
}

void Ring::leaveNote(const std::string& why) {
  const size_t n = std::min(why.size(), sizeof(c_->note));
  std::memcpy(c_->note, why.data(), n);
  c_->noteBytes.store(uint32_t(n), std::memory_order_release);
}

std::string Ring::note() const {
  const size_t n = c_->noteBytes.load(std::memory_order_acquire);
  return std::string(c_->note, std::min(n, sizeof(c_->note)));
}

}  // namespace collx::shm

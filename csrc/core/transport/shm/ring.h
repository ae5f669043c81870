// A single-producer single-consumer byte ring in shared memory: the data path
// between two ranks on one host, one ring per direction.
//
//   writer                               reader
//   copy bytes at head % cap  ----->     copy bytes out at tail % cap
//   head += n (release)                  tail += n (release)
//
// head and tail count bytes since the start and never wrap; the capacity is
// a power of two. Large copies publish in pieces, so the reader starts on the
// first piece while the writer copies the next.
//
// Sleeping: a side that found nothing to do sets its `asleep` flag, checks
// the ring once more, then sleeps in poll() on the pair's TCP socket. The
// other side, after publishing, takes the flag back (exchange) and, if it
// was set, rings the doorbell: one byte on that socket. The flag store and
// the counter load are sequentially consistent on both sides, so either the
// sleeper sees the new bytes or the publisher sees the flag.
//
// Abort note: a writer that aborts may be unable to put its abort frame in
// the stream (the ring is full, or half a message is in it and the reader
// is busy elsewhere). It leaves the reason beside the ring instead, before
// it closes its socket; a reader that finds the socket closed reads it there.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace collx::shm {

struct alignas(64) RingControl {
  std::atomic<uint64_t> head;  // bytes written (writer)
  char pad0[56];
  std::atomic<uint64_t> tail;  // bytes read (reader)
  char pad1[56];
  std::atomic<uint32_t> readerAsleep;
  char pad2[60];
  std::atomic<uint32_t> writerAsleep;
  char pad3[60];
  std::atomic<uint32_t> noteBytes;  // 0: no note (writer, once)
  char note[2044];
};
static_assert(sizeof(RingControl) <= 4096, "ring control fits its page");

class Ring {
 public:
  Ring() = default;
  // `control` and `data` lie in a mapped segment; `capacity` is a power of two.
  Ring(RingControl* control, char* data, size_t capacity) : c_(control), data_(data), cap_(capacity) {}

  size_t capacity() const { return cap_; }

  // Writer: copies up to the free space from `iov`; returns the bytes taken.
  // `wake` is set when the reader was asleep and must be woken.
  size_t write(const iovec* iov, int n, bool& wake);
  // Reader: copies up to `len` available bytes; returns the bytes taken.
  // `wake` is set when the writer was asleep waiting for space.
  size_t read(void* dst, size_t len, bool& wake);

  size_t readable() const { return size_t(c_->head.load(std::memory_order_acquire) - c_->tail.load(std::memory_order_relaxed)); }
  size_t writable() const { return cap_ - size_t(c_->head.load(std::memory_order_relaxed) - c_->tail.load(std::memory_order_acquire)); }

  // Set the own flag before sleeping; false if the other side moved meanwhile
  // (then the flag is cleared and the caller must not sleep).
  bool sleepAsReader();
  bool sleepAsWriter();
  void wakeReader() { c_->readerAsleep.store(0, std::memory_order_relaxed); }
  void wakeWriter() { c_->writerAsleep.store(0, std::memory_order_relaxed); }

  // Writer: leaves `why` (cut to the note's size) as the abort note; an
  // empty one is no note.
  void leaveNote(const std::string& why);
  // Reader: the writer's abort note, or "".
  std::string note() const;

 private:
  RingControl* c_ = nullptr;
  char* data_ = nullptr;
  size_t cap_ = 0;
};

}  // namespace collx::shm

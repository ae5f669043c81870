#include "ring_pass.h"

#include <algorithm>

namespace collx {

namespace {
inline size_t mod(long a, long n) { return size_t(((a % n) + n) % n); }
}  // namespace

std::vector<size_t> evenBounds(size_t count, int n) {
  std::vector<size_t> b(size_t(n) + 1);
  for (int i = 0; i <= n; ++i) b[size_t(i)] = partBegin(count, size_t(n), size_t(i));
  return b;
}

RingPass::RingPass(const Collective& c, char* buf, std::vector<size_t> bounds, int shift, int steps, int reduceSteps,
                   ReduceFn fn, uint32_t tagBase, uint64_t id)
    : c_(c), buf_(buf), bounds_(std::move(bounds)), shift_(shift), reduceSteps_(reduceSteps), fn_(std::move(fn)),
      tagBase_(tagBase), id_(id), n_(c.size()), right_((c.rank() + 1) % n_), left_((c.rank() + n_ - 1) % n_),
      es_(elementSize(c.dtype)) {
  if (n_ == 1 || steps <= 0) return;
  size_t maxPart = 0;
  for (int i = 0; i < n_; ++i) maxPart = std::max(maxPart, bounds_[size_t(i) + 1] - bounds_[size_t(i)]);
  m_ = segmentsFor(maxPart * es_, c.segmentBytes);
  units_ = size_t(steps) * m_;  // unit u = (step u / m, segment u % m)
  segBytes_ = ((maxPart + m_ - 1) / m_) * es_;
}

size_t RingPass::scratchBytes() const { return reduceSteps_ > 0 && units_ > 0 ? kWindow * segBytes_ : 0; }

size_t RingPass::partOf(size_t u, long extra) const { return mod(c_.rank() + shift_ - long(u / m_) - extra, n_); }

size_t RingPass::span(size_t part, size_t seg, char** ptr) const {
  const size_t pb = bounds_[part], pe = bounds_[part + 1];
  const size_t b = pb + partBegin(pe - pb, m_, seg), e = pb + partEnd(pe - pb, m_, seg);
  *ptr = buf_ + b * es_;
  return (e - b) * es_;
}

void RingPass::sendUnit(size_t u) {
  char* p;
  const size_t bytes = span(partOf(u, 0), u % m_, &p);
  c_.transport.postSend(right_, c_.frame(tagBase_ + uint32_t(u)), p, bytes, id_ << 48 | (2 * u + 1));
}

void RingPass::postRecvs() {
  for (; nextRecv_ < units_ && nextRecv_ < recvsDone_ + kWindow; ++nextRecv_) {
    const size_t u = nextRecv_;
    char* p;
    const size_t bytes = span(partOf(u, 1), u % m_, &p);
    if (long(u / m_) < reduceSteps_) p = scratch_ + (u % kWindow) * segBytes_;
    c_.transport.postRecv(left_, c_.frame(tagBase_ + uint32_t(u)), p, bytes, id_ << 48 | (2 * u));
  }
}

void RingPass::start(char* scratch) {
  scratch_ = scratch;
  for (size_t j = 0; j < m_ && j < units_; ++j) sendUnit(j);
  postRecvs();
}

void RingPass::complete(uint64_t cookie) {
  cookie &= (uint64_t(1) << 48) - 1;
  ++completed_;
  if (cookie & 1) return;  // a send finished; nothing waits on it
  const size_t u = cookie / 2;
  if (long(u / m_) < reduceSteps_) {
    char* dst;
    const size_t bytes = span(partOf(u, 1), u % m_, &dst);
    fn_(dst, scratch_ + (u % kWindow) * segBytes_, bytes / es_);
  }
  if (u + m_ < units_) sendUnit(u + m_);
  ++recvsDone_;
  postRecvs();
}

}  // namespace collx

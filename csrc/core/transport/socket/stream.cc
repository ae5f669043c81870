#include "stream.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstdint>

namespace collx::tcp {

Stream::Stream(Socket socket, std::unique_ptr<shm::Link> rings)
    : rings_(std::move(rings)) {
  if (socket.valid()) attach(std::move(socket));
}

void Stream::attach(Socket socket) {
  socket_ = std::move(socket);
  socket_.setNoDelay();
  socket_.setNonBlocking(true);
}

void Stream::ringDoorbell() {
  const char bell = 0;
  ssize_t rc = ::send(socket_.fd(), &bell, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
  (void)rc;  // a full socket already holds a bell; a closed one is seen by the reader
}

ssize_t Stream::sendv(const iovec* iov, int n) {
  if (!rings_) {
    msghdr msg{};
    msg.msg_iov = const_cast<iovec*>(iov);
    msg.msg_iovlen = size_t(n);
    return ::sendmsg(socket_.fd(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  }
  bool wake = false;
  const size_t wrote = rings_->out.write(iov, n, wake);
  if (wake) ringDoorbell();
  if (wrote > 0) return ssize_t(wrote);
  errno = EAGAIN;  // a dead peer is seen through the socket, while waiting
  return -1;
}

ssize_t Stream::recvSome(void* data, size_t bytes) {
  if (!rings_) return ::recv(socket_.fd(), data, bytes, MSG_DONTWAIT);
  bool wake = false;
  const size_t got = rings_->in.read(data, bytes, wake);
  if (wake) ringDoorbell();
  if (got > 0 || peerClosed_) return ssize_t(got);
  errno = EAGAIN;
  return -1;
}

size_t Stream::writableNow() const { return rings_ ? rings_->out.writable() : SIZE_MAX; }

void Stream::leaveAbortNote(const std::string& why) {
  if (rings_) rings_->out.leaveNote(why);
}

std::string Stream::peerAbortNote() const { return rings_ ? rings_->in.note() : std::string(); }

bool Stream::prepareSleep(bool read, bool write) {
  if (read && !rings_->in.sleepAsReader()) return false;
  if (write && !rings_->out.sleepAsWriter()) {
    rings_->in.wakeReader();
    return false;
  }
  return true;
}

void Stream::afterSleep(short revents) {
  rings_->in.wakeReader();
  rings_->out.wakeWriter();
  if (!(revents & (POLLIN | POLLHUP | POLLERR))) return;
  char bells[64];
  for (;;) {
    ssize_t rc = ::recv(socket_.fd(), bells, sizeof(bells), MSG_DONTWAIT);
    if (rc > 0 || (rc < 0 && errno == EINTR)) continue;
    if (rc == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) peerClosed_ = true;
    return;
  }
}

}  // namespace collx::tcp

// Thin RAII and helpers over POSIX TCP sockets: listen, connect with retry,
// a blocking exact write with a deadline (for the handshake only), and
// the choice of the address a rank publishes.
#pragma once

#include <sys/socket.h>

#include <string>

#include "../transport.h"

namespace collx::tcp {

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& o) noexcept : fd_(o.release()) {}
  Socket& operator=(Socket&& o) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket() { reset(); }

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release();
  void reset();

  void setNonBlocking(bool on);
  void setNoDelay();
  // Switches the connection to another congestion control (e.g. "reno");
  // false where the kernel refuses.
  bool setCongestionControl(const char* name);
  // Fixes the send buffer (the kernel doubles `bytes`, up to its
  // net.core.wmem_max), which turns its autotuning off.
  void setSendBuffer(int bytes);

 private:
  int fd_ = -1;
};

// A socket address that prints as "host:port" and travels through the Store
// as that string.
struct Address {
  sockaddr_storage storage{};
  socklen_t len = 0;

  std::string str() const;
  std::string host() const;  // str() without the port
  static Address parse(const std::string& s);  // "host:port", "[v6]:port"
  int port() const;
  void setPort(int port);
};

// The address this rank listens on: from `ifnameSpec` (COLLX_SOCKET_IFNAME
// syntax: "eth0,eth1" picks by prefix, "^docker,lo" excludes) or else the
// address the hostname resolves to, or else loopback. `family` (AF_INET,
// AF_INET6; AF_UNSPEC: either, IPv4 first) restricts the choice, as
// NCCL_SOCKET_FAMILY does.
Address chooseAddress(const std::string& ifnameSpec, int family = AF_UNSPEC);

// "AF_INET" -> AF_INET, "AF_INET6" -> AF_INET6, "" -> AF_UNSPEC; throws otherwise.
int parseFamily(const std::string& name);

// Listens on `addr` with an ephemeral port; `addr` gets the bound port. The
// backlog is the system's largest: every peer of a lazy group may dial at once.
Socket listenOn(Address& addr);

// Connects, retrying refused connections until the deadline (`retryRefused`;
// else a refusal throws at once: a listener known to be up is gone).
Socket connectTo(const Address& addr, Deadline deadline, bool retryRefused = true);

// Blocking exact write that gives up at the deadline; false on error.
bool writeAll(const Socket& s, const void* data, size_t n, Deadline deadline);

}  // namespace collx::tcp

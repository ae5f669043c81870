#include "socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>
#include <thread>
#include <vector>

#include "../../error.h"

namespace collx::tcp {

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    reset();
    fd_ = o.release();
  }
  return *this;
}

int Socket::release() {
  int fd = fd_;
  fd_ = -1;
  return fd;
}

void Socket::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void Socket::setNonBlocking(bool on) {
  int flags = fcntl(fd_, F_GETFL, 0);
  flags = on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK);
  COLLX_CHECK(fcntl(fd_, F_SETFL, flags) == 0, "collx: fcntl(O_NONBLOCK) failed: ", strerror(errno));
}

void Socket::setNoDelay() {
  int one = 1;
  COLLX_CHECK(setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) == 0,
              "collx: setsockopt(TCP_NODELAY) failed: ", strerror(errno));
}

bool Socket::setCongestionControl(const char* name) {
  return setsockopt(fd_, IPPROTO_TCP, TCP_CONGESTION, name, socklen_t(strlen(name))) == 0;
}

void Socket::setSendBuffer(int bytes) {
  (void)setsockopt(fd_, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);  // best effort: a hint
}

std::string Address::str() const {
  char host[NI_MAXHOST] = {0};
  char serv[NI_MAXSERV] = {0};
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&storage), len, host, sizeof(host), serv,
                  sizeof(serv), NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "?";
  }
  return storage.ss_family == AF_INET6 ? collx::str("[", host, "]:", serv) : collx::str(host, ":", serv);
}

std::string Address::host() const {
  std::string s = str();
  return s.substr(0, s.rfind(':'));
}

Address Address::parse(const std::string& s) {
  auto colon = s.rfind(':');
  COLLX_CHECK(colon != std::string::npos, "collx: bad address '", s, "'");
  std::string host = s.substr(0, colon);
  std::string port = s.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  COLLX_CHECK(rc == 0 && res, "collx: cannot parse address '", s, "': ", gai_strerror(rc));
  Address a;
  memcpy(&a.storage, res->ai_addr, res->ai_addrlen);
  a.len = res->ai_addrlen;
  freeaddrinfo(res);
  return a;
}

int Address::port() const {
  if (storage.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_port);
  return ntohs(reinterpret_cast<const sockaddr_in*>(&storage)->sin_port);
}

void Address::setPort(int port) {
  if (storage.ss_family == AF_INET6) {
    reinterpret_cast<sockaddr_in6*>(&storage)->sin6_port = htons(port);
  } else {
    reinterpret_cast<sockaddr_in*>(&storage)->sin_port = htons(port);
  }
}

namespace {

Address fromSockaddr(const sockaddr* sa) {
  Address a;
  a.len = sa->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  memcpy(&a.storage, sa, a.len);
  return a;
}

std::vector<std::string> splitComma(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

bool startsWithAny(const std::string& name, const std::vector<std::string>& prefixes) {
  for (const auto& p : prefixes) {
    if (name.compare(0, p.size(), p) == 0) return true;
  }
  return false;
}

Address loopback(int family) {
  if (family == AF_INET6) {
    sockaddr_in6 sin6{};
    sin6.sin6_family = AF_INET6;
    sin6.sin6_addr = in6addr_loopback;
    return fromSockaddr(reinterpret_cast<sockaddr*>(&sin6));
  }
  sockaddr_in sin{};
  sin.sin_family = AF_INET;
  sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return fromSockaddr(reinterpret_cast<sockaddr*>(&sin));
}

const char* familyName(int family) {
  return family == AF_INET ? "AF_INET" : family == AF_INET6 ? "AF_INET6" : "any family";
}

// The first IPv4 (else IPv6) address of an up interface matching the spec
// and the family.
Address fromInterfaces(const std::string& spec, int wantFamily) {
  bool exclude = !spec.empty() && spec[0] == '^';
  auto prefixes = splitComma(exclude ? spec.substr(1) : spec);
  ifaddrs* list = nullptr;
  COLLX_CHECK(getifaddrs(&list) == 0, "collx: getifaddrs failed: ", strerror(errno));
  const ifaddrs* best = nullptr;
  for (const ifaddrs* it = list; it; it = it->ifa_next) {
    if (!it->ifa_addr || !(it->ifa_flags & IFF_UP)) continue;
    int family = it->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    if (wantFamily != AF_UNSPEC && family != wantFamily) continue;
    if (startsWithAny(it->ifa_name, prefixes) == exclude) continue;
    if (family == AF_INET6 &&
        IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<const sockaddr_in6*>(it->ifa_addr)->sin6_addr)) {
      continue;  // link-local needs a scope id peers do not know
    }
    if (!best || (best->ifa_addr->sa_family == AF_INET6 && family == AF_INET)) best = it;
  }
  if (!best) {
    freeifaddrs(list);
    throw Error(str("collx: COLLX_SOCKET_IFNAME='", spec, "' matches no interface that is up with an ",
                    familyName(wantFamily), " address"));
  }
  Address a = fromSockaddr(best->ifa_addr);
  freeifaddrs(list);
  return a;
}

Address fromHostname(int family) {
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) != 0) return loopback(family);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_family = family;
  addrinfo* res = nullptr;
  if (getaddrinfo(host, nullptr, &hints, &res) != 0 || !res) return loopback(family);
  Address a = loopback(family);
  for (addrinfo* it = res; it; it = it->ai_next) {
    // Only an address we can bind is one peers can reach us on.
    Socket probe(::socket(it->ai_family, SOCK_STREAM, 0));
    if (probe.valid() && ::bind(probe.fd(), it->ai_addr, it->ai_addrlen) == 0) {
      a = fromSockaddr(it->ai_addr);
      break;
    }
  }
  freeaddrinfo(res);
  a.setPort(0);
  return a;
}

int remainingMs(Deadline deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left < 0 ? 0 : int(std::min<long long>(left, 1 << 30));
}

// Waits for `events` on one fd; false when the deadline passes first.
bool waitFor(int fd, short events, Deadline deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, remainingMs(deadline));
    if (rc > 0) return true;
    if (rc == 0) return false;
    if (errno != EINTR) return false;
  }
}

}  // namespace

Address chooseAddress(const std::string& ifnameSpec, int family) {
  return ifnameSpec.empty() ? fromHostname(family) : fromInterfaces(ifnameSpec, family);
}

int parseFamily(const std::string& name) {
  if (name.empty()) return AF_UNSPEC;
  if (name == "AF_INET") return AF_INET;
  if (name == "AF_INET6") return AF_INET6;
  throw Error(str("collx: socket family '", name, "' is not AF_INET or AF_INET6"));
}

Socket listenOn(Address& addr) {
  Socket s(::socket(addr.storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  COLLX_CHECK(s.valid(), "collx: socket() failed: ", strerror(errno));
  addr.setPort(0);
  COLLX_CHECK(::bind(s.fd(), reinterpret_cast<sockaddr*>(&addr.storage), addr.len) == 0,
              "collx: bind(", addr.str(), ") failed: ", strerror(errno));
  COLLX_CHECK(::listen(s.fd(), SOMAXCONN) == 0, "collx: listen failed: ", strerror(errno));
  COLLX_CHECK(getsockname(s.fd(), reinterpret_cast<sockaddr*>(&addr.storage), &addr.len) == 0,
              "collx: getsockname failed: ", strerror(errno));
  return s;
}

Socket connectTo(const Address& addr, Deadline deadline, bool retryRefused) {
  auto backoff = std::chrono::milliseconds(1);
  for (;;) {
    Socket s(::socket(addr.storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    COLLX_CHECK(s.valid(), "collx: socket() failed: ", strerror(errno));
    s.setNonBlocking(true);
    int rc = ::connect(s.fd(), reinterpret_cast<const sockaddr*>(&addr.storage), addr.len);
    int err = rc == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      if (!waitFor(s.fd(), POLLOUT, deadline)) {
        throw TimeoutError(str("collx: Timed out connecting to ", addr.str()));
      }
      socklen_t len = sizeof(err);
      getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
    }
    if (err == 0) {
      s.setNonBlocking(false);
      return s;
    }
    bool retry = (retryRefused && err == ECONNREFUSED) || err == ECONNRESET || err == ETIMEDOUT || err == EAGAIN;
    if (!retry || Clock::now() + backoff >= deadline) {
      throw Error(str("collx: connect to ", addr.str(), " failed: ", strerror(err)));
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(100));
  }
}

bool writeAll(const Socket& s, const void* data, size_t n, Deadline deadline) {
  auto p = static_cast<const char*>(data);
  while (n > 0) {
    if (!waitFor(s.fd(), POLLOUT, deadline)) return false;
    ssize_t rc = ::send(s.fd(), p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (rc < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (rc <= 0) return false;
    p += rc;
    n -= size_t(rc);
  }
  return true;
}

}  // namespace collx::tcp

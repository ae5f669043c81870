// The one exception type of the core. The c10d glue turns it into
// torch.distributed.DistBackendError; messages name op, rank, peer and reason.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace collx {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

// A deadline passed while waiting on a peer.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// A peer's abort frame: it failed first, and says why.
class PeerAbortedError : public Error {
 public:
  using Error::Error;
};

// A peer's connection ended: its process exited, or it closed its group.
class PeerClosedError : public Error {
 public:
  explicit PeerClosedError(const std::string& msg, int peer = -1) : Error(msg), peer_(peer) {}
  int peer() const { return peer_; }  // -1 where not one peer's

 private:
  int peer_;
};

namespace detail {
// Numbers go through std::to_string, not an ostream: an ostream's numeric
// insertion instantiated inside the extension crashed on a toolchain whose
// libstdc++ differs from the headers (GCC 13 headers, torch 2.11 image).
template <typename T>
void append(std::string& out, const T& v) {
  if constexpr (std::is_same_v<T, bool>) {
    out += v ? "true" : "false";
  } else if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, char>) {
    out += std::to_string(v);
  } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
    out += std::string_view(v);
  } else {
    std::ostringstream ss;
    ss << v;
    out += ss.str();
  }
}
}  // namespace detail

template <typename... Args>
std::string str(const Args&... args) {
  std::string out;
  (detail::append(out, args), ...);
  return out;
}

// The error of a rank whose peer failed first and said why (its abort frame
// or note).
inline PeerAbortedError peerAborted(int rank, int peer, const std::string& why) {
  return PeerAbortedError(str("collx rank ", rank, ": peer ", peer, " failed and aborted the group: ", why));
}

// What a rank sees when a peer's connection ends. It starts with gloo's
// wording, "Connection closed by peer", which torchft and log scrapers match.
inline PeerClosedError peerClosed(int rank, int peer, const std::string& channel) {
  return PeerClosedError(str("Connection closed by peer ", peer, " (collx rank ", rank, ", ", channel,
                             " connection; the peer's process exited or it closed its group)"),
                         peer);
}

// The note a rank leaves when it closes a group that peers may still dial
// (destroy_process_group, shutdown, abort before the group was set up).
inline constexpr const char* kClosedItsGroup = "closed its group";

// What an error about `peer` adds of the note it left (why it failed,
// socket/connector.h): "" where it left none.
inline std::string noteOfPeer(int peer, const std::string& note) {
  if (note == kClosedItsGroup) return str("; peer ", peer, " closed its group");
  return note.empty() ? "" : str("; peer ", peer, " had failed: ", note);
}

#define COLLX_CHECK(cond, ...)                          \
  do {                                                  \
    if (!(cond)) throw ::collx::Error(::collx::str(__VA_ARGS__)); \
  } while (0)

}  // namespace collx

// The connections of one group's rank: made all at setup (eager), or each
// when first needed (lazy), through a listener that an acceptor thread
// serves for as long as the group may connect.
//
// Either side of a pair may dial: a receive from any source cannot know
// whom to dial, so its sender must be able to. Every hello gets one reply
// byte from the acceptor:
//
//   kAccepted   the connection is the pair's, on that channel
//   kDuplicate  the acceptor holds one already, or is dialing the peer
//               itself and has the lower rank (its own dial wins)
//
// So two ranks that dial each other at once keep one connection: the lower
// rank's. The higher one, refused, waits for that dial to reach its own
// acceptor. Nobody waits on a busy rank: the acceptor thread answers hellos
// whatever its rank is doing. A hello that is not ours (wrong magic, token,
// generation or rank; garbage; half sent) is dropped, and a silent
// connection after kHelloTimeout; none holds up the others.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "../../error.h"
#include "rendezvous.h"

namespace collx::tcp {

class Connector {
 public:
  // Connections the peers open on `channel` go to `sink` at once instead of
  // waiting for take() (p2p: a receive from any source takes them).
  using Sink = std::function<void(int peer, Socket socket)>;

  // `directory`: publish()'s; the connector owns its listener from now on.
  Connector(int rank, Directory directory, const std::string& localCongestion);
  ~Connector();
  Connector(const Connector&) = delete;
  Connector& operator=(const Connector&) = delete;

  void setSink(Channel channel, Sink sink);

  // The connection to `peer` on `channel`: one the peer opened, else one
  // dialed now. Returns an invalid Socket where the peer's connection went
  // to the channel's sink. Throws TimeoutError at the deadline, and Error
  // where the peer refuses (it left) or `wakeFd` becomes readable (the
  // caller is interrupted). Both ranks of a pair may call it at once: a
  // rank that waited for its peer's dial instead would wait until its
  // deadline for a peer that died.
  Socket take(int peer, Channel channel, Deadline deadline, int wakeFd = -1);

  // `peer` left: drops what it connected; a later take() dials it again,
  // and its refusal says why it left.
  void forget(int peer);

  // Closes the listener (new connections are refused) and drops what no one
  // took; take() throws afterwards. Safe to call twice.
  void stop();

  const Directory& directory() const { return dir_; }

  // Abort frames travel only on connections that take them: a lazy rank
  // dials a peer when an op first needs it, so a peer that failed and closed
  // its group before then would refuse the dial and leave no cause; and a
  // peer that is not reading cannot take a frame behind a half-sent message.
  // So a failing rank leaves its reason in `notes` (at "<prefix>left/<rank>")
  // before it closes, and a refused dial or a closed connection reads it;
  // neither waits long for the Store (askStore).
  void setNotes(std::shared_ptr<Store> notes) { notes_ = std::move(notes); }
  void leaveNote(const std::string& why) noexcept;
  // The note `peer` left, or "" where it left none or the Store did not
  // answer within `wait`.
  static constexpr auto kNoteWait = std::chrono::seconds(1);
  std::string readNote(int peer, Clock::duration wait = kNoteWait) const;

 private:
  // kAccepting: accepted, on its way to the sink (neither dial nor accept again).
  enum class State : uint8_t { kIdle, kDialing, kAccepting, kDone };
  struct Pending;  // an accepted connection whose hello has not fully arrived

  void acceptLoop();
  // A complete, valid hello from `peer` on `channel`: reply and keep or drop.
  void onHello(Socket socket, int peer, Channel channel);
  // Dials once; true if the peer accepted, false if it refused it as a duplicate.
  bool dial(int peer, Channel channel, Deadline deadline, int wakeFd, Socket* out);
  // The error of a dial the peer refused or closed unanswered: it left (a
  // failing rank closes its listener), so its note says why. `how` is what
  // this rank was doing.
  PeerClosedError gone(int peer, Deadline deadline, const std::string& how) const;
  // Local settings (congestion control, send buffer) for a new connection.
  void configure(Socket& s, int peer) const;

  const int rank_;
  Directory dir_;
  const std::string localCongestion_;
  std::mutex mu_;
  std::condition_variable changed_;
  std::vector<State> state_[kChannels];  // per peer
  std::vector<Socket> ready_[kChannels];  // accepted, not yet taken
  Sink sinks_[kChannels];
  bool stopped_ = false;
  std::string failed_;  // why an accepted connection could not be set up
  std::shared_ptr<Store> notes_;
  int stopFd_ = -1;  // an eventfd: wakes the acceptor to stop
  std::thread acceptor_;
};

}  // namespace collx::tcp

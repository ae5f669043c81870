"""TCP throughput between two hosts of tests/netns.py: k parallel streams,
plain Python sockets, no iperf needed.

    rate = stream_rate(hosts, src=0, dst=1, streams=4)   # {"bits_per_s": ..., "per_stream": [...], ...}

As a script it is one side, run inside a namespace by stream_rate():

    link_probe.py recv ADDR PORT STREAMS SECONDS WARMUP   # prints one JSON line
    link_probe.py send ADDR PORT STREAMS LIMIT [SPORT ...]

Rules, and why:

* The receiver measures: it counts the bytes its streams read in a window
  that opens WARMUP seconds after the last stream connected (past slow
  start and the token bucket's initial burst) and lasts SECONDS. Then it
  closes its sockets, which ends the sender: no clocks to agree on.
* The sender binds each stream to a source port whose flow_class() differs
  from the others' (distinct=True), so k streams under a per-flow cap get k
  caps: the check measures the shaping, not the hash's collisions (with
  random ports, 4 flows share some bucket 1 time in 3).
* Every wait is bounded: the sender gives up after LIMIT seconds, and
  stream_rate() kills both sides after their deadline.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CHUNK = 1 << 20


def _receive(addr, port, streams, seconds, warmup):
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, port))
    srv.listen(streams)
    srv.settimeout(30)
    print("ready", flush=True)
    conns = [srv.accept()[0] for _ in range(streams)]
    counts = [0] * streams

    def drain(j, c):
        buf = bytearray(CHUNK)
        try:
            while n := c.recv_into(buf):
                counts[j] += n
        except OSError:
            pass

    threads = [threading.Thread(target=drain, args=(j, c), daemon=True) for j, c in enumerate(conns)]
    for t in threads:
        t.start()
    time.sleep(warmup)
    before, t0 = list(counts), time.monotonic()
    time.sleep(seconds)
    after, t1 = list(counts), time.monotonic()
    ports = [(c.getpeername()[1], c.getsockname()[1]) for c in conns]
    for c in conns:
        c.shutdown(socket.SHUT_RDWR)
        c.close()
    per = [(a - b) * 8 / (t1 - t0) for a, b in zip(after, before)]
    print(json.dumps({"bits_per_s": sum(per), "per_stream": per, "ports": ports}), flush=True)


def _send(addr, port, streams, limit, sports):
    deadline = time.monotonic() + limit
    data = memoryview(bytes(4 * CHUNK))
    socks = []
    for j in range(streams):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if sports:
            s.bind(("", sports[j]))
        s.settimeout(limit)
        s.connect((addr, port))
        socks.append(s)

    def pump(s):
        try:
            while time.monotonic() < deadline:
                s.sendall(data)
        except OSError:
            pass  # the receiver closed: the measurement is over

    threads = [threading.Thread(target=pump, args=(s,), daemon=True) for s in socks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 1)


def distinct_ports(dport: int, streams: int, first: int = 20000) -> list[int]:
    """Source ports, one per stream, whose flows land in distinct buckets of
    the per-flow cap's hash (at most FLOW_BUCKETS streams)."""
    from netns import FLOW_BUCKETS, flow_class
    if streams > FLOW_BUCKETS:
        raise ValueError(f"at most {FLOW_BUCKETS} streams land in distinct buckets")
    out, seen = [], set()
    for p in range(first, first + 64 * FLOW_BUCKETS):
        c = flow_class(p, dport)
        if c not in seen:
            seen.add(c)
            out.append(p)
            if len(out) == streams:
                return out
    raise AssertionError("unreachable: 64 x 16 ports cover every bucket")


def stream_rate(hosts, src: int, dst: int, streams: int = 1, seconds: float = 1.5, warmup: float = 0.5,
                port: int = 5201, distinct: bool = True) -> dict:
    """`streams` TCP streams from host `src` to host `dst` of `hosts` (a
    netns.Hosts): their total throughput over `seconds`, measured by the
    receiver. Returns {"bits_per_s", "per_stream", "ports": [(sport, dport)]}."""
    py = sys.executable
    limit = warmup + seconds + 15
    recv = hosts.popen(dst, [py, __file__, "recv", hosts.addrs[dst], str(port), str(streams), str(seconds),
                             str(warmup)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    send = None
    try:
        if recv.stdout.readline().strip() != "ready":
            raise RuntimeError(f"link_probe receiver failed: {recv.stderr.read()[-2000:]}")
        sports = distinct_ports(port, streams) if distinct else []
        send = hosts.popen(src, [py, __file__, "send", hosts.addrs[dst], str(port), str(streams), str(limit),
                                 *map(str, sports)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        out, err = recv.communicate(timeout=limit + 5)
        if recv.returncode != 0:
            raise RuntimeError(f"link_probe receiver failed ({recv.returncode}): {err[-2000:]}")
        send.wait(timeout=10)
        return json.loads(out.strip().splitlines()[-1])
    finally:
        for p in (recv, send):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def main(argv):
    mode, addr, port, streams = argv[0], argv[1], int(argv[2]), int(argv[3])
    if mode == "recv":
        _receive(addr, port, streams, float(argv[4]), float(argv[5]))
    else:
        _send(addr, port, streams, float(argv[4]), [int(p) for p in argv[5:]])


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main(sys.argv[1:])

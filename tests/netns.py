"""Hosts on one machine: h network namespaces, each with one "NIC" (a veth)
plugged into one bridge, and torchrun launched in each. Used by
tests/test_two_hosts.py, tests/test_hosts_harness.py, benchmarks/two_hosts.py,
benchmarks/hosts.py and benchmarks/hosts_link.py.

    with Hosts(3) as hosts:                   # needs root and iproute2
        hosts.shape("1gbit", flow_cap="250mbit")
        procs = hosts.torchrun(script, args, env, port=29600, nproc=[2, 1, 1])
        hosts.link_down(0)                    # cut host 0's wire mid-run

Topology. Host i is namespace ``ns[i]`` with address ``addrs[i]``
(10.77.0.(i+1)/24) on its NIC ``veth[i]``; the NIC's peer ``ports[i]`` is
plugged into bridge ``br0`` in a namespace of its own (``bridge_ns``), so
nothing touches the root namespace's networking. Every packet between two
hosts leaves the sender's NIC (egress of ``veth[i]``) and enters the
receiver's (egress of ``ports[j]``, toward the host): shaping both ends of
each host's veth shapes each NIC both ways, as a switch port would.

Names carry this process's pid (and a count of its objects), so concurrent
runs and objects never collide, and teardown deletes only what this object
created: it SIGKILLs every process still inside its namespaces (``ip netns
pids``), then deletes the namespaces, which destroys the veths and the
bridge with them.

This kernel may lack netem (delay, loss): shape() probes for it once, says
so once per process, and shapes the rate alone.

``TwoHosts`` is ``Hosts(2)``, for the callers written before h hosts.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys

ADDRS = ("10.77.0.1", "10.77.0.2")   # the two hosts' addresses, kept for old callers
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
MAX_HOSTS = 16
IFNAMSIZ = 15

# The per-flow cap's hash: bits 1..4 of each TCP port (bit 0 is useless: Linux
# gives connect() even ports and bind(0) odd ones, so a client's and a
# listener's low bits always differ), combined by xor.
FLOW_BUCKETS = 16
FLOW_PORT_SHIFT = 1
_FLOW_MINOR0 = 0x10   # htb classes 1:10 .. 1:1f hold the 16 buckets; 1:2 is the default class


class NamespacesUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no iproute2, EPERM...)."""


def address(host: int) -> str:
    return f"10.77.0.{host + 1}"


def _ip(*args, ns=None, check=True, timeout=20):
    argv = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


_OBJECTS = itertools.count()   # tells apart the Hosts objects of one process


def _tag() -> str:
    """cx<pid>, then cx<pid>x1, cx<pid>x2... (hex, modulo 256: 15 characters
    at most with the NIC's suffix) for the process's later objects."""
    k = next(_OBJECTS) % 256
    return f"cx{os.getpid()}" + (f"x{k:x}" if k else "")


def _tc_batch(ns: str, lines: list[str], what: str):
    """Runs tc commands (without the leading `tc`) in namespace `ns`, in one
    process: a per-flow cap is ~300 commands per device."""
    p = subprocess.run(["ip", "netns", "exec", ns, "tc", "-batch", "-"], input="\n".join(lines) + "\n",
                       capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise RuntimeError(f"tc ({what}) failed in {ns}: {p.stderr.strip()[-2000:]}")


# ---------------------------------------------------------------- rates

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


def rate_bits(rate: str | float) -> int:
    """A tc rate ("1gbit", "200mbit", "5e8"; tc's units: k = 1000, "bps" =
    bytes/s, a bare number = bits/s) -> bits per second."""
    if isinstance(rate, (int, float)):
        return int(rate)
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", rate)
    unit = (m.group(2).lower() or "bit") if m else None
    if not m or unit not in _RATE_UNITS:
        raise ValueError(f"not a tc rate: {rate!r} (e.g. 1gbit, 200mbit)")
    return int(float(m.group(1)) * _RATE_UNITS[unit])


def flow_class(sport: int, dport: int) -> int:
    """The per-flow cap's bucket (0..15) of a TCP flow. Symmetric, so both
    directions of a connection land in the same bucket on each device."""
    mask = FLOW_BUCKETS - 1
    return ((sport >> FLOW_PORT_SHIFT) & mask) ^ ((dport >> FLOW_PORT_SHIFT) & mask)


_NETEM: bool | None = None
_NETEM_SAID = False


def netem_available(ns: str) -> bool:
    """Whether this kernel has the netem qdisc: probed once per process on
    `ns`'s loopback (a namespace of ours, so nothing else is touched)."""
    global _NETEM
    if _NETEM is None:
        add = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                              "delay", "0ms"], capture_output=True, text=True, timeout=20)
        _NETEM = add.returncode == 0
        if _NETEM:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "lo", "root"],
                           capture_output=True, timeout=20)
    return _NETEM


# ---------------------------------------------------------------- qdiscs

def _burst(bits: int) -> int:
    """Token-bucket depth in bytes: 1 ms at the rate, at least 256 KiB (what
    TwoHosts always used). Deeper at high rates, so the bucket never waits on
    a timer between refills."""
    return max(256 << 10, bits // 8 // 1000)


def _tbf(dev: str, parent: str, bits: int) -> list[str]:
    return [f"qdisc add dev {dev} {parent} handle 10: tbf rate {bits}bit burst {_burst(bits)} latency 100ms"]


def _htb_flow_cap(dev: str, parent: str, bits: int, cap: int) -> list[str]:
    """An htb parent at the NIC's rate; 16 children at the per-flow cap; a
    two-level u32 hash that puts each TCP flow in child (sport bits 1..4) xor
    (dport bits 1..4); everything else (ARP, non-TCP) in a default child.

    The approximation: a real network caps each flow alone; here two flows
    whose ports hash alike (1 in 16 per pair) share one cap. Each child is
    guaranteed min(cap, NIC/17) and may borrow from the parent up to the cap,
    so the children together never exceed the NIC. u32 cannot xor two fields,
    so the first table hashes on sport and each of its 16 buckets links to a
    second table that hashes on dport, whose 256 leaves name the class. TCP
    ports sit at offset 20 only without IP options (IHL 5, as Linux sends);
    other packets go to the default class, uncapped below the NIC."""
    burst = _burst(bits)
    cap_burst = _burst(cap)
    h = "1:"
    out = [f"qdisc add dev {dev} {parent} handle {h} htb default 2",
           f"class add dev {dev} parent {h} classid {h}1 htb rate {bits}bit ceil {bits}bit "
           f"burst {burst} cburst {burst} quantum 65536",
           f"class add dev {dev} parent {h}1 classid {h}2 htb rate {max(bits // 100, 8000)}bit ceil {bits}bit "
           f"burst {burst} cburst {burst} quantum 65536"]
    guaranteed = min(cap, bits // (FLOW_BUCKETS + 1))
    for k in range(FLOW_BUCKETS):
        out.append(f"class add dev {dev} parent {h}1 classid {h}{_FLOW_MINOR0 + k:x} htb rate {guaranteed}bit "
                   f"ceil {cap}bit burst {cap_burst} cburst {cap_burst} quantum 65536")
    f = f"filter add dev {dev} parent {h} prio 1 protocol ip"
    mask = FLOW_BUCKETS - 1
    sport_mask, dport_mask = (mask << FLOW_PORT_SHIFT) << 16, mask << FLOW_PORT_SHIFT
    out.append(f"{f} handle 100: u32 divisor {FLOW_BUCKETS}")
    for a in range(FLOW_BUCKETS):
        out.append(f"{f} handle {0x200 + a:x}: u32 divisor {FLOW_BUCKETS}")
        for b in range(FLOW_BUCKETS):
            out.append(f"{f} u32 ht {0x200 + a:x}:{b:x}: match u32 0 0 flowid {h}{_FLOW_MINOR0 + (a ^ b):x}")
    for a in range(FLOW_BUCKETS):
        out.append(f"{f} u32 ht 100:{a:x}: match u32 0 0 link {0x200 + a:x}: hashkey mask 0x{dport_mask:08x} at 20")
    out.append(f"{f} u32 ht 800:: match ip protocol 6 0xff match u8 0x45 0xff at 0 "
               f"link 100: hashkey mask 0x{sport_mask:08x} at 20")
    return out


def _qdiscs(dev: str, bits: int, cap: int | None, netem: str | None) -> list[str]:
    """The tc commands that shape `dev`'s egress: netem (delay, loss) at the
    root where asked, then the rate (tbf), or the rate and per-flow cap (htb)."""
    out, parent = [], "root"
    if netem:
        out.append(f"qdisc add dev {dev} root handle 9: netem {netem} limit 100000")
        parent = "parent 9:1"
    return out + (_htb_flow_cap(dev, parent, bits, cap) if cap else _tbf(dev, parent, bits))


# ---------------------------------------------------------------- hosts

class Hosts:
    """h namespaces ("hosts") on one bridge; see the module docstring."""

    def __init__(self, h: int, tag: str | None = None):
        if not 1 <= h <= MAX_HOSTS:
            raise ValueError(f"hosts: 1 to {MAX_HOSTS}, not {h}")
        tag = tag or _tag()
        if len(f"{tag}n{h - 1}") > IFNAMSIZ:
            raise ValueError(f"tag {tag!r} is too long for interface names ({IFNAMSIZ} characters)")
        self.h = h
        self.ns = tuple(f"{tag}h{i}" for i in range(h))
        self.bridge_ns = f"{tag}br"
        self.veth = tuple(f"{tag}n{i}" for i in range(h))    # each host's NIC, inside ns[i]
        self.ports = tuple(f"{tag}p{i}" for i in range(h))   # its peer on the bridge, inside bridge_ns
        self.addrs = tuple(address(i) for i in range(h))
        self.shaped: dict | None = None
        self._made = []

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> "Hosts":
        if shutil.which("ip") is None:
            raise NamespacesUnavailable("`ip` (iproute2) is not installed")
        if os.geteuid() != 0:
            raise NamespacesUnavailable("network namespaces need root")
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self):
        for ns in (self.bridge_ns, *self.ns):
            p = _ip("netns", "add", ns, check=False)
            if p.returncode != 0:
                raise NamespacesUnavailable(f"ip netns add {ns}: {p.stderr.strip()}")
            self._made.append(ns)
            _ip("link", "set", "lo", "up", ns=ns)
        p = _ip("link", "add", "br0", "type", "bridge", "forward_delay", "0", ns=self.bridge_ns, check=False)
        if p.returncode != 0:
            raise NamespacesUnavailable(f"cannot create a bridge: {p.stderr.strip()}")
        _ip("link", "set", "br0", "up", ns=self.bridge_ns)
        for i in range(self.h):
            p = _ip("link", "add", self.ports[i], "type", "veth", "peer", "name", self.veth[i],
                    "netns", self.ns[i], ns=self.bridge_ns, check=False)
            if p.returncode != 0:
                raise NamespacesUnavailable(f"cannot create a veth pair: {p.stderr.strip()}")
            _ip("link", "set", self.ports[i], "master", "br0", ns=self.bridge_ns)
            _ip("link", "set", self.ports[i], "up", ns=self.bridge_ns)
            _ip("addr", "add", f"{self.addrs[i]}/24", "dev", self.veth[i], ns=self.ns[i])
            _ip("link", "set", self.veth[i], "up", ns=self.ns[i])

    def __exit__(self, *exc):
        self.close()

    def close(self):
        for ns in reversed(self._made):
            self.kill_all(ns)
            _ip("netns", "del", ns, check=False)
        self._made.clear()

    def kill_all(self, ns):
        """SIGKILLs every process inside namespace `ns` (ours: it is unique)."""
        p = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20)
        for pid in p.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    # ------------------------------------------------------------ use

    def popen(self, host: int, argv, env=None, **kw) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.ns[host], *argv], env=env, **kw)

    def torchrun(self, script, args, env, port, nproc=2, log_dir=None, torchrun=TORCHRUN):
        """One torchrun per host (node rank = host), rendezvous on host 0.
        Each agent is told its own address (--local-addr) and which one hosts
        the store (is_host): its hostname resolves to no namespace. `nproc`
        is the ranks per host, one number or one per host (uneven hosts).
        Each rank gets COLLX_SOCKET_IFNAME = its host's NIC and NETNS_HOST =
        its host's index; GLOO_SOCKET_IFNAME too, unless `env` sets it (the
        shared hostname resolves to 127.0.0.1, where gloo would listen).
        `torchrun` is the executable, by default this interpreter's venv's.
        Logs go to LOG_DIR/host{i}.log (logs() reads them)."""
        nprocs = [nproc] * self.h if isinstance(nproc, int) else list(nproc)
        if len(nprocs) != self.h:
            raise ValueError(f"nproc: one count per host ({self.h}), not {nprocs}")
        procs = []
        for host in range(self.h):
            argv = [torchrun, f"--nnodes={self.h}", f"--nproc_per_node={nprocs[host]}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={self.addrs[0]}:{port}", f"--rdzv-conf=is_host={int(host == 0)}",
                    f"--local-addr={self.addrs[host]}", f"--node-rank={host}", "--max-restarts=0",
                    script, *args]
            e = dict(env, COLLX_SOCKET_IFNAME=self.veth[host], NETNS_HOST=str(host))
            e.setdefault("GLOO_SOCKET_IFNAME", self.veth[host])
            out = open(os.path.join(log_dir, f"host{host}.log"), "wb") if log_dir else subprocess.DEVNULL
            procs.append(self.popen(host, argv, env=e, stdout=out, stderr=subprocess.STDOUT))
            if log_dir:
                out.close()  # the child holds its own descriptor
        return procs

    def logs(self, log_dir, tail=3000) -> str:
        """The last `tail` bytes of each host's torchrun log in `log_dir`."""
        out = []
        for host in range(self.h):
            try:
                with open(os.path.join(log_dir, f"host{host}.log"), "rb") as f:
                    text = f.read()[-tail:].decode("utf-8", "replace")
                out.append(f"--- host {host} (last {tail} bytes) ---\n{text}")
            except OSError:
                pass
        return "\n".join(out)

    def shape(self, rate, flow_cap=None, delay=None, loss=None, hosts=None):
        """Shapes each host's NIC both ways (egress of its veth, and egress of
        the bridge's port toward it), replacing any shape before:

        * `rate` (tc syntax, e.g. "1gbit"): a token bucket (tbf);
        * `flow_cap` (e.g. "250mbit"): instead an htb at `rate` whose TCP
          flows are each held to the cap, by a hash of their ports
          (_htb_flow_cap says how, and how it approximates);
        * `delay` (e.g. "50us") and `loss` (e.g. "0.1%"): netem on the host's
          egress only, so a packet between two hosts is delayed once (RTT =
          2 x delay) and dropped with probability `loss`. Where the kernel
          has no netem, one message says so and the shape goes on without.

        `hosts`: the hosts to shape (default all)."""
        bits = rate_bits(rate)
        cap = rate_bits(flow_cap) if flow_cap else None
        if cap is not None and not 0 < cap <= bits:
            raise ValueError(f"flow cap {flow_cap} must be above 0 and at most the rate {rate}")
        netem = self._netem_args(delay, loss)
        for i in range(self.h) if hosts is None else hosts:
            self._unshape(i)
            _tc_batch(self.ns[i], _qdiscs(self.veth[i], bits, cap, netem), f"shape {self.veth[i]}")
            _tc_batch(self.bridge_ns, _qdiscs(self.ports[i], bits, cap, None), f"shape {self.ports[i]}")
        self.shaped = {"rate_bits": bits, "flow_cap_bits": cap, "netem": netem}

    def _netem_args(self, delay, loss) -> str | None:
        if not delay and not loss:
            return None
        if not netem_available(self.bridge_ns):
            global _NETEM_SAID
            if not _NETEM_SAID:
                print(f"netns: this kernel has no netem qdisc, so delay ({delay}) and loss ({loss}) are not "
                      "emulated; shaping the rate only", file=sys.stderr, flush=True)
                _NETEM_SAID = True
            return None
        return " ".join(([f"delay {delay}"] if delay else []) + ([f"loss {loss}"] if loss else []))

    def unshape(self):
        for i in range(self.h):
            self._unshape(i)
        self.shaped = None

    def _unshape(self, i):
        for ns, dev in ((self.ns[i], self.veth[i]), (self.bridge_ns, self.ports[i])):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True, timeout=20)

    def link_down(self, host: int):
        _ip("link", "set", self.veth[host], "down", ns=self.ns[host])

    def link_up(self, host: int):
        _ip("link", "set", self.veth[host], "up", ns=self.ns[host])


class TwoHosts(Hosts):
    """Hosts(2): the two-host harness its older callers know (tests/
    test_two_hosts.py, benchmarks/two_hosts.py, tests/installed/)."""

    def __init__(self, tag: str | None = None):
        super().__init__(2, tag)

"""Two "hosts" on one machine: two network namespaces joined by a veth pair,
and torchrun launched in each. Used by tests/test_two_hosts.py and
benchmarks/two_hosts.py.

    with TwoHosts() as hosts:                 # needs root and iproute2
        procs = hosts.torchrun(script, args, env, port=29600, nproc=2)
        hosts.link_down(0)                    # cut the wire mid-run

Names carry this process's pid, so concurrent runs never collide, and
teardown deletes only what this object created: it SIGKILLs every process
still inside its namespaces (``ip netns pids``), then deletes the namespaces,
which destroys the veth pair with them.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

ADDRS = ("10.77.0.1", "10.77.0.2")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


class NamespacesUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no iproute2, EPERM...)."""


def _ip(*args, ns=None, check=True, timeout=20):
    argv = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


class TwoHosts:
    def __init__(self, tag: str | None = None):
        tag = tag or f"cx{os.getpid()}"
        self.ns = (f"{tag}a", f"{tag}b")
        self.veth = (f"{tag}a0"[:15], f"{tag}b0"[:15])  # IFNAMSIZ
        self.addrs = ADDRS
        self._made = []

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> "TwoHosts":
        if shutil.which("ip") is None:
            raise NamespacesUnavailable("`ip` (iproute2) is not installed")
        if os.geteuid() != 0:
            raise NamespacesUnavailable("network namespaces need root")
        try:
            for ns in self.ns:
                p = _ip("netns", "add", ns, check=False)
                if p.returncode != 0:
                    raise NamespacesUnavailable(f"ip netns add {ns}: {p.stderr.strip()}")
                self._made.append(ns)
            p = _ip("link", "add", self.veth[0], "netns", self.ns[0], "type", "veth",
                    "peer", "name", self.veth[1], "netns", self.ns[1], check=False)
            if p.returncode != 0:
                raise NamespacesUnavailable(f"cannot create a veth pair: {p.stderr.strip()}")
            for ns, veth, addr in zip(self.ns, self.veth, self.addrs):
                _ip("link", "set", "lo", "up", ns=ns)
                _ip("addr", "add", f"{addr}/24", "dev", veth, ns=ns)
                _ip("link", "set", veth, "up", ns=ns)
        except BaseException:
            self.close()
            raise
        return self

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

    def torchrun(self, script, args, env, port, nproc=2, log_dir=None):
        """One torchrun per host (node rank = host), rendezvous on host 0.
        Each agent is told its own address (--local-addr) and which one hosts
        the store (is_host): its hostname resolves to neither namespace."""
        procs = []
        for host in (0, 1):
            argv = [TORCHRUN, "--nnodes=2", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={self.addrs[0]}:{port}", f"--rdzv-conf=is_host={int(host == 0)}",
                    f"--local-addr={self.addrs[host]}", f"--node-rank={host}", "--max-restarts=0",
                    script, *args]
            e = dict(env, COLLX_SOCKET_IFNAME=self.veth[host])
            out = open(os.path.join(log_dir, f"host{host}.log"), "wb") if log_dir else subprocess.DEVNULL
            procs.append(self.popen(host, argv, env=e, stdout=out, stderr=subprocess.STDOUT))
        return procs

    def shape(self, rate: str):
        """Limits each direction of the wire to `rate` (tc syntax, e.g. "1gbit")
        with a token bucket on both veth ends: a network, not a memory copy."""
        for ns, veth in zip(self.ns, self.veth):
            p = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", veth, "root", "tbf",
                                "rate", rate, "burst", "256kb", "latency", "100ms"],
                               capture_output=True, text=True, timeout=20)
            if p.returncode != 0:
                raise RuntimeError(f"tc qdisc add on {veth} failed: {p.stderr.strip()}")

    def link_down(self, host: int):
        _ip("link", "set", self.veth[host], "down", ns=self.ns[host])

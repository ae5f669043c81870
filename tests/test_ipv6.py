"""IPv6: COLLX_SOCKET_FAMILY=AF_INET6 (Options.socket_family) with
COLLX_SOCKET_IFNAME=lo puts collx's own connections on ::1, and a group whose
store is reached over tcp://[::1]:port works. Skipped where ::1 cannot be bound.
"""
from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

torchcollx = pytest.importorskip("torchcollx")

import launcher  # noqa: E402
from launcher import run_ranks  # noqa: E402
from common import socket_inodes  # noqa: E402


def _ipv6_loopback_works():
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback_works(), reason="no IPv6 loopback (::1) here")
IPV6_ENV = {"COLLX_SOCKET_IFNAME": "lo", "COLLX_SOCKET_FAMILY": "AF_INET6"}


def test_socket_family_option(monkeypatch):
    monkeypatch.delenv("COLLX_SOCKET_FAMILY", raising=False)
    assert torchcollx.Options().resolved().socket_family == ""
    assert torchcollx.Options(socket_family="AF_INET6").resolved().socket_family == "AF_INET6"
    monkeypatch.setenv("COLLX_SOCKET_FAMILY", "AF_INET")
    assert torchcollx.Options().resolved().socket_family == "AF_INET"
    assert torchcollx.Options(socket_family="AF_INET6").resolved().socket_family == "AF_INET6"  # field wins
    monkeypatch.setenv("COLLX_SOCKET_FAMILY", "inet7")
    with pytest.raises(ValueError, match="COLLX_SOCKET_FAMILY"):
        torchcollx.Options().resolved()
    with pytest.raises(ValueError, match="socket_family"):
        torchcollx.Options(socket_family="ipv6").resolved()


def _established_tcp_families():
    """{"tcp": n, "tcp6": n}: this process's established TCP connections."""
    inodes = socket_inodes()
    out = {}
    for table in ("tcp", "tcp6"):
        with open(f"/proc/self/net/{table}") as f:
            rows = [line.split() for line in f.readlines()[1:]]
        out[table] = sum(1 for r in rows if r[3] == "01" and r[9] in inodes)
    return out


def _over_ipv6(rank, ws, port):
    if port:  # the store over IPv6 too
        dist.init_process_group("collx", init_method=f"tcp://[::1]:{port}", rank=rank, world_size=ws)
    x = torch.full((100003,), float(rank + 1))
    dist.all_reduce(x)
    assert torch.equal(x, torch.full_like(x, ws * (ws + 1) / 2)), x[:3]
    b = torch.arange(10.0) if rank == 0 else torch.zeros(10)
    dist.broadcast(b, src=0)
    assert torch.equal(b, torch.arange(10.0)), b
    families = _established_tcp_families()
    dist.barrier()  # no rank closes its connections before every rank has looked
    if port:
        dist.destroy_process_group()
    return families


@needs_ipv6
@pytest.mark.parametrize("ws", [2, 3], ids=lambda ws: f"ws{ws}")
def test_collx_connections_are_ipv6(ws):
    """file:// rendezvous, so every TCP connection of a rank is collx's own:
    all of them IPv6, two per peer (the collectives' channel and the p2p one)."""
    res = run_ranks(_over_ipv6, ws, timeout=120, env=IPV6_ENV, args=(None,))
    for rank, fam in enumerate(res):
        assert fam["tcp"] == 0 and fam["tcp6"] == 2 * (ws - 1), f"rank {rank}: established connections {fam}"


@needs_ipv6
def test_group_with_store_over_ipv6():
    res = run_ranks(_over_ipv6, 2, timeout=120, env=IPV6_ENV, init=False, args=(launcher.free_port(),))
    for rank, fam in enumerate(res):
        assert fam["tcp"] == 0, f"rank {rank}: IPv4 connections {fam}"

"""A process outside the group connects to rank 0's collx listener while the
mesh forms (the port found through /proc, as any local process could) and
sends garbage, a hello with a wrong magic or a wrong token, half a hello, or
nothing. The group must form anyway, without waiting for the silent ones,
and work; afterwards the port refuses connections. (tests/cpp/test_rendezvous
covers more variants, with addresses read from the Store.)
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchcollx")

from common import socket_inodes  # noqa: E402
from launcher import run_ranks  # noqa: E402

HELLO_MAGIC = 0x436C5848

STRANGER = textwrap.dedent("""
    import socket, struct, sys, time
    host, port, magic = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    hello = lambda m, token: struct.pack("<IiiIQQ", m, 2, 3, 0, 0, token)
    payloads = [bytes(range(7, 39)), hello(0x12345678, 1), hello(magic, 0xDEADBEEF), hello(magic, 1)[:16], b""]
    conns = []
    for p in payloads:
        s = socket.create_connection((host, port))
        s.sendall(p)
        conns.append(s)
    print("in", flush=True)
    time.sleep(60)  # hold them open; the test kills this process
""")


def _address(hexaddr):
    """/proc/net/tcp{,6}'s "HEX:PORT" as (host, port)."""
    import socket

    h, p = hexaddr.split(":")
    raw = bytes.fromhex(h)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words), int(p, 16)


def _listening_addresses():
    inodes = socket_inodes()
    ports = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/self/net/{table}") as f:
            for row in (line.split() for line in f.readlines()[1:]):
                if row[3] == "0A" and row[9] in inodes:
                    ports.append(_address(row[1]))
    return ports


def _strangers(rank, ws, flag):
    stranger, port = None, None
    if rank == 0:
        found = {}

        def find_and_call():
            nonlocal stranger
            while not (addrs := _listening_addresses()):
                time.sleep(0.01)
            found["addr"] = addrs[0]
            stranger = subprocess.Popen([sys.executable, "-c", STRANGER, *map(str, addrs[0]), str(HELLO_MAGIC)],
                                        stdout=subprocess.PIPE, text=True)
            assert stranger.stdout.readline().strip() == "in"
            open(flag, "w").close()

        t = threading.Thread(target=find_and_call, daemon=True)
        t.start()
    elif rank == ws - 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.path.exists(flag), "the stranger never connected"
    t0 = time.monotonic()
    dist.init_process_group("collx", init_method=os.environ["COLLX_TEST_INIT_METHOD"], rank=rank, world_size=ws)
    init_took = time.monotonic() - t0
    x = torch.full((1000,), float(rank))
    dist.all_reduce(x)
    assert torch.equal(x, torch.full_like(x, ws * (ws - 1) / 2)), x[:3]
    refused = None
    if rank == 0:
        t.join()
        port = found["addr"]
        import socket
        try:
            socket.create_connection(port, timeout=5).close()
            refused = False
        except ConnectionRefusedError:
            refused = True
        stranger.kill()
        stranger.wait()
    dist.destroy_process_group()
    return {"init_took": init_took, "refused": refused, "port": port}


def test_strangers_during_setup_are_dropped(tmp_path):
    res = run_ranks(_strangers, 3, timeout=120, init=False, args=(str(tmp_path / "stranger_in"),))
    print(res)
    assert res[0]["refused"] is True, f"rank 0's port {res[0]['port']} still accepts after setup"
    for rank, r in enumerate(res):  # rank 0 accepts the strangers: its init is the one they could hold up
        assert r["init_took"] < 5, f"rank {rank}'s init took {r['init_took']:.1f} s (held up by the strangers)"

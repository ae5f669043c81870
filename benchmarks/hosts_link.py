"""Checks the emulated network of tests/netns.py itself: TCP throughput of
one stream and of four parallel streams between two hosts, unshaped, with
the NIC shaped to --rate, and with a per-flow cap (--flow-cap) below it.

    sudo .venv/bin/python benchmarks/hosts_link.py [--rate 1gbit] [--flow-cap 250mbit] [--seconds 1.5]

Expected: unshaped, whatever the veth's memory copy gives; shaped, one stream
and four each near the NIC's rate; capped, one stream near the cap and four
near min(NIC, 4 x cap). The streams use source ports in distinct buckets of
the cap's hash (tests/link_probe.py says why).

"ratio" is the goodput over the configured limit. tc counts whole frames and
TCP delivers the payload: 1448 of each 1514 bytes (timestamps on), so a
perfect shaper reads 0.956.

The veth is a memory copy, not a wire: a shaped rate above a third of the
unshaped one measures the CPU as much as the network, and the script says so.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from link_probe import stream_rate  # noqa: E402
from netns import Hosts, NamespacesUnavailable, rate_bits  # noqa: E402

PAYLOAD_SHARE = 1448 / 1514   # TCP payload per Ethernet frame at MTU 1500, with timestamps


def measure(hosts, label, limit_of, streams, seconds):
    """Rows of (label, streams, bits/s, limit or None, per-stream bits/s)."""
    rows = []
    for k in streams:
        r = stream_rate(hosts, 0, 1, k, seconds=seconds)
        rows.append((label, k, r["bits_per_s"], limit_of(k), r["per_stream"]))
    return rows


def check(rate: str, flow_cap: str | None, streams=(1, 4), seconds=1.5, hosts=None) -> list[tuple]:
    """Measures unshaped, shaped at `rate`, and (if `flow_cap`) capped; on
    `hosts` (a netns.Hosts of at least 2, left unshaped) or 2 fresh hosts."""
    if hosts is None:
        with Hosts(2) as fresh:
            return check(rate, flow_cap, streams, seconds, fresh)
    nic = rate_bits(rate)
    rows = measure(hosts, "unshaped (veth)", lambda k: None, streams, seconds)
    hosts.shape(rate)
    rows += measure(hosts, f"NIC {rate}", lambda k: nic, streams, seconds)
    if flow_cap:
        cap = rate_bits(flow_cap)
        hosts.shape(rate, flow_cap=flow_cap)
        rows += measure(hosts, f"NIC {rate}, flow cap {flow_cap}", lambda k: min(nic, k * cap), streams, seconds)
    hosts.unshape()
    return rows


def report(rows, file=sys.stdout):
    print(f"{'shape':<34} {'streams':>7} {'Gbit/s':>8} {'limit':>8} {'ratio':>6}  per stream (Gbit/s)", file=file)
    for label, k, bits, limit, per in rows:
        lim = f"{limit / 1e9:8.3f}" if limit else f"{'-':>8}"
        ratio = f"{bits / limit:6.3f}" if limit else f"{'-':>6}"
        print(f"{label:<34} {k:>7} {bits / 1e9:8.3f} {lim} {ratio}  {' '.join(f'{p / 1e9:.3f}' for p in per)}",
              file=file)
    unshaped = min((b for label, k, b, lim, _ in rows if lim is None and k == 1), default=None)
    shaped = max((lim for *_, lim, _ in rows if lim), default=None)
    print(f"(a perfect shaper reads ratio {PAYLOAD_SHARE:.3f}: tc counts frames, TCP delivers payload)", file=file)
    if unshaped and shaped and shaped > unshaped / 3:
        print(f"WARNING: the shaped rate {shaped / 1e9:.2f} Gbit/s is above a third of one unshaped stream "
              f"({unshaped / 1e9:.2f} Gbit/s): these figures measure the CPU as much as the network", file=file)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", default="1gbit", help="the NIC's rate, tc syntax")
    p.add_argument("--flow-cap", default="250mbit", help="per-flow cap, tc syntax ('' for none)")
    p.add_argument("--streams", default="1,4", help="comma list of parallel stream counts")
    p.add_argument("--seconds", type=float, default=1.5, help="measuring window per point")
    args = p.parse_args()
    try:
        rows = check(args.rate, args.flow_cap or None, [int(s) for s in args.streams.split(",")], args.seconds)
    except NamespacesUnavailable as e:
        sys.exit(f"cannot create network namespaces: {e}")
    print(f"TCP goodput from host 0 to host 1 (tests/netns.py, Python sockets), {args.seconds} s after 0.5 s warm-up")
    report(rows)


if __name__ == "__main__":
    main()

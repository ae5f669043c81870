#!/usr/bin/env bash
# Runs a command with loopback limited to RATE per direction (a tc token
# bucket on lo), then lifts the limit, also when the command fails or is
# interrupted. Needs root (tc). Loopback carries every local TCP byte, the
# Store's included; ranks on shared memory bypass it, so force TCP:
#
#   sudo benchmarks/limit_loopback.sh 1gbit env COLLX_TRANSPORT=tcp XDG_CACHE_HOME=$(mktemp -d) \
#       .venv/bin/torchrun --nproc_per_node=2 benchmarks/allreduce.py --transports tcp --max-size 16M
#
# A fresh XDG_CACHE_HOME makes collx calibrate on the limited link rather than
# reuse a tuning cached on the full one. The limited loopback stands for a
# link between hosts, so collx keeps the system's congestion control on it
# (COLLX_TCP_CONGESTION=system) instead of the reno it uses within a host.
#
# The bucket holds 70 KB, just over one loopback packet (64 KiB MTU): a link
# never sends faster than its rate, while a bucket of 256 KiB let 2 ms of
# traffic through at loopback speed, so that 16 ops of a trial ran on tokens
# that back-to-back ops soon used up (direct at 1 KiB, n=4: 54 us an op, 105
# once the bucket was empty; star 50).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 RATE COMMAND [ARGS...]   (RATE in tc syntax, e.g. 1gbit)" >&2
  exit 2
fi
rate=$1
shift
if tc qdisc show dev lo | grep -q "qdisc tbf"; then
  echo "$0: lo already has a tbf qdisc; remove it first (tc qdisc del dev lo root)" >&2
  exit 1
fi
tc qdisc add dev lo root tbf rate "$rate" burst 70kb latency 100ms
trap 'tc qdisc del dev lo root' EXIT
export COLLX_TCP_CONGESTION=${COLLX_TCP_CONGESTION:-system}
"$@"

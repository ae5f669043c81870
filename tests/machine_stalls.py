"""Times when the whole machine stopped, seen from a process of its own.

The tests bound how fast collx notices a failure (a timeout near the one
set, a dead peer within seconds). Those bounds hold for collx, not for a
machine whose virtual CPUs the host stops for seconds: then every process
overruns together. ``StallWatch`` runs a small process that sleeps 50 ms at a
time and reports each sleep that overran by more than ``LIMIT_S``; no test's
load delays a woken sleeper that long on its own, so such a gap is the
machine's. conftest.py reruns a test that failed while one was seen, once,
and names the stall in the summary.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

SLEEP_S = 0.05
LIMIT_S = 1.0


class StallWatch:
    def __init__(self):
        self._stalls: list[tuple[float, float]] = []  # (monotonic start, end)
        self._lock = threading.Lock()
        self._proc = subprocess.Popen([sys.executable, __file__], stdout=subprocess.PIPE, text=True)
        self._proc.stdout.readline()  # watching from here on
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self._proc.stdout:
            start, end = map(float, line.split())
            with self._lock:
                self._stalls.append((start, end))

    def during(self, start: float, end: float) -> list[tuple[float, float]]:
        """The stalls that overlapped [start, end] (time.monotonic() values)."""
        time.sleep(2 * SLEEP_S)  # a stall that has just ended is reported
        with self._lock:
            return [(a, b) for a, b in self._stalls if a < end and b > start]

    def close(self):
        self._proc.kill()
        self._proc.wait()


def _watch():
    parent = os.getppid()
    print("watching", flush=True)
    last = time.monotonic()
    while os.getppid() == parent:  # ends with the session, however it ends
        time.sleep(SLEEP_S)
        now = time.monotonic()
        if now - last > SLEEP_S + LIMIT_S:
            print(f"{last:.3f} {now:.3f}", flush=True)
        last = now


if __name__ == "__main__":
    _watch()

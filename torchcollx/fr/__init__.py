"""collx's flight recorder in torch's dumps, and an analyzer of per-rank dumps.

collx records its ops in a flight recorder of torch's own format (see
``csrc/torch/recorder.h`` for why it is not torch's instance). Importing
torchcollx makes ``torch._C._distributed_c10d._dump_fr_trace`` (and its JSON
form) return torch's entries and collx's together.

A failed op writes each rank's dump to ``$TORCH_FR_DUMP_TEMP_FILE<rank>``
when ``TORCH_FR_BUFFER_SIZE`` is set above 0, with the failure's text under
``collx_failure``.

torch's analyzer refuses backend names it does not list, so::

    python -m torchcollx.fr DUMP_PREFIX

reads every rank's dump and prints the first op that not every rank
completed, which ranks never reached it, and any mismatch in op, size or dtype.
"""
from __future__ import annotations

import functools
import glob
import json
import pickle
import re

import torch

from .. import _C

_c10d = torch._C._distributed_c10d


def _merged(theirs: dict, ours: dict) -> dict:
    out = dict(theirs)
    out["pg_config"] = {**theirs.get("pg_config", {}), **ours.get("pg_config", {})}
    # Keyed by each recorder's own group ids, which may coincide.
    status = dict(theirs.get("pg_status", {}))
    for pg_id, s in ours.get("pg_status", {}).items():
        status[f"collx:{pg_id}" if pg_id in status else pg_id] = s
    entries = list(theirs.get("entries", [])) + list(ours.get("entries", []))
    if entries or "entries" in theirs or "entries" in ours:
        out["entries"] = sorted(entries, key=lambda e: e.get("time_created_ns", 0))
    out["pg_status"] = status
    return out


def _with_collx(dump, dump_json):
    @functools.wraps(dump)
    def dump_fr_trace(includeCollectives=None, includeStackTraces=None, onlyActive=None):
        flags = [True if v is None else bool(v) for v in (includeCollectives, includeStackTraces)]
        only = bool(onlyActive)
        theirs = pickle.loads(dump(includeCollectives, includeStackTraces, onlyActive))
        ours = pickle.loads(_C.dump_fr_trace(flags[0], flags[1], only))
        return pickle.dumps(_merged(theirs, ours))

    @functools.wraps(dump_json)
    def dump_fr_trace_json(includeCollectives=None, onlyActive=None):
        theirs = json.loads(dump_json(includeCollectives, onlyActive))
        ours = pickle.loads(_C.dump_fr_trace(True if includeCollectives is None else bool(includeCollectives),
                                             False, bool(onlyActive)))
        # torch's JSON form: 0 for a time not yet seen, statuses as text.
        for e in ours.get("entries", []):
            for key in ("time_discovered_started_ns", "time_discovered_completed_ns"):
                e[key] = e[key] or 0
        for s in ours.get("pg_status", {}).values():
            s.update((k, str(v)) for k, v in s.items())
        return json.dumps(_merged(theirs, ours)).encode()

    dump_fr_trace._collx = dump_fr_trace_json._collx = True
    return dump_fr_trace, dump_fr_trace_json


def install() -> None:
    """Makes torch's dump functions include collx's entries (once)."""
    if getattr(_c10d._dump_fr_trace, "_collx", False):
        return
    _c10d._dump_fr_trace, _c10d._dump_fr_trace_json = _with_collx(_c10d._dump_fr_trace, _c10d._dump_fr_trace_json)


# --- the analyzer -------------------------------------------------------------

def load(prefix: str) -> dict[int, dict]:
    """Every rank's dump at ``prefix<rank>``, by global rank."""
    dumps = {}
    for path in glob.glob(glob.escape(prefix) + "*"):
        tail = path[len(prefix):]
        if not tail.isdigit():
            continue
        with open(path, "rb") as f:
            dumps[int(tail)] = pickle.load(f)
    return dumps


def _ranges(ranks) -> str:
    ranks = sorted(ranks)
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(parts)


def analyze(dumps: dict[int, dict]) -> list[str]:
    """Lines naming, per collx group, the first collective that not every
    member completed, who never reached it, and mismatches before it."""
    lines = []
    groups: dict[str, list[int]] = {}
    for d in dumps.values():
        for name, cfg in d.get("pg_config", {}).items():
            groups[name] = json.loads(cfg["ranks"]) if isinstance(cfg["ranks"], str) else list(cfg["ranks"])
    for group, members in sorted(groups.items()):
        # Each member's collectives in this group by sequence number.
        seen: dict[int, dict[int, dict]] = {}
        for rank in members:
            entries = dumps.get(rank, {}).get("entries", [])
            seen[rank] = {e["collective_seq_id"]: e for e in entries
                          if not e["is_p2p"] and e["process_group"][0] == group
                          and e["profiling_name"].startswith("collx:")}
        dumped = [r for r in members if r in dumps]
        if not dumped:
            continue
        missing_dumps = [r for r in members if r not in dumps]
        # What the ranks that failed said: the peers their waits lacked.
        blamed = set()
        for r in dumped:
            for m in re.finditer(r"no data from ((?:rank \d+[^,.]*(?:, )?)+)|peer\(s\) ([\d, ]+) to have",
                                 dumps[r].get("collx_failure", "")):
                blamed.update(int(x) for x in re.findall(r"rank (\d+)", m.group(1) or ""))
                blamed.update(int(x) for x in re.findall(r"\d+", m.group(2) or ""))
        seqs = sorted(set().union(*(seen[r].keys() for r in dumped)))
        oldest = {r: min(seen[r]) for r in dumped if seen[r]}
        first = None
        for seq in seqs:
            at = {r: seen[r].get(seq) for r in dumped}
            # A rank whose buffer starts after seq says nothing of it.
            known = {r: e for r, e in at.items() if e is not None or (r in oldest and seq > oldest[r])}
            kinds = {(e["profiling_name"], json.dumps(e["input_sizes"]), tuple(e["input_dtypes"]))
                     for e in known.values() if e is not None}
            if len(kinds) > 1:
                detail = "; ".join(f"rank {r}: {e['profiling_name']} {e['input_sizes']} {e['input_dtypes']}"
                                   for r, e in sorted(known.items()) if e is not None)
                lines.append(f"group {group}: mismatch at #{seq}: {detail}")
            if first is None and any(e is None or e["state"] != "completed" for e in known.values()):
                first = (seq, known)
        if first is None:
            done = "every rank that dumped completed every recorded op"
            lines.append(f"group {group}: {done}" + (f"; no dump from ranks {_ranges(missing_dumps)}"
                                                     if missing_dumps else ""))
            continue
        seq, known = first
        op = next(e["profiling_name"] for e in known.values() if e is not None).split(":", 1)[1]
        never = sorted([r for r, e in known.items() if e is None] + missing_dumps)
        states = {}
        for r, e in known.items():
            if e is not None:
                states.setdefault(e["state"], []).append(r)
        for r in never:
            if r not in missing_dumps:
                lines.append(f"rank {r} never reached {op} #{seq} (its last op: {_last(seen[r])})")
            elif r in blamed:
                lines.append(f"rank {r} never reached {op} #{seq} (no dump; the others' waits lacked its data)")
            else:
                lines.append(f"rank {r}: no dump (stopped, dead, or still running {op} #{seq} or earlier)")
        summary = ", ".join(f"ranks {_ranges(rs)} {state}" for state, rs in sorted(states.items()))
        lines.append(f"group {group}: {op} #{seq}: {summary}")
    return lines


def _last(entries: dict[int, dict]) -> str:
    if not entries:
        return "none recorded"
    e = entries[max(entries)]
    return f"{e['profiling_name'].split(':', 1)[1]} #{e['collective_seq_id']}, {e['state']}"

"""Reading a ``jax.profiler.trace`` directory: the newest ``*.trace.json.gz`` in it, its events with the names of
their processes and threads, and the busy time of a set of (start, end) intervals. Shared by the profile scripts."""

from __future__ import annotations

import glob
import gzip
import json
import os


def newest_trace(trace_dir: str) -> str | None:
    """The most recently written ``*.trace.json.gz`` anywhere under ``trace_dir`` (None if there is none)."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    return max(files, key=os.path.getmtime) if files else None


def load_trace(path: str) -> tuple[list, dict, dict]:
    """(events, process names by pid, thread names by (pid, tid)) of a Chrome-format trace file."""
    with gzip.open(path, "rb") as f:
        trace = json.load(f)
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    pid_names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    tid_names = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
                 if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return events, pid_names, tid_names


def read_text(path: str) -> str:
    """A text file (an optimised HLO dump), gzip-compressed when its name ends in .gz."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return f.read()


def stream_kernels(path: str) -> list:
    """The complete ("X") events of a GPU trace's stream lines: one per kernel launch. A device's process also has
    summary lines ("XLA Modules", "XLA Ops") that repeat the same time at coarser grain; they are left out."""
    events, _, tids = load_trace(path)
    streams = {k for k, n in tids.items() if n.lower().startswith("stream")}
    return [e for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams]


def union_length(intervals) -> float:
    """Total length covered by (start, end) intervals, overlaps counted once: a device's busy time."""
    total, end = 0.0, -float("inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total

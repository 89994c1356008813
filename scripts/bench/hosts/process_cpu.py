"""CPU time of a launch's processes by thread group, from /proc (Linux): where a pinned worker's core goes per step.

`snapshot(marker)` reads every process descending from the dapple_launch whose command line holds `marker` (the
plan file's path), per thread: its name and the CPU ticks it used. `per_step` turns two snapshots into CPU ms per
step per process and thread group.
"""

import os
import re
from typing import Dict, Tuple

_TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")
_GRPC = re.compile(r"grpc|default-execut|resolver")  # TF's own threads take their process's name ("python")

Snapshot = Dict[Tuple[int, str], Dict[str, float]]  # (pid, process label) -> thread group -> CPU ms


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _children() -> Dict[int, list]:
    out: Dict[int, list] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _read(f"/proc/{name}/stat")
            if stat:
                out.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(name))
    return out


def _group(pid: int, tid: int, thread_name: str) -> str:
    """main: the process's first thread (Python's: a client's training loop); grpc: gRPC's named threads; tf: the
    rest (TensorFlow's thread pools, which keep their process's name)."""
    return "main" if tid == pid else "grpc" if _GRPC.search(thread_name) else "tf"


def _label(pid: int) -> str:
    """A process's command, shortened: its program or module and its first flag."""
    words = [w for w in _read(f"/proc/{pid}/cmdline").split("\0") if w]
    words = words[words.index("-m") + 1:] if "-m" in words else words[1:] or words
    return " ".join(os.path.basename(w) if i == 0 else w for i, w in enumerate(words[:2]))[:60]


def snapshot(marker: str) -> Snapshot:
    """The CPU ms so far of every thread group of every process descending from the dapple_launch whose command
    line holds `marker`."""
    children = _children()
    roots = [int(n) for n in os.listdir("/proc") if n.isdigit() and "dapple_launch" in _read(f"/proc/{n}/cmdline")
             and marker in _read(f"/proc/{n}/cmdline")]
    out: Snapshot = {}
    stack = list(roots)
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        groups: Dict[str, float] = {}
        for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
            stat = _read(f"/proc/{pid}/task/{tid}/stat")
            if not stat:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            group = _group(pid, int(tid), name)
            groups[group] = groups.get(group, 0.0) + (int(fields[11]) + int(fields[12])) * _TICK_MS
        out[(pid, _label(pid))] = groups
    return out


def per_step(first: Tuple[int, Snapshot], last: Tuple[int, Snapshot]) -> Dict[str, Dict[str, float]]:
    """"label (pid)" -> thread group -> CPU ms per step between two (step, snapshot) pairs."""
    steps = last[0] - first[0]
    out = {}
    for key, groups in last[1].items():
        before = first[1].get(key, {})
        used = {g: (ms - before.get(g, 0.0)) / steps for g, ms in groups.items()}
        if sum(used.values()) > 0:
            out[f"{key[1]} ({key[0]})"] = {g: round(ms, 2) for g, ms in sorted(used.items())}
    return out


def print_table(rows) -> None:
    """Each run's processes with their CPU ms per step by thread group."""
    print("| round | plan | way | process | CPU ms per step: total (by thread group) |\n|---|---|---|---|---|")
    for row in rows:
        for way in ("one_graph", "per_host"):
            for process, groups in row[way].get("cpu_ms_per_step", {}).items():
                detail = ", ".join(f"{g} {ms:.1f}" for g, ms in groups.items())
                print(f"| {row['round']} | {row['plan']} | {way} | {process} | {sum(groups.values()):.1f} ({detail}) |")

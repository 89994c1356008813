"""Chrome-trace JSON of a simulated iteration (TensorFlow's timeline format).

`{"traceEvents": [...]}` with one process (pid) per device and threads (tid) for its rows:
compute (forward/backward/optimizer), send (activation/gradient transfers it sends), allreduce.
Boxes are "X" (complete) events with `ts`/`dur` in microseconds; "M" events name processes
and threads; "C" counter events give each device's memory. Opens in chrome://tracing or Perfetto.
"""

from __future__ import annotations

import json
from typing import Dict, List

from planner.simulation.simulator import (
    COMM_KINDS,
    KIND_ALLREDUCE,
    KIND_SEND_ACTIVATION,
    SimulationResult,
)

TID_COMPUTE, TID_SEND, TID_ALLREDUCE = 0, 1, 2
_THREAD_NAMES = {TID_COMPUTE: "compute", TID_SEND: "send", TID_ALLREDUCE: "allreduce"}


def _tid(kind: str) -> int:
    if kind in COMM_KINDS:
        return TID_SEND
    return TID_ALLREDUCE if kind == KIND_ALLREDUCE else TID_COMPUTE


def trace_events(result: SimulationResult, include_empty: bool = False) -> List[Dict]:
    """The trace's events. Zero-length transfers/AllReduces are left out unless `include_empty`."""
    out: List[Dict] = []
    by_stage = {s: result.stage_devices(s) for s in range(result.num_stages)}
    for device in sorted(result.device_stage):
        stages = ",".join(map(str, result.device_stages(device)))
        out.append({"name": "process_name", "ph": "M", "pid": device, "tid": 0,
                    "args": {"name": f"device {device} (stage{'s' if ',' in stages else ''} {stages})"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": device, "tid": 0,
                    "args": {"sort_index": device}})
        for tid, name in _THREAD_NAMES.items():
            out.append({"name": "thread_name", "ph": "M", "pid": device, "tid": tid, "args": {"name": name}})
    for e in result.events:
        if e.duration_ms <= 0 and e.kind not in ("forward", "backward") and not include_empty:
            continue
        args = {"stage": e.stage, "resource": e.resource}
        if e.micro_batch >= 0:
            args["micro_batch"] = e.micro_batch
        if e.kind in COMM_KINDS:
            args["to_stage"] = e.stage + 1 if e.kind == KIND_SEND_ACTIVATION else e.stage - 1
        for device in by_stage[e.stage]:
            out.append({
                "name": e.label, "cat": e.kind, "ph": "X", "pid": device, "tid": _tid(e.kind),
                "ts": round(e.start_ms * 1000.0, 3), "dur": round(e.duration_ms * 1000.0, 3), "args": args,
            })
    for stage, timeline in enumerate(result.memory_timeline):
        for device in by_stage[stage]:
            for t, b in timeline:
                out.append({"name": "memory", "ph": "C", "pid": device, "tid": 0,
                            "ts": round(t * 1000.0, 3), "args": {"GiB": round(b / 2**30, 4)}})
    return out


def write_trace(result: SimulationResult, path: str) -> int:
    """Writes the Chrome trace to `path`; returns the number of "X" boxes written."""
    events = trace_events(result)
    doc = {"traceEvents": events, "displayTimeUnit": "ms",
           "otherData": {"schedule": str(result.schedule), "iteration_ms": result.iteration_ms}}
    with open(path, "w") as f:
        json.dump(doc, f)
    return sum(1 for e in events if e["ph"] == "X")

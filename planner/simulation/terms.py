"""A step's time split into the terms the simulator models, to say which one a measured step disagrees with.

Both a simulated step and a measured one (dapple_tf/trace/timeline.py turns a traced step into the same events)
are split the same way, per compute lane (a stage, or a device group of stages sharing devices), into parts that
add up to the step:
- compute: time the lane computes (forward, backward, weight gradients, re-computation, the optimizer);
- allreduce: time it does not compute while its stage's AllReduce runs (what the overlap leaves exposed);
- transfers: time it does not compute, no AllReduce of its stage runs, and a transfer to or from it runs;
- bubble: the rest of its idle time (waiting for another stage's compute).
Each term is the mean over lanes. `disagreement` compares two splits term by term and names the term whose
difference explains most of the steps' difference.
"""

import dataclasses
import re
from typing import Dict, Iterable, List, Tuple

from planner.simulation.simulator import COMM_KINDS, COMPUTE_KINDS, KIND_ALLREDUCE, SimulationResult

Intervals = List[Tuple[float, float]]

TERMS = ("compute", "transfers", "allreduce", "bubble")


@dataclasses.dataclass(frozen=True)
class StepTerms:
    step_ms: float
    compute: float
    transfers: float
    allreduce: float
    bubble: float

    def as_dict(self) -> Dict[str, float]:
        return {name: getattr(self, name) for name in TERMS}


def _merged(spans: Iterable[Tuple[float, float]]) -> Intervals:
    out: Intervals = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def _length(spans: Intervals) -> float:
    return sum(b - a for a, b in spans)


def _minus(spans: Intervals, removed: Intervals) -> Intervals:
    """`spans` (merged) without `removed` (merged)."""
    out = []
    for a, b in spans:
        for c, d in removed:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def _link_lanes(resource: str) -> Tuple[int, ...]:
    """The lanes a link joins ("link1>2", "link1-2": lanes 1 and 2)."""
    return tuple(int(n) for n in re.findall(r"\d+", resource))


def step_terms(result: SimulationResult) -> StepTerms:
    """`result`'s step split into TERMS (ms, means over its compute lanes; see the module docstring)."""
    schedule = result.schedule
    lanes = range(max(1, schedule.num_lanes))
    totals = dict.fromkeys(("compute", "allreduce", "transfers", "bubble"), 0.0)
    for lane in lanes:
        compute = _merged((e.start_ms, e.end_ms) for e in result.events
                          if e.kind in COMPUTE_KINDS and schedule.lane_of(e.stage) == lane)
        allreduce = _merged((e.start_ms, e.end_ms) for e in result.events
                            if e.kind == KIND_ALLREDUCE and schedule.lane_of(e.stage) == lane)
        transfers = _merged((e.start_ms, e.end_ms) for e in result.events
                            if e.kind in COMM_KINDS and lane in _link_lanes(e.resource))
        idle = _minus([(0.0, result.iteration_ms)], compute)
        exposed_allreduce = _minus(idle, _minus(idle, allreduce))
        waiting = _minus(idle, allreduce)
        exposed_transfers = _minus(waiting, _minus(waiting, transfers))
        totals["compute"] += _length(compute)
        totals["allreduce"] += _length(exposed_allreduce)
        totals["transfers"] += _length(exposed_transfers)
        totals["bubble"] += _length(idle) - _length(exposed_allreduce) - _length(exposed_transfers)
    n = len(lanes)
    return StepTerms(result.iteration_ms, totals["compute"] / n, totals["transfers"] / n, totals["allreduce"] / n,
                     max(totals["bubble"] / n, 0.0))


def disagreement(measured: StepTerms, simulated: StepTerms) -> Tuple[str, List[Tuple[str, float, float]]]:
    """(the term whose measured - simulated difference is largest in absolute ms, [(term, measured, simulated)])."""
    rows = [(name, getattr(measured, name), getattr(simulated, name)) for name in TERMS]
    worst = max(rows, key=lambda r: abs(r[1] - r[2]))[0]
    return worst, rows


def disagreement_text(measured: StepTerms, simulated: StepTerms) -> str:
    """One line: each term's measured / simulated ms, and the term that differs most."""
    worst, rows = disagreement(measured, simulated)
    parts = ", ".join(f"{name} {m:.1f}/{s:.1f}" for name, m, s in rows)
    diff = measured.step_ms - simulated.step_ms
    return (f"step {measured.step_ms:.1f}/{simulated.step_ms:.1f} ms ({diff:+.1f}); {parts} ms measured/simulated; "
            f"most off: {worst} ({dict((n, m - s) for n, m, s in rows)[worst]:+.1f} ms)")

"""A step's time split into the terms the simulator models, to say which one a measured step disagrees with.

Both a simulated step and a measured one (dapple_tf/trace/timeline.py turns a traced step into the same events)
are split the same way, per compute lane (a stage, or a device group of stages sharing devices):
- compute: the lane's forward, backward, weight-gradient, re-computation and optimizer boxes;
- transfers: activation and gradient transfers on the links (summed over links, then per lane);
- allreduce: the AllReduce boxes after the last backward;
- bubble: the lane's time in the step with no compute (waiting for another stage, a transfer or the AllReduce).
Each term is the mean over lanes, so that for a single lane compute + bubble = the step. `disagreement` compares
two splits term by term and names the term whose difference explains most of the steps' difference.
"""

import dataclasses
from typing import Dict, List, Tuple

from planner.simulation.simulator import COMM_KINDS, COMPUTE_KINDS, KIND_ALLREDUCE, SimulationResult

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


def step_terms(result: SimulationResult) -> StepTerms:
    """`result`'s step split into TERMS (ms, means over its compute lanes)."""
    lanes = max(1, result.schedule.num_lanes)
    compute = sum(e.duration_ms for e in result.events if e.kind in COMPUTE_KINDS) / lanes
    transfers = sum(e.duration_ms for e in result.events if e.kind in COMM_KINDS) / lanes
    allreduce = sum(e.duration_ms for e in result.events if e.kind == KIND_ALLREDUCE) / lanes
    return StepTerms(result.iteration_ms, compute, transfers, allreduce, max(result.iteration_ms - compute, 0.0))


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

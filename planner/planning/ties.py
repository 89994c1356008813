"""Ties: plans whose simulated times differ by less than the profile's spread.

A profile measured in rounds (profiler/rounds.py) records how far the machine moved while it was measured
(LayerCostProfile.relative_spread). Two plans simulated from it whose times differ by less than that fraction are
ordered by noise: another profile of the same model on the same machine may order them the other way. Where the
planner ranks plans by simulation, it still picks the fastest (the choice must be one plan), but records the
others within the spread on the plan (Plan.ties, Plan.profile_spread), and the report says they are ties.
"""

from __future__ import annotations

from typing import Iterable, List, Tuple

from planner.formats import plan_pb2


def describe(plan: plan_pb2.Plan) -> str:
    """"straight (2 stages) over layers 0-11,12-23, M=8, dapple": the report's shape, the stages' layers, M and
    the schedule."""
    from planner.planning.report import shape  # pylint: disable=import-outside-toplevel

    layers = ",".join(f"{s.first_layer}-{s.last_layer}" for s in plan.stages)
    return (f"{shape(plan)} over layers {layers}, M={plan.num_micro_batches}, "
            f"{plan_pb2.Schedule.Name(plan.schedule).lower()}")


def tied(best_ms: float, others: Iterable[Tuple[str, float]], spread: float) -> List[Tuple[str, float]]:
    """The (description, simulated ms) of `others` within `spread` (relative) of `best_ms`, fastest first; none
    without a spread."""
    if spread <= 0:
        return []
    return sorted(((d, ms) for d, ms in others if ms <= best_ms * (1 + spread)), key=lambda t: t[1])


def record(plan: plan_pb2.Plan, spread: float, ties: Iterable[Tuple[str, float]]) -> None:
    """Writes the spread and the tied plans onto `plan`."""
    plan.profile_spread = spread
    del plan.ties[:]
    for description, ms in ties:
        plan.ties.add(description=description, simulated_iteration_ms=ms)


def text(plan: plan_pb2.Plan) -> str:
    """The report's line on ties ("" when none)."""
    if not plan.ties:
        return ""
    listed = "; ".join(f"{t.description} ({t.simulated_iteration_ms:.2f} ms)" for t in plan.ties)
    return (f"  ties: simulated within the profile's spread ({plan.profile_spread:.1%}) of this plan's "
            f"{plan.simulated_iteration_ms or 0:.2f} ms, so their order is the measurement's noise: {listed}")

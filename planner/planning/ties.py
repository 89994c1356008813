"""Ties: plans whose simulated times differ by less than the profile's spread.

A profile measured in rounds (profiler/rounds.py) records how far the machine moved while it was measured
(LayerCostProfile.relative_spread). Two plans simulated from it whose times differ by less than that fraction are
ordered by noise: another profile of the same model on the same machine may order them the other way. Where the
planner ranks plans by simulation, it still picks the fastest (the choice must be one plan), but records the
others within the spread on the plan (Plan.ties, Plan.profile_spread), and the report says they are ties.

A noisy profile (spread above NOISY_SPREAD: measured on a busy machine; dapple_profile warns) has its ties found
under either selection: where the planner ranks by L, the best plans by L within the spread are simulated beside
the chosen one (planner/planning/api.py), and the report's line says the profile is noisy.
"""

from __future__ import annotations

from typing import Iterable, List, Tuple

from planner.formats import plan_pb2
from planner.planning.plan_shape import shape

NOISY_SPREAD = 0.20
SHOWN = 3


def noisy(spread: float) -> bool:
    """Whether a profile's relative spread says it was measured on a busy machine."""
    return spread > NOISY_SPREAD


def describe(plan: plan_pb2.Plan) -> str:
    """"straight (2 stages) over layers 0-11,12-23, M=8, dapple": the report's shape, the stages' layers, M and
    the schedule."""
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


def _within(plan: plan_pb2.Plan) -> str:
    """"within the profile's spread (5.0%) of this plan's 12.34 ms", a noisy spread marked as such."""
    spread = plan.profile_spread
    note = (f", above {NOISY_SPREAD:.0%}: measured on a busy machine; profile again on a quiet one"
            if noisy(spread) else "")
    mine = f" of this plan's {plan.simulated_iteration_ms:.2f} ms" if plan.simulated_iteration_ms > 0 else ""
    return f"within the profile's spread ({spread:.1%}{note}){mine}"


def _listed(plan: plan_pb2.Plan) -> str:
    """The first SHOWN ties with their simulated times, and how many more."""
    shown = "; ".join(f"{t.description} ({t.simulated_iteration_ms:.2f} ms)" for t in plan.ties[:SHOWN])
    more = len(plan.ties) - SHOWN
    return shown + (f"; and {more} more" if more > 0 else "")


def text(plan: plan_pb2.Plan) -> str:
    """The report's line on ties: the plans simulated within the profile's spread of this one and that spread ("" when
    none); with a noisy profile, the line says so, and says so too when no plan came within its spread."""
    if plan.ties:
        return f"  ties: simulated {_within(plan)}, so their order is the measurement's noise: {_listed(plan)}"
    if noisy(plan.profile_spread):
        return f"  ties: no other plan simulated {_within(plan)}"
    return ""

"""Which schedule a plan runs: its stages simulated under every pipeline schedule that keeps 1F1B's
structure (DAPPLE's early backward and the zero-bubble variants), and its interleaved variant (the same
device groups holding two stages each, the model cut again: planner/planning/interleave.py), the fastest
that fits in memory chosen. Choosing interleaved replaces the plan's stages with the variant's.

The planner's search (dapple_planner.py) costs candidates with the paper's analytic latency, which
knows DAPPLE's schedule only; the schedule is then chosen for the plan it picked, by the simulator
(planner/simulation/simulator.py), which plays each schedule with the same stage costs (with select="simulation",
for each of the search's best candidates: planner/planning/api.py, choose_by_simulation). Every schedule weighed
is recorded in the plan (`Plan.schedule_estimates`), so `dapple_plan` shows the gain of each.
"""

from typing import Sequence

from planner.formats.schedule import BATCHED_W, INTERLEAVED, schedule_enum, schedule_kind
from planner.formats import plan_pb2
from planner.planning.interleave import interleaved_plan
from planner.simulation.sim_adapter import simulate_plan

CANDIDATES = ("dapple", "zb-h1", "zb-h2", INTERLEAVED)
VIRTUAL_STAGES = 2  # stages per device group of the interleaved variant


def weigh_schedules(plan: plan_pb2.Plan, model, kinds: Sequence[str] = CANDIDATES, choose: bool = True,
                    **simulate_options) -> plan_pb2.Plan:
    """Fills `plan.schedule_estimates` with each kind simulated (interleaved: the plan's variant, left out when
    it has none); with `choose`, sets `plan.schedule` (and its simulated_iteration_ms) to the fastest that fits.
    Returns the plan (changed in place)."""
    del plan.schedule_estimates[:]
    capacity = plan.cluster.device_memory_bytes
    variants = {}
    for kind in kinds:
        if kind == BATCHED_W and any(st.recompute for st in plan.stages):
            continue  # the runtime refuses it: re-computation frees what the stacked W keeps
        variants[kind] = interleaved_plan(plan, model, VIRTUAL_STAGES) if kind == INTERLEAVED else plan
        if variants[kind] is None:
            continue
        result = simulate_plan(variants[kind], model, schedule=kind, **simulate_options)
        peak = max(result.peak_memory_bytes.values(), default=0.0)
        plan.schedule_estimates.add(schedule=schedule_enum(kind), simulated_iteration_ms=result.iteration_ms,
                                    peak_memory_bytes=peak, fits=not capacity or peak <= capacity)
    fitting = [e for e in plan.schedule_estimates if e.fits]
    if choose and fitting:
        best = min(fitting, key=lambda e: e.simulated_iteration_ms)
        variant = variants[schedule_kind(best.schedule)]
        if variant is not plan:  # interleaved: the variant's stages
            del plan.stages[:]
            plan.stages.extend(variant.stages)
        plan.schedule = best.schedule
        plan.simulated_iteration_ms = best.simulated_iteration_ms  # the stages' K_i stay DAPPLE's: zb-h1's bounds
    return plan


def describe(plan: plan_pb2.Plan) -> str:
    """One line per weighed schedule: simulated time, its ratio to DAPPLE's, peak memory, fits."""
    estimates = list(plan.schedule_estimates)
    base = next((e.simulated_iteration_ms for e in estimates if schedule_kind(e.schedule) == "dapple"), None)
    lines = []
    for e in estimates:
        ratio = f" ({e.simulated_iteration_ms / base:.2f}x dapple)" if base else ""
        chosen = "  <- chosen" if e.schedule == plan.schedule else ""
        fits = "" if e.fits else ", does not fit"
        lines.append(f"  {schedule_kind(e.schedule):11s} {e.simulated_iteration_ms:9.2f} ms{ratio}, peak "
                     f"{e.peak_memory_bytes / 2**30:.2f} GiB{fits}{chosen}")
    return "\n".join(lines)

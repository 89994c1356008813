"""Interleaved variants of a plan: the same device groups, each holding `chunks` stages (virtual stages,
Megatron-LM's interleaved 1F1B), the model cut again into S x chunks stages, stage c on group c % S.

The cut balances each stage's compute (forward + backward of its layers) divided by its group's
replication, over the planner's candidate cuts (dapple_planner.candidate_cuts), by dynamic programming
on the largest stage. The interleaved schedule needs M to be a multiple of S (planner/formats/interleaved.py).

    variant = interleaved_plan(plan, model, chunks=2)   # None, with the reason, when it cannot run
"""

import copy
from typing import List, Optional, Sequence, Tuple

from planner.formats import interleaved as interleaved_order, plan_pb2
from planner.formats.schedule import INTERLEAVED, device_groups, schedule_enum
from planner.planning import cost_model as cm
from planner.planning.dapple_planner import candidate_cuts
from planner.simulation.sim_adapter import stage_costs


def balanced_chunks(costs: Sequence[float], cuts: Sequence[int], weights: Sequence[float]) -> List[Tuple[int, int]]:
    """[first, end) layer ranges of len(weights) consecutive stages, cut only at `cuts`, minimising the
    largest (sum of the stage's costs) / (its weight); ValueError if there are too few cuts."""
    n, parts = len(costs), len(weights)
    points = [0] + sorted(c for c in set(cuts) if 0 < c < n) + [n]
    if len(points) - 1 < parts:
        raise ValueError(f"{n} layers with {len(points) - 2} possible cuts cannot form {parts} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][j]: the smallest largest stage cost of stages 0..k-1 ending at points[j]
    best = [[inf] * len(points) for _ in range(parts + 1)]
    back = [[0] * len(points) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, len(points) - (parts - k)):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], (prefix[points[j]] - prefix[points[i]]) / weights[k - 1])
                if value < best[k][j]:
                    best[k][j], back[k][j] = value, i
    ranges, j = [], len(points) - 1
    for k in range(parts, 0, -1):
        i = back[k][j]
        ranges.append((points[i], points[j]))
        j = i
    return ranges[::-1]


def why_not(plan: plan_pb2.Plan, model, chunks: int) -> str:
    """Why `plan` has no interleaved variant with `chunks` stages per device group ('' when it has)."""
    groups = len(plan.stages)
    if chunks < 2:
        return f"an interleaved variant needs at least 2 stages per device group, got {chunks}"
    if groups < 2:
        return "a plan of one stage has no bubble to interleave"
    if device_groups([tuple(st.device_ids) for st in plan.stages]) < groups:
        return "the plan's stages already share devices"
    problem = interleaved_order.check(groups * chunks, groups, plan.num_micro_batches)
    if problem:
        return problem
    if model.num_layers < groups * chunks:
        return f"{model.num_layers} layers cannot form {groups * chunks} stages"
    return ""


def interleaved_plan(plan: plan_pb2.Plan, model, chunks: int = 2) -> Optional[plan_pb2.Plan]:
    """A copy of `plan` whose S device groups each run `chunks` stages under the interleaved schedule, each
    stage's passes, AllReduce and parameters from the cost model; None when `why_not` says why."""
    if why_not(plan, model, chunks):
        return None
    groups = [tuple(st.device_ids) for st in plan.stages]
    weights = [len(groups[c % len(groups)]) for c in range(len(groups) * chunks)]
    costs = [f + b for f, b in zip(model.forward_ms, model.backward_ms)]
    try:
        ranges = balanced_chunks(costs, candidate_cuts(cm.Prefix(model)), weights)
    except ValueError:
        return None
    variant = copy.deepcopy(plan)
    del variant.stages[:]
    del variant.schedule_estimates[:]
    for analytic in ("estimated_iteration_ms", "warmup_ms", "steady_ms", "ending_ms", "pivot_stage"):
        variant.ClearField(analytic)  # formula 2 costs the plan's own partition under 1F1B, not this one
    for c, (first, end) in enumerate(ranges):
        stage = variant.stages.add(first_layer=first, last_layer=end - 1)
        stage.layer_names.extend(model.names[first:end])
        stage.device_ids.extend(groups[c % len(groups)])
    variant.schedule = schedule_enum(INTERLEAVED)
    prefix = cm.Prefix(model)
    for stage, cost in zip(variant.stages, stage_costs(variant, model)):
        stage.forward_ms, stage.backward_ms, stage.allreduce_ms = cost.forward_ms, cost.backward_ms, cost.allreduce_ms
        stage.parameter_bytes = prefix.parameter_bytes(stage.first_layer, stage.last_layer + 1)
    return variant

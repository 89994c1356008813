"""The plans scripts/bench/speed/speedup.py measures, costed by the planner's model and simulated.

Pure Python (no TensorFlow): each plan is a plan_pb2.Plan made by the planner's own evaluation
(planner.planning.plan_eval.evaluate + to_plan) of a stage list, so the runtime builds and the simulator
plays the same stages, micro-batches and schedule.

Names: `single` (one worker, M=1), `dp<N>` (one stage on N workers), `straight<S>-M<m>` (S stages,
one worker each, DAPPLE order), `gpipe<S>-M<m>` (the same in GPipe order), `straight<S>-M<m>-zb-h1` and
`straight<S>-M<m>-zb-h2` (the same in the zero-bubble orders: planner/formats/zero_bubble.py),
`straight<S>-M<m>-fused` (DAPPLE's order with each backward in TensorFlow's own order, as DAPPLE's runtime did:
PipelineOptions(input_gradients_first=False), the baseline of the zero-bubble paper),
`single-M<m>-batched-w` and `straight<S>-M<m>-batched-w` (DAPPLE's order with the weight gradients of all
micro-batches stacked at the end: schedule "dapple-batched-w"),
`interleaved<S>-M<m>` (S workers holding two stages each, the model cut into 2S stages: the planner's
interleaved variant, planner/planning/interleave.py), `planner` (the fastest plan by the
planner's simulation, DAPPLE's or a baseline's, each micro-batch size costed by the profile measured nearest
to its slices: planner.planning.api.plan_from_profiles with select="simulation").
"""

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from planner.planning import api, cost_model as cm
from planner.planning.interleave import interleaved_plan
from planner.planning.plan_eval import Options, evaluate, to_plan
from planner.formats.schedule import BATCHED_W, schedule_enum, schedule_kind
from planner.formats import plan_pb2
from planner.simulation.sim_adapter import model_profile, simulate_plan, without_stored_costs


@dataclasses.dataclass(frozen=True)
class BenchPlan:
    name: str
    proto: plan_pb2.Plan
    input_gradients_first: bool = True  # PipelineOptions' field of the same name

    @property
    def num_stages(self) -> int:
        return len(self.proto.stages)

    @property
    def num_devices(self) -> int:
        return len({d for st in self.proto.stages for d in st.device_ids})

    @property
    def ideal_speedup(self) -> float:
        """Devices x M / (M + S - 1): S*M/(M+S-1) for a straight pipeline, N for data parallel on N; with v
        stages per device group (interleaved: G = S / v groups) the bubble is (G - 1) / v: N M / (M + (G - 1) / v)."""
        m, s, n = self.proto.num_micro_batches, self.num_stages, self.num_devices
        groups = len({tuple(st.device_ids) for st in self.proto.stages})
        return n * m / (m + (groups - 1) / (s // groups)) if n > 1 else 1.0


def balanced_cuts(costs: Sequence[float], num_stages: int) -> List[Tuple[int, int]]:
    """[first, end) layer ranges of `num_stages` consecutive stages whose summed costs are as even as the
    layers allow (the largest stage as small as possible)."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} layers into {num_stages} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best: Dict[Tuple[int, int], Tuple[float, Tuple[int, ...]]] = {}

    def solve(start: int, stages: int) -> Tuple[float, Tuple[int, ...]]:
        if stages == 1:
            return prefix[n] - prefix[start], (n,)
        if (start, stages) not in best:
            options = []
            for end in range(start + 1, n - stages + 2):
                rest, ends = solve(end, stages - 1)
                options.append((max(prefix[end] - prefix[start], rest), (end,) + ends))
            best[(start, stages)] = min(options)
        return best[(start, stages)]

    ends = solve(0, num_stages)[1]
    return list(zip((0,) + ends[:-1], ends))


def make_plan(name: str, profile, cluster: plan_pb2.Cluster, global_batch_size: int,
              stages: Sequence[Tuple[int, int, Sequence[int]]], num_micro_batches: int,
              schedule: str = "dapple", input_gradients_first: bool = True) -> BenchPlan:
    """A plan of `stages` [(first, end, device ids)], costed and filled in by the planner's evaluation."""
    model = model_profile(profile)
    if global_batch_size % num_micro_batches:
        raise ValueError(f"{name}: M={num_micro_batches} does not divide the global batch {global_batch_size}")
    mbs = global_batch_size // num_micro_batches
    # the planner's analytic evaluation knows 1F1B and GPipe; a zero-bubble plan is costed as 1F1B and
    # simulated in its own order
    est = evaluate(model, cm.Prefix(model), cluster, [(a, b, tuple(d)) for a, b, d in stages], global_batch_size,
                   mbs, Options(), schedule="gpipe" if schedule == "gpipe" else "dapple")
    proto = to_plan(est, model, cluster, global_batch_size, "manual")
    proto.schedule = schedule_enum(schedule)
    return BenchPlan(name, proto, input_gradients_first)


def bench_plans(profile, cluster: plan_pb2.Cluster, global_batch_size: int, num_workers: int,
                micro_batches: Sequence[int], gpipe: bool = True, zero_bubble: bool = True,
                interleaved: bool = True, batched_w: bool = True) -> List[BenchPlan]:
    """single, dp<N>, straight<S>-M<m> for S in 2..N and every m (gpipe<S>-M<m>, straight<S>-M<m>-zb-h1,
    -zb-h2 and their baseline -fused too, m > 1; interleaved<S>-M<m> where S divides m; -batched-w variants of single-M<m> and
    straight<S>-M<m>, m > 1)."""
    model = model_profile(profile)
    n = model.num_layers
    plans = [make_plan("single", model, cluster, global_batch_size, [(0, n, [0])], 1)]
    for m in micro_batches:
        if m > 1 and global_batch_size % m == 0:
            plans.append(make_plan(f"single-M{m}", model, cluster, global_batch_size, [(0, n, [0])], m))
            if batched_w:
                plans.append(make_plan(f"single-M{m}-batched-w", model, cluster, global_batch_size, [(0, n, [0])],
                                       m, BATCHED_W))
    plans.append(make_plan(f"dp{num_workers}", model, cluster, global_batch_size,
                           [(0, n, list(range(num_workers)))], 1))
    costs = [f + b for f, b in zip(model.forward_ms, model.backward_ms)]
    for s in range(2, min(num_workers, n) + 1):
        stages = [(a, b, [i]) for i, (a, b) in enumerate(balanced_cuts(costs, s))]
        for m in micro_batches:
            if global_batch_size % m:
                continue
            plans.append(make_plan(f"straight{s}-M{m}", model, cluster, global_batch_size, stages, m))
            if gpipe and m > 1:
                plans.append(make_plan(f"gpipe{s}-M{m}", model, cluster, global_batch_size, stages, m, "gpipe"))
            if zero_bubble and m > 1:
                plans.append(make_plan(f"straight{s}-M{m}-fused", model, cluster, global_batch_size, stages, m,
                                       input_gradients_first=False))
            for kind in ("zb-h1", "zb-h2") if zero_bubble and m > 1 else ():
                plans.append(make_plan(f"straight{s}-M{m}-{kind}", model, cluster, global_batch_size, stages, m, kind))
            if batched_w and m > 1:
                plans.append(make_plan(f"straight{s}-M{m}-batched-w", model, cluster, global_batch_size, stages, m,
                                       BATCHED_W))
            variant = interleaved_plan(plans[-1].proto, model, 2) if interleaved and m > 1 else None
            if variant is not None:
                plans.append(BenchPlan(f"interleaved{s}-M{m}", variant))
    return plans


def planner_plan(profiles: Dict[int, object], cluster: plan_pb2.Cluster, global_batch_size: int) -> BenchPlan:
    """The planner's choice on the cluster (planner.planning.api.plan_from_profiles; {batch size: profile}),
    selected by simulation: the plans every planner finds ranked by their simulated step, the figure this
    benchmark checks against the measured one (formula 2 misses what the simulator models: input gradients
    first, the workers' shared cores)."""
    models = {size: model_profile(p) for size, p in profiles.items()}
    return BenchPlan("planner", api.plan_from_profiles(models, cluster, global_batch_size, select="simulation"))


def simulate(plan: BenchPlan, profile, optimizer_bandwidth: Optional[float] = None, stacked_profile=None):
    """The simulator's result for the plan (its own schedule), every cost from the profile (a batched-w plan's
    W from `stacked_profile`, measured at its stacked rows, if given)."""
    return simulate_plan(without_stored_costs(plan.proto), profile, optimizer_bandwidth=optimizer_bandwidth,
                         stacked_profile=stacked_profile, input_gradients_first=plan.input_gradients_first)


def describe(plan: BenchPlan) -> str:
    """e.g. '0-3@[0] 4-8@[1], M=8, dapple'."""
    stages = " ".join(f"{st.first_layer}-{st.last_layer}@{list(st.device_ids)}" for st in plan.proto.stages)
    kind = schedule_kind(plan.proto.schedule) or "dapple"
    fused = "" if plan.input_gradients_first else ", backward in TF's order"
    return f"{stages}, M={plan.proto.num_micro_batches}, {kind}{fused}"

"""From a plan (plan_pb2.Plan + profile + cluster) to the simulator's stage costs, with the
planner's own cost model (planner/planning/cost_model.py), so analytic and simulated times compare.

    plan = api.plan(profile, cluster, 64)
    result = simulate_plan(plan, profile)             # SimulationResult
    print(compare_text(plan, result))                 # analytic vs simulated

Cost terms, all from cost_model: forward/backward ms per micro-batch of the largest replica slice
(the plan's stored values), activation/gradient transfer ms across each cut (split/concat between
the two device sets, `transfer_ms`), full AllReduce ms and, with overlap, the part left after the
last backward (`allreduce_tail_ms`), memory per device (`memory_bytes`: weights, gradients,
optimizer state, plus one slice's stashed activations per in-flight micro-batch). A stage whose
plan sets `recompute` keeps only its boundary inputs per in-flight micro-batch (`cut_bytes` into
the stage) and runs its forward again before each backward (the simulator's R boxes).

Two things the analytic formula does not have: the optimizer step (Adam reads parameters,
gradients, m, v and writes parameters, m, v: 7 x parameter bytes at `optimizer_bandwidth`), and
internal bubbles of the pivot stage. Links default to one transfer at a time in both directions
(`duplex_links=False`), as the paper's formula treats each cut as one communication stage.
AllReduce overlaps the last backward by default (`overlap_allreduce=True`): the runtime reduces a
stage's gradients in buckets as the last micro-batch's backward produces them (dapple_tf/rewrite/update/gradients.py;
measured in tests/test_planner_overlap.py); False starts it after the last backward.
`activation_multiplier` scales stashed activations for models whose profile records only layer
outputs (see scripts/bench/memory/schedule_memory.py); 1.0 is what the planner assumes.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple, Union

from planner.planning import cost_model as cm
from planner.formats.model_profile import ModelProfile
from planner.formats.profile import LayerCostProfile, load_profile
from planner.formats.schedule import (BATCHED_W, DAPPLE_WARMUP_KINDS, INTERLEAVED, Schedule, build_schedule, device_groups,
                                      schedule_kind)
from planner.formats import plan_pb2
from planner.simulation.simulator import SimulationResult, StageCost, simulate

V100_MEMORY_BANDWIDTH = 900e9  # bytes/s of HBM2 on a V100 (NVIDIA's data sheet)
ADAM_BYTES_PER_PARAMETER_BYTE = 7.0  # read p, g, m, v; write p, m, v


def model_profile(profile: Union[str, LayerCostProfile, ModelProfile]) -> ModelProfile:
    """A ModelProfile from a path, a LayerCostProfile proto or a ModelProfile."""
    if isinstance(profile, ModelProfile):
        return profile
    if isinstance(profile, str):
        profile = load_profile(profile)
    return ModelProfile.from_proto(profile)


@dataclasses.dataclass(frozen=True)
class _CostOptions:
    """stage_costs' knobs (its docstring and the module's)."""

    overlap_allreduce: bool
    activation_multiplier: float
    optimizer_multiplier: float
    overhead_ms: float
    optimizer_bandwidth: Optional[float]
    link_contention: bool
    first_stage_splits: bool = False  # the first stage's backward is B and W too (dapple-batched-w)
    input_gradients_first: bool = True  # False: no backward sends its input gradients before its weight gradients


def _layer_ranges(plan: plan_pb2.Plan, model: ModelProfile) -> List[Tuple[int, int]]:
    """[(first, end)] of the plan's stages; ValueError unless they cover the profile's layers in order."""
    bounds = []
    for i, st in enumerate(plan.stages):
        first, end = st.first_layer, st.last_layer + 1
        if not (0 <= first < end <= model.num_layers):
            raise ValueError(f"stage {i}: layers {first}..{end - 1} are outside the profile's "
                             f"{model.num_layers} layers")
        if bounds and first != bounds[-1][1]:
            raise ValueError(f"stage {i} starts at layer {first}, but stage {i - 1} ends at layer {bounds[-1][1] - 1}")
        bounds.append((first, end))
    if bounds[-1][1] != model.num_layers or bounds[0][0] != 0:
        raise ValueError(f"the plan's stages cover layers {bounds[0][0]}..{bounds[-1][1] - 1}, "
                         f"not all {model.num_layers} layers of the profile")
    return bounds


class _PlanCoster:
    """The StageCost of each stage of one plan; its methods are the cost terms."""

    def __init__(self, plan: plan_pb2.Plan, model: ModelProfile, prefix: cm.Prefix, cluster: plan_pb2.Cluster,
                 options: _CostOptions):
        self.plan, self.model, self.prefix, self.cluster, self.options = plan, model, prefix, cluster, options
        self.mbs = plan.micro_batch_size
        self.bounds = _layer_ranges(plan, model)
        self.scale = cm.compute_scale(cluster, [(0, 0, tuple(st.device_ids)) for st in plan.stages])

    def stage(self, i: int) -> StageCost:
        st = self.plan.stages[i]
        first, end = self.bounds[i]
        devs = tuple(st.device_ids)
        if not devs:
            raise ValueError(f"stage {i} has no devices")
        slice_samples = cm.largest_slice(self.mbs, len(devs))
        fwd, bwd, backward_input = self.passes(st, first, end, len(devs))
        ar, tail = self.allreduce(st, first, end, devs, bwd, backward_input)
        prefix, options = self.prefix, self.options
        return StageCost(
            forward_ms=fwd,
            backward_ms=bwd,
            devices=devs,
            forward_transfer_ms=self.transfer_ms(i, end, devs),
            allreduce_ms=ar,
            allreduce_tail_ms=min(tail, ar),
            optimizer_ms=self.optimizer_ms(first, end),
            # the simulator adds re-computation's memory itself: boundary inputs per in-flight micro-batch,
            # one micro-batch's kept bytes from R to the end of B
            static_bytes=cm.memory_bytes(prefix, first, end, slice_samples, 0, options.optimizer_multiplier,
                                         num_micro_batches=self.plan.num_micro_batches),
            activation_bytes=options.activation_multiplier * slice_samples * prefix.kept_per_sample(first, end),
            recompute=st.recompute,
            boundary_bytes=cm.cut_bytes(prefix, first, slice_samples),
            backward_input_ms=backward_input,
        )

    def passes(self, st: plan_pb2.Stage, first: int, end: int, r: int):
        """(forward, backward, input-gradient part of the backward or None) ms: the plan's stored
        passes, else the cost model's."""
        prefix, mbs, overhead_ms, scale = self.prefix, self.mbs, self.options.overhead_ms, self.scale
        fwd = st.forward_ms or scale * cm.stage_forward_ms(prefix, first, end, mbs, r, overhead_ms)
        bwd = st.backward_ms or scale * cm.stage_backward_ms(prefix, first, end, mbs, r, overhead_ms)
        if st.recompute and st.backward_ms:
            # The plan's backward includes the recomputed forward (plan_eval); the simulator runs it
            # as its own R box before B.
            bwd -= fwd - overhead_ms
        backward_input = cm.stage_backward_input_ms(prefix, first, end, mbs, r, overhead_ms,
                                                    self.options.first_stage_splits)
        if not self.options.input_gradients_first:
            backward_input = None
        backward_input = None if backward_input is None else scale * backward_input
        return fwd, bwd, backward_input

    def allreduce(self, st: plan_pb2.Stage, first: int, end: int, devs, bwd: float, backward_input):
        """(full AllReduce ms, the part of it left after the last backward)."""
        r = len(devs)
        per_byte = cm.allreduce_ms_per_byte(self.cluster, devs) if r > 1 else 0.0
        ar = st.allreduce_ms if st.allreduce_ms else self.prefix.parameter_bytes(first, end) * per_byte
        overlap = cm.overlaps_allreduce(self.cluster, self.options.overlap_allreduce) and r > 1
        slice_samples = cm.largest_slice(self.mbs, r)
        tail = cm.allreduce_tail_ms(self.model, first, end, slice_samples, per_byte) if overlap else ar
        if overlap and backward_input is not None:  # weight gradients come only after the input gradients
            tail = max(tail, ar - max(bwd - backward_input, 0.0))
        return ar, tail

    def transfer_ms(self, i: int, end: int, devs) -> float:
        """The activations' transfer to the next stage (0 after the last)."""
        if i + 1 >= len(self.plan.stages):
            return 0.0
        return cm.transfer_ms(self.cluster, devs, tuple(self.plan.stages[i + 1].device_ids), self.prefix.cut[end],
                              self.mbs, contention=self.options.link_contention)

    def optimizer_ms(self, first: int, end: int) -> float:
        bandwidth = self.options.optimizer_bandwidth
        if not bandwidth:
            return 0.0
        return 1e3 * ADAM_BYTES_PER_PARAMETER_BYTE * self.prefix.parameter_bytes(first, end) / bandwidth


def stage_costs(
    plan: plan_pb2.Plan,
    profile: Union[str, LayerCostProfile, ModelProfile],
    cluster: Optional[plan_pb2.Cluster] = None,
    *,
    overlap_allreduce: bool = True,
    activation_multiplier: float = 1.0,
    optimizer_multiplier: float = cm.DEFAULT_OPTIMIZER_MULTIPLIER,
    overhead_ms: float = cm.PASS_OVERHEAD_MS,
    optimizer_bandwidth: Optional[float] = V100_MEMORY_BANDWIDTH,
    link_contention: bool = False,
    first_stage_splits: bool = False,
    input_gradients_first: bool = True,
) -> List[StageCost]:
    """Per-stage costs of `plan` (cluster defaults to the plan's own); `link_contention` as in
    cost_model.transfer_ms (the planner's Options.link_contention); `first_stage_splits`: the first stage's
    input gradients come before its weight gradients too (the runtime's dapple-batched-w);
    `input_gradients_first=False`: no stage's does (the runtime's PipelineOptions(input_gradients_first=False))."""
    model = model_profile(profile)
    prefix = cm.Prefix(model)
    cluster = cluster if cluster is not None else plan.cluster
    if not plan.stages:
        raise ValueError("the plan has no stages")
    if plan.micro_batch_size < 1:
        raise ValueError(f"the plan's micro-batch size must be >= 1, got {plan.micro_batch_size}")
    options = _CostOptions(overlap_allreduce, activation_multiplier, optimizer_multiplier, overhead_ms,
                           optimizer_bandwidth, link_contention, first_stage_splits, input_gradients_first)
    coster = _PlanCoster(plan, model, prefix, cluster, options)
    return [coster.stage(i) for i in range(len(plan.stages))]


def plan_schedule(plan: plan_pb2.Plan, schedule: Optional[str] = None, policy: Optional[str] = None,
                  max_in_flight: Optional[int] = None) -> Schedule:
    """The plan's schedule; `schedule`/`policy` override it (`policy` alone implies dapple).

    Without overrides: a plan runs its own schedule kind (unset: interleaved where stages share devices,
    else dapple); DAPPLE (and ZB_H1, which bounds its forwards by them) plans run the plan's K_i
    (`warmup_micro_batches`), or its policy if the K_i are not set.
    """
    s, m = len(plan.stages), plan.num_micro_batches
    lanes = device_groups([tuple(st.device_ids) for st in plan.stages])
    default = INTERLEAVED if lanes < s else "dapple"
    kind = schedule or (None if policy else schedule_kind(plan.schedule)) or default
    if lanes < s or kind not in DAPPLE_WARMUP_KINDS:  # their own warm-up
        return build_schedule(s, m, kind, max_in_flight=max_in_flight, num_lanes=lanes)  # ScheduleError names kinds
    if policy is None:  # DAPPLE's K_i: those of the plan (zb-h1 bounds its forwards by them)
        ks = [st.warmup_micro_batches for st in plan.stages]
        if plan.schedule != plan_pb2.GPIPE and all(k > 0 for k in ks) and max_in_flight is None:
            return build_schedule(s, m, kind, warmup=[min(k, m) for k in ks])
        policy = "B" if plan.policy == plan_pb2.POLICY_B else "A"
    return build_schedule(s, m, kind, policy=policy, max_in_flight=max_in_flight)


def simulate_plan(
    plan: plan_pb2.Plan,
    profile: Union[str, LayerCostProfile, ModelProfile],
    cluster: Optional[plan_pb2.Cluster] = None,
    schedule: Optional[str] = None,
    policy: Optional[str] = None,
    *,
    overlap_allreduce: bool = True,
    duplex_links: bool = False,
    activation_multiplier: float = 1.0,
    max_in_flight: Optional[int] = None,
    optimizer_bandwidth: Optional[float] = V100_MEMORY_BANDWIDTH,
    link_contention: bool = False,
    stacked_profile: Union[str, LayerCostProfile, ModelProfile, None] = None,
    input_gradients_first: bool = True,
) -> SimulationResult:
    """Simulates one iteration of `plan` (see the module docstring for the cost terms). `stacked_profile`: for
    schedule dapple-batched-w, a profile measured at the stacked rows (M x the slice), which costs the W tasks:
    the runtime computes them as one product over all micro-batches (without it, W costs what `profile` says).
    `input_gradients_first=False`: each backward sends its input gradients when it ends, as the runtime with
    PipelineOptions(input_gradients_first=False) (schedules dapple, gpipe and interleaved)."""
    cluster = cluster if cluster is not None else plan.cluster
    sched = plan_schedule(plan, schedule, policy, max_in_flight)
    if not input_gradients_first and (sched.splits_backward or sched.kind == BATCHED_W):
        raise ValueError(f"schedule {sched.kind!r} splits every backward into input and weight gradients: "
                         "input_gradients_first=False applies to schedules dapple, gpipe and interleaved")
    options = dict(overlap_allreduce=overlap_allreduce, activation_multiplier=activation_multiplier,
                   optimizer_bandwidth=optimizer_bandwidth, link_contention=link_contention,
                   first_stage_splits=sched.kind == BATCHED_W, input_gradients_first=input_gradients_first)
    costs = stage_costs(plan, profile, cluster, **options)
    if stacked_profile is not None and sched.kind == BATCHED_W:
        stacked_costs = stage_costs(without_stored_costs(plan), stacked_profile, cluster, **options)
        costs = [_stacked_weight_cost(i, cost, stacked) for i, (cost, stacked) in enumerate(zip(costs, stacked_costs))]
    return simulate(costs, sched, micro_batch_size=plan.micro_batch_size, overlap_allreduce=overlap_allreduce,
                    duplex_links=duplex_links, device_memory_bytes=cluster.device_memory_bytes or None)


def without_stored_costs(plan: plan_pb2.Plan) -> plan_pb2.Plan:
    """A copy of `plan` without the stage costs it was planned with, so that simulating it costs every stage
    from the profile given (e.g. one measured at another batch size)."""
    proto = plan_pb2.Plan()
    proto.CopyFrom(plan)
    for stage in proto.stages:
        stage.forward_ms = stage.backward_ms = stage.allreduce_ms = 0.0
    return proto


def _stacked_weight_cost(stage: int, cost: StageCost, stacked: StageCost) -> StageCost:
    """`cost` with its W (weight-gradient) part at the per-sample cost of the stacked rows' profile (every
    weight gradient priced as stacked: the runtime keeps biases, convolutions and shared weights in B, minor
    for dense models)."""
    b = cost.input_gradient_ms(stage)
    w = stacked.backward_ms - stacked.input_gradient_ms(stage)
    return dataclasses.replace(cost, backward_ms=b + w, backward_input_ms=b)


def relative_difference(plan: plan_pb2.Plan, result: SimulationResult) -> float:
    """(simulated - analytic) / analytic iteration time."""
    return (result.iteration_ms - plan.estimated_iteration_ms) / plan.estimated_iteration_ms


def compare_text(plan: plan_pb2.Plan, result: SimulationResult) -> str:
    """One line: analytic vs simulated iteration time."""
    return (f"analytic {plan.estimated_iteration_ms:.2f} ms, simulated {result.iteration_ms:.2f} ms "
            f"({relative_difference(plan, result):+.1%})")


def pivot_internal_bubble_ms(plan: plan_pb2.Plan, result: SimulationResult) -> float:
    """Idle time of the plan's pivot stage Q between its first forward and its last backward.

    This is the term the analytic formula leaves out (paper section 4.1: Ts = (M-1)(F_Q + B_Q)
    assumes Q never waits): when the round trip through the stages after Q (their forwards,
    backwards and transfers) takes longer than the K_Q forwards Q runs meanwhile, Q idles.
    `plan.pivot_stage` indexes the interleaved list (stage 0, cut 0, stage 1, ...): an odd Q is a
    cut, whose link carries the activation and gradient transfers.
    """
    q = plan.pivot_stage
    if q % 2 == 0:
        stage = q // 2
        busy = ("forward", "recompute", "backward", "weight_gradient")
        boxes = [e for e in result.events if e.stage == stage and e.kind in busy]
    else:
        cut = q // 2
        boxes = [e for e in result.events
                 if (e.kind == "send_activation" and e.stage == cut) or (e.kind == "send_gradient" and e.stage == cut + 1)]
    if not boxes:
        return 0.0
    span = max(e.end_ms for e in boxes) - min(e.start_ms for e in boxes)
    return max(0.0, span - sum(e.duration_ms for e in boxes))


def _pivot_boxes(plan: plan_pb2.Plan, result: SimulationResult):
    """The simulated boxes of the plan's pivot (a stage's passes, or a cut's transfers)."""
    q = plan.pivot_stage
    if q % 2 == 0:
        return [e for e in result.events if e.stage == q // 2 and e.kind in ("forward", "backward")]
    cut = q // 2
    return [e for e in result.events
            if (e.kind == "send_activation" and e.stage == cut) or (e.kind == "send_gradient" and e.stage == cut + 1)]


def simulated_phases(plan: plan_pb2.Plan, result: SimulationResult):
    """(Tw, Ts, Te) of the simulated timeline, the paper's phases: until the pivot's first
    forward ends, until its last backward starts, until the iteration ends."""
    boxes = sorted(_pivot_boxes(plan, result), key=lambda e: e.start_ms)
    if not boxes:
        return 0.0, 0.0, result.iteration_ms
    tw = boxes[0].end_ms
    last_start = boxes[-1].start_ms
    return tw, last_start - tw, result.iteration_ms - last_start


DISAGREEMENT = 0.05


def disagreement_text(plan: plan_pb2.Plan, result: SimulationResult, limit: float = DISAGREEMENT) -> str:
    """'' when simulated and analytic (formula 2) times agree within `limit`; else both, with the
    phase (Tw, Ts, Te) whose simulated length differs most from the formula's."""
    diff = relative_difference(plan, result)
    if abs(diff) <= limit:
        return ""
    sim = simulated_phases(plan, result)
    ana = (plan.warmup_ms, plan.steady_ms, plan.ending_ms)
    names = ("warm-up Tw", "steady Ts", "ending Te")
    worst = max(range(3), key=lambda i: abs(sim[i] - ana[i]))
    return (f"{compare_text(plan, result)}: the {names[worst]} phase differs most "
            f"(formula 2 {ana[worst]:.2f} ms, simulated {sim[worst]:.2f} ms; "
            + ", ".join(f"{n} {a:.2f}/{b:.2f}" for n, a, b in zip(names, ana, sim)) + " ms analytic/simulated)")

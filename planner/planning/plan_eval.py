"""Costs a concrete plan (stages with device lists, micro-batching) under planner/planning/cost_model.py
and turns it into a plan_pb2.Plan. Every planner (DAPPLE and the baselines) goes through here,
so all plans are compared under one cost model.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

from planner.planning import cost_model as cm
from planner.formats.cluster import num_devices
from planner.formats import plan_pb2
from planner.planning import ties

POLICY_ENUM = {"A": plan_pb2.POLICY_A, "B": plan_pb2.POLICY_B}


@dataclasses.dataclass
class Options:
    """Knobs shared by all planners."""

    optimizer_multiplier: float = cm.DEFAULT_OPTIMIZER_MULTIPLIER
    # Backward/AllReduce overlap on the last micro-batch: the runtime all-reduces a stage's gradients
    # in buckets as the last backward produces them (dapple_tf/rewrite/update/gradients.py). Off: the AllReduce
    # starts after the last backward (the "dp" baseline, the paper's "DP No Overlap").
    overlap: bool = True
    overhead_ms: float = cm.PASS_OVERHEAD_MS
    max_stages: Optional[int] = None
    micro_batch_sizes: Optional[Sequence[int]] = None
    max_in_flight: Optional[int] = None  # D; defaults to M
    policy: Optional[str] = None         # force "A" or "B"; default: by ACR
    link_contention: bool = False        # transfers share device ports / server NICs (cost_model docstring)
    # One training step's memory at the profile batch size (bytes, or a size such as "11.4GB"), for
    # profiles without a measured one (planner/formats/memory_figures.py); None: the profile's own, if any.
    profile_memory: Optional[object] = None
    select: str = "latency"              # dapple: "latency" (formula 2, the paper) or "simulation"
    # Re-computation: None lets the DAPPLE planner choose (a second search with every stage
    # recomputing; kept when it is feasible and has a lower L); True / False force it.
    recompute: Optional[bool] = None
    # The schedules the chosen DAPPLE plan is simulated under, the fastest that fits being written into
    # the plan (planner/planning/schedule_choice.py); ("dapple",) keeps the paper's early backward.
    schedules: Sequence[str] = ("dapple", "zb-h1", "zb-h2", "interleaved")


@dataclasses.dataclass
class Estimate:
    """A costed plan. stages: (first, end, device_ids); lists are per computation stage."""

    stages: List[Tuple[int, int, Tuple[int, ...]]]
    micro_batch_size: int
    num_micro_batches: int
    forward: List[float]
    backward: List[float]
    allreduce: List[float]           # full AllReduce time per stage
    allreduce_tail: List[float]      # what remains after the last backward (== allreduce without overlap)
    comm: List[float]                # per boundary, one direction
    latency: float
    warmup: float
    steady: float
    ending: float
    pivot: int                       # index into the interleaved compute/comm stage list
    acr: float
    policy: str
    warmup_counts: List[int]
    device_memory: List[float]       # per device id (0 for unused devices)
    violation: Optional[str]         # why the plan does not fit in memory, or None
    schedule: str = "dapple"
    recompute: bool = False          # every stage recomputes its forward in its backward
    # ranked by simulation: the profile's spread and the plans simulated within it ((description, ms); ties.py)
    profile_spread: float = 0.0
    ties: Tuple[Tuple[str, float], ...] = ()

    @property
    def feasible(self) -> bool:
        return self.violation is None


def warmup_counts(num_stages: int, policy: str, num_micro_batches: int, max_in_flight: Optional[int]) -> List[int]:
    d = num_micro_batches if max_in_flight is None else min(max_in_flight, num_micro_batches)
    out = []
    for i in range(num_stages):
        k = num_stages - i if policy == "A" else 2 * (num_stages - i) - 1
        out.append(max(1, min(k, d)))
    return out


def evaluate(model, prefix: cm.Prefix, cluster, stages, global_batch_size: int, micro_batch_size: int,
             options: Options, schedule: str = "dapple", policy: Optional[str] = None) -> Estimate:
    """Costs `stages` [(first, end, device_ids)] with micro-batches of `micro_batch_size`."""
    m = global_batch_size // micro_batch_size
    recompute = bool(options.recompute)
    fwd, bwd, ar, tail, comm = [], [], [], [], []
    scale = cm.compute_scale(cluster, stages)
    for idx, (first, end, devs) in enumerate(stages):
        r = len(devs)
        fwd.append(scale * cm.stage_forward_ms(prefix, first, end, micro_batch_size, r, options.overhead_ms))
        bwd.append(scale * cm.stage_backward_ms(prefix, first, end, micro_batch_size, r, options.overhead_ms)
                   + (fwd[-1] - options.overhead_ms if recompute else 0.0))
        per_byte = cm.allreduce_ms_per_byte(cluster, devs) if r > 1 else 0.0
        ar.append(prefix.parameter_bytes(first, end) * per_byte)
        if cm.overlaps_allreduce(cluster, options.overlap) and r > 1:
            tail.append(cm.allreduce_tail_ms(model, first, end, cm.largest_slice(micro_batch_size, r), per_byte))
        else:
            tail.append(ar[-1])
        if idx + 1 < len(stages):
            comm.append(cm.transfer_ms(cluster, devs, stages[idx + 1][2], prefix.cut[end], micro_batch_size,
                                        options.link_contention))
    all_f, all_b, all_ar = [], [], []
    for i in range(len(stages)):
        all_f.append(fwd[i])
        all_b.append(bwd[i])
        all_ar.append(tail[i])
        if i < len(comm):
            all_f.append(comm[i])
            all_b.append(comm[i])
            all_ar.append(0.0)
    acr = cm.activation_communication_ratio([f + b for f, b in zip(fwd, bwd)], [2 * c for c in comm])
    if schedule == "gpipe":
        chosen = "A"
        counts = [m] * len(stages)
    else:
        chosen = policy or options.policy or ("B" if acr >= cm.ACR_POLICY_B_THRESHOLD else "A")
        counts = warmup_counts(len(stages), chosen, m, options.max_in_flight)
    memory, violation = stage_memory(prefix, cluster, stages, micro_batch_size, counts, options, m)
    if violation and schedule != "gpipe" and chosen == "B" and not (policy or options.policy):
        chosen = "A"
        counts = warmup_counts(len(stages), chosen, m, options.max_in_flight)
        memory, violation = stage_memory(prefix, cluster, stages, micro_batch_size, counts, options, m)
    latency, tw, ts, te, q = cm.pipeline_latency(all_f, all_b, all_ar, m, counts)
    return Estimate(stages=[(a, b, tuple(d)) for a, b, d in stages], micro_batch_size=micro_batch_size,
                    num_micro_batches=m, forward=fwd, backward=bwd, allreduce=ar, allreduce_tail=tail, comm=comm,
                    latency=latency, warmup=tw, steady=ts, ending=te, pivot=q, acr=acr, policy=chosen,
                    warmup_counts=counts, device_memory=memory, violation=violation, schedule=schedule,
                    recompute=recompute)


def stage_memory(prefix, cluster, stages, micro_batch_size, counts, options, num_micro_batches=1):
    """Per-device peak memory and the first violation message (or None)."""
    memory = [0.0] * num_devices(cluster)
    violation = None
    for i, (first, end, devs) in enumerate(stages):
        sizes = cm.slice_sizes(micro_batch_size, len(devs))
        for dev, size in zip(devs, sizes):
            need = cm.memory_bytes(prefix, first, end, size, counts[i], options.optimizer_multiplier,
                                   num_micro_batches=num_micro_batches, recompute=bool(options.recompute))
            memory[dev] = need
            if need > cluster.device_memory_bytes and violation is None:
                violation = (f"stage {i} (layers {first}..{end - 1}) needs {need / 2**30:.2f} GiB on device {dev}, "
                             f"{(need - cluster.device_memory_bytes) / 2**30:.2f} GiB over its "
                             f"{cluster.device_memory_bytes / 2**30:.2f} GiB")
    return memory, violation


def to_plan(est: Estimate, model, cluster, global_batch_size: int, planner: str,
            single_device_ms: float = 0.0, dp_ms: float = 0.0) -> plan_pb2.Plan:
    """Fills a plan_pb2.Plan as planner/formats/plan.proto documents."""
    plan = plan_pb2.Plan(
        model_name=model.name, planner=planner, global_batch_size=global_batch_size,
        micro_batch_size=est.micro_batch_size, num_micro_batches=est.num_micro_batches,
        schedule=plan_pb2.GPIPE if est.schedule == "gpipe" else plan_pb2.DAPPLE,
        policy=plan_pb2.EXPLICIT if est.schedule == "gpipe" else POLICY_ENUM[est.policy],
        estimated_iteration_ms=est.latency, warmup_ms=est.warmup, steady_ms=est.steady, ending_ms=est.ending,
        pivot_stage=est.pivot, activation_communication_ratio=est.acr,
    )
    plan.cluster.CopyFrom(cluster)
    for i, (first, end, devs) in enumerate(est.stages):
        stage = plan.stages.add(first_layer=first, last_layer=end - 1, warmup_micro_batches=est.warmup_counts[i],
                                forward_ms=est.forward[i], backward_ms=est.backward[i],
                                allreduce_ms=est.allreduce[i],
                                parameter_bytes=sum(model.parameter_bytes[first:end]), recompute=est.recompute)
        stage.layer_names.extend(model.names[first:end])
        stage.device_ids.extend(devs)
    plan.device_peak_memory_bytes.extend(est.device_memory)
    if single_device_ms > 0:
        plan.speedup_over_single_device = single_device_ms / est.latency
    if dp_ms > 0:
        plan.speedup_over_data_parallel = dp_ms / est.latency
    if est.ties or est.profile_spread:
        ties.record(plan, est.profile_spread, est.ties)
    return plan


def single_device_ms(prefix: cm.Prefix, global_batch_size: int) -> float:
    """All micro-batches run sequentially on one device (the paper's speedup baseline)."""
    n = prefix.model.num_layers
    return global_batch_size * (prefix.forward_per_sample(0, n) + prefix.backward_per_sample(0, n))

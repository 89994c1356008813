"""Readable summaries of plans: one plan's stages and costs, and the side-by-side table of
planners (dapple_plan --planner=all)."""

from __future__ import annotations

from typing import Dict

from planner.planning import schedule_choice, ties
from planner.planning.plan_shape import shape
from planner.formats import plan_pb2

GIB = float(1 << 30)


def summarize(plan: plan_pb2.Plan) -> str:
    """Multi-line summary: shape, M, schedule, per-stage layers/devices/K_i, L and its parts."""
    lines = [
        f"{plan.planner} plan for {plan.model_name} on {plan.cluster.name} "
        f"({plan.cluster.num_servers}x{plan.cluster.devices_per_server} devices), global batch {plan.global_batch_size}",
        f"  shape: {shape(plan)}; M = {plan.num_micro_batches} micro-batches of {plan.micro_batch_size}; "
        f"schedule {plan_pb2.Schedule.Name(plan.schedule)}, policy {plan_pb2.WarmupPolicy.Name(plan.policy)}",
    ]
    for i, s in enumerate(plan.stages):
        names = s.layer_names
        span = f"{names[0]}..{names[-1]}" if len(names) > 1 else names[0]
        devs = list(s.device_ids)
        dev_text = f"{devs[0]}-{devs[-1]}" if len(devs) > 2 and devs == list(range(devs[0], devs[-1] + 1)) else str(devs)
        lines.append(
            f"  stage {i}: layers {s.first_layer}-{s.last_layer} ({span}), devices {dev_text} (x{len(devs)}), "
            f"K={s.warmup_micro_batches}, F={s.forward_ms:.2f} ms, B={s.backward_ms:.2f} ms, "
            f"AllReduce={s.allreduce_ms:.2f} ms, params={s.parameter_bytes / 1e6:.1f} MB"
            + (", re-computes its forward in backward" if s.recompute else ""))
    peak = max(plan.device_peak_memory_bytes, default=0.0)
    lines.append(
        f"  L = {plan.estimated_iteration_ms:.2f} ms = Tw {plan.warmup_ms:.2f} + Ts {plan.steady_ms:.2f} + "
        f"Te {plan.ending_ms:.2f} (pivot stage {plan.pivot_stage} of the compute+communication stages)")
    lines.append(
        f"  speedup: {plan.speedup_over_single_device:.2f}x over one device, "
        f"{plan.speedup_over_data_parallel:.2f}x over data parallelism; ACR {plan.activation_communication_ratio:.2f}; "
        f"peak device memory {peak / GIB:.2f} GiB")
    if plan.schedule_estimates:
        lines.append("  schedules, simulated with the same stage costs:\n" + schedule_choice.describe(plan))
    simulated = next((e.simulated_iteration_ms for e in plan.schedule_estimates if e.schedule == plan_pb2.DAPPLE),
                     plan.simulated_iteration_ms)  # the analytic L is DAPPLE's schedule's
    if simulated > 0 and plan.estimated_iteration_ms > 0:
        diff = simulated / plan.estimated_iteration_ms - 1
        lines.append(f"  analytic {plan.estimated_iteration_ms:.2f} ms vs simulated {simulated:.2f} ms "
                     f"({diff:+.1%}; planner/simulation/simulator.py: pivot waits, optimizer step)")
    if ties.text(plan):
        lines.append(ties.text(plan))
    return "\n".join(lines)


def comparison_table(plans: Dict[str, object]) -> str:
    """One row per planner: shape, M, L (ms), Tw/Ts/Te, speedups; or why it has no plan."""
    header = (f"{'planner':<11} {'shape':<22} {'M':>4} {'L ms':>10} {'Tw':>9} {'Ts':>9} {'Te':>9} {'x1dev':>7} "
              f"{'xDP':>6} {'sim ms':>10}")
    rows = [header, "-" * len(header)]
    for name, plan in plans.items():
        if isinstance(plan, str):
            rows.append(f"{name:<11} no plan: {plan}")
            continue
        rows.append(
            f"{name:<11} {shape(plan):<22} {plan.num_micro_batches:>4} {plan.estimated_iteration_ms:>10.2f} "
            f"{plan.warmup_ms:>9.2f} {plan.steady_ms:>9.2f} {plan.ending_ms:>9.2f} "
            f"{plan.speedup_over_single_device:>7.2f} {plan.speedup_over_data_parallel:>6.2f} "
            f"{plan.simulated_iteration_ms:>10.2f}")
    return "\n".join(rows)

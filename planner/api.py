"""The planners' front door: plan(profile, cluster, global_batch_size, planner=...) -> plan_pb2.Plan.

Planners: dapple (the DP of planner/dapple_planner.py, never worse than any baseline: the best
baseline plan is returned if the DP finds nothing better), dp, dp_overlap, straight, gpipe,
pipedream (planner/baselines.py). Each tries every candidate micro-batch size and keeps the
fastest plan that fits in memory.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from planner import baselines
from planner import cost_model as cm
from planner.dapple_planner import search
from planner.plan_eval import Estimate, Options, single_device_ms, to_plan
from planner.profile import LayerCostProfile, ModelProfile
from planner.schemas import plan_pb2

PLANNERS = ("dapple", "dp", "dp_overlap", "straight", "gpipe", "pipedream")
BASELINES = PLANNERS[1:]
DEFAULT_MAX_MICRO_BATCHES = 64


class PlanningError(ValueError):
    """No valid plan: bad batch split, or nothing fits in memory."""


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def micro_batch_sizes(global_batch_size: int, requested: Optional[Sequence[int]] = None,
                      max_micro_batches: int = DEFAULT_MAX_MICRO_BATCHES) -> List[int]:
    """Candidate micro-batch sizes: divisors of the global batch size (M = GBS / size), by default
    those with M <= max_micro_batches; `requested` sizes must divide the global batch size."""
    if global_batch_size < 1:
        raise PlanningError(f"global batch size must be >= 1, got {global_batch_size}")
    valid = divisors(global_batch_size)
    if requested:
        bad = [s for s in requested if s not in valid]
        if bad:
            raise PlanningError(
                f"micro-batch size(s) {bad} do not split global batch size {global_batch_size}; "
                f"valid micro-batch sizes: {valid}")
        return sorted(set(requested))
    return [s for s in valid if global_batch_size // s <= max_micro_batches]


def _run_one(name, model, prefix, cluster, gbs, mbs, options, best_l=float("inf")) -> Optional[Estimate]:
    if name == "dp":
        return baselines.data_parallel(model, prefix, cluster, gbs, mbs, options, overlap=False)
    if name == "dp_overlap":
        return baselines.data_parallel(model, prefix, cluster, gbs, mbs, options, overlap=True)
    if name == "straight":
        return baselines.straight(model, prefix, cluster, gbs, mbs, options)
    if name == "gpipe":
        return baselines.gpipe(model, prefix, cluster, gbs, mbs, options)
    if name == "pipedream":
        return baselines.pipedream(model, prefix, cluster, gbs, mbs, options)
    if name == "dapple":
        return search(model, prefix, cluster, gbs, mbs, options, best_latency=best_l)
    raise PlanningError(f"unknown planner {name!r}; expected one of {', '.join(PLANNERS)} or all")


def best_estimate(name, model, prefix, cluster, gbs, options, sizes, best_l=float("inf")):
    """(best feasible Estimate or None, first infeasible Estimate seen) over micro-batch sizes."""
    best, infeasible = None, None
    for mbs in sizes:
        est = _run_one(name, model, prefix, cluster, gbs, mbs, options, best_l)
        if est is None:
            continue
        if not est.feasible:
            if infeasible is None or est.latency < infeasible.latency:
                infeasible = est
            continue
        if best is None or est.latency < best.latency:
            best = est
            best_l = min(best_l, est.latency)
    return best, infeasible


def _options(kwargs) -> Options:
    opts = Options()
    for key, value in kwargs.items():
        if not hasattr(opts, key):
            raise PlanningError(f"unknown planner option {key!r}")
        setattr(opts, key, value)
    return opts


def memory_error(model, prefix, cluster, options, sizes) -> str:
    """Explains why nothing fits: the biggest layer, or the best infeasible plan's violation."""
    need = []
    for i in range(model.num_layers):
        need.append(cm.memory_bytes(prefix, i, i + 1, 1, 1, options.optimizer_multiplier))
    worst = max(range(model.num_layers), key=lambda i: need[i])
    cap = cluster.device_memory_bytes
    if need[worst] > cap:
        return (f"layer {model.names[worst]} ({model.descriptions[worst]}) alone needs "
                f"{need[worst] / 2**30:.2f} GiB for one sample, {(need[worst] - cap) / 2**30:.2f} GiB over "
                f"the {cap / 2**30:.2f} GiB device memory")
    return ""


def plan_estimates(profile, cluster, global_batch_size: int, planner: str = "dapple", **options) -> Dict[str, object]:
    """Runs one planner (or "all"); returns {name: Estimate or an error string}."""
    model = ModelProfile.from_proto(profile) if isinstance(profile, LayerCostProfile) else profile
    prefix = cm.Prefix(model)
    opts = _options(options)
    sizes = micro_batch_sizes(global_batch_size, opts.micro_batch_sizes)
    names = list(PLANNERS) if planner == "all" else [planner]
    if planner not in PLANNERS and planner != "all":
        raise PlanningError(f"unknown planner {planner!r}; expected one of {', '.join(PLANNERS)} or all")
    results: Dict[str, object] = {}
    for name in BASELINES if "dapple" in names else names:
        best, bad = best_estimate(name, model, prefix, cluster, global_batch_size, opts, sizes)
        results[name] = best if best is not None else (bad.violation if bad is not None else "no plan")
    if "dapple" in names:
        base = [r for r in results.values() if isinstance(r, Estimate)]
        floor = min((r.latency for r in base), default=float("inf"))
        best, bad = best_estimate("dapple", model, prefix, cluster, global_batch_size, opts, sizes, floor)
        if best is None and base:
            best = min(base, key=lambda r: r.latency)
        if best is None:
            detail = memory_error(model, prefix, cluster, opts, sizes)
            if not detail:
                worst = bad or next((r for r in results.values() if isinstance(r, Estimate)), None)
                detail = "; ".join(str(r) for r in results.values() if isinstance(r, str))
            results["dapple"] = f"the model fits no plan in memory: {detail}"
        else:
            results["dapple"] = best
        if planner != "all":
            results = {"dapple": results["dapple"]}
    return {"model": model, "prefix": prefix, "results": results, "options": opts}


def plan(profile, cluster, global_batch_size: int, planner: str = "dapple", **options) -> plan_pb2.Plan:
    """The best plan of one planner as a plan_pb2.Plan; PlanningError if none fits."""
    if planner == "all":
        raise PlanningError("plan() returns one plan; use plan_all() for planner='all'")
    return plan_all(profile, cluster, global_batch_size, planner=planner, **options)[planner]


def plan_all(profile, cluster, global_batch_size: int, planner: str = "all", **options) -> Dict[str, object]:
    """{planner name: plan_pb2.Plan, or an error string for a planner with no feasible plan}.

    Raises PlanningError when the requested single planner has no feasible plan."""
    out = plan_estimates(profile, cluster, global_batch_size, planner, **options)
    model, prefix, results = out["model"], out["prefix"], out["results"]
    single = single_device_ms(prefix, global_batch_size)
    dp = [results.get(k) for k in ("dp", "dp_overlap")]
    dp_ms = min((r.latency for r in dp if isinstance(r, Estimate)), default=0.0)
    if not dp_ms:
        sizes = micro_batch_sizes(global_batch_size, out["options"].micro_batch_sizes)
        best, _ = best_estimate("dp_overlap", model, prefix, cluster, global_batch_size, out["options"], sizes)
        dp_ms = best.latency if best else 0.0
    plans: Dict[str, object] = {}
    for name, r in results.items():
        if isinstance(r, Estimate):
            plans[name] = to_plan(r, model, cluster, global_batch_size, name, single, dp_ms)
        else:
            if planner != "all":
                raise PlanningError(f"{name}: {r}")
            plans[name] = r
    return plans

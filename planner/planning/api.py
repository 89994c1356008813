"""The planners' front door: plan(profile, cluster, global_batch_size, planner=...) -> plan_pb2.Plan.

Planners: dapple (the DP of planner/planning/dapple_planner.py, never worse than any baseline: the best
baseline plan is returned if the DP finds nothing better), dp, dp_overlap, straight, gpipe,
pipedream (planner/planning/baselines.py). Each tries every micro-batch size that divides the global batch
(M up to the global batch size: 1-sample micro-batches are legal) and keeps the fastest plan that
fits in memory.

Objective: the paper's L (formula 2, via formula 5), Options.select="latency", the default. The
simulator is a check: plan_all(simulate=True) simulates the chosen plans and warns
(SimulationDisagreement) where simulation and L differ by more than 5%, naming the phase.
Options.select="simulation" instead simulates, for every micro-batch size, the SIM_CANDIDATES best
distinct DAPPLE plans by L (the pool of each size is independent of the others) and every
baseline's best, and returns the lowest simulated time (ties: lower L). Skipped on clusters of
more than LARGE_CLUSTER_DEVICES devices (the simulator is too slow for the time target). With a noisy profile
(a relative spread above ties.NOISY_SPREAD) and selection by L, the plan is still chosen by L, and the best plans
by L within the spread are simulated beside it to name its ties (planner/planning/ties.py).

Memory: Options.profile_memory (or the profile's step_peak_bytes) gives the model's memory at the
profile batch size (planner/formats/memory_figures.py); without either the planner warns, once per call
(MemoryLowerBoundWarning), that its memory figures are a lower bound.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Sequence

from planner.planning import baselines, ties as ties_lib
from planner.planning import cost_model as cm
from planner.planning.dapple_planner import (LARGE_CLUSTER_DEVICES, LARGE_PREPASS_CUTS, SearchInput, SearchSpace, TopK,
                                            candidate_cuts, search)
from planner.planning.memory_model import LOWER_BOUND_NOTE
from planner.planning.plan_eval import Estimate, Options, evaluate, single_device_ms, to_plan
from planner.planning.schedule_choice import weigh_schedules
from planner.formats.memory_figures import MemoryInputError, parse_size
from planner.formats.model_profile import ModelProfile
from planner.formats.profile import LayerCostProfile
from planner.formats.schedule import SCHEDULE_KINDS
from planner.formats import plan_pb2
from planner.simulation.sim_adapter import disagreement_text, simulate_plan

PLANNERS = ("dapple", "dp", "dp_overlap", "straight", "gpipe", "pipedream")
BASELINES = PLANNERS[1:]
DEFAULT_MAX_MICRO_BATCHES = None  # no cap: M can be as large as the global batch size
SIM_CANDIDATES = 8
SELECTIONS = ("latency", "simulation")


class PlanningError(ValueError):
    """No valid plan: bad batch split, or nothing fits in memory."""


class MemoryLowerBoundWarning(UserWarning):
    """The profile has no memory figures: the planner's memory estimates are a lower bound."""


class SimulationDisagreement(UserWarning):
    """The simulated iteration time of a chosen plan differs from formula 2's L by more than 5%."""


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def micro_batch_sizes(global_batch_size: int, requested: Optional[Sequence[int]] = None,
                      max_micro_batches: Optional[int] = DEFAULT_MAX_MICRO_BATCHES) -> List[int]:
    """Candidate micro-batch sizes: divisors of the global batch size (M = GBS / size), all of them
    by default, else those with M <= max_micro_batches; `requested` sizes must divide the GBS."""
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
    if max_micro_batches is None:
        return valid
    return [s for s in valid if global_batch_size // s <= max_micro_batches]


def _run_one(name, model, prefix, cluster, gbs, mbs, options, best_l=float("inf"), top=None) -> Optional[Estimate]:
    if name == "dapple_prepass":
        return search(SearchInput(model, prefix, cluster, gbs, mbs, options), SearchSpace(max_cuts=LARGE_PREPASS_CUTS),
                      best_latency=best_l)
    if name == "dp":
        return baselines.data_parallel(model, prefix, cluster, gbs, mbs, options, overlap=False)
    if name == "dp_overlap":
        return baselines.data_parallel(model, prefix, cluster, gbs, mbs, options, overlap=True)
    if name == "straight":
        return baselines.straight(model, prefix, cluster, gbs, mbs, options, best_l)
    if name == "gpipe":
        return baselines.gpipe(model, prefix, cluster, gbs, mbs, options)
    if name == "pipedream":
        return baselines.pipedream(model, prefix, cluster, gbs, mbs, options)
    if name == "dapple":
        return search(SearchInput(model, prefix, cluster, gbs, mbs, options), best_latency=best_l, top=top)
    raise PlanningError(f"unknown planner {name!r}; expected one of {', '.join(PLANNERS)} or all")


class PerSizeTop:
    """One TopK per micro-batch size (the candidate pool of the selection by simulation)."""

    def __init__(self, k: int):
        self.k = k
        self.tops: Dict[int, TopK] = {}

    def for_size(self, mbs: int) -> TopK:
        return self.tops.setdefault(mbs, TopK(self.k))

    @property
    def plans(self) -> List[Estimate]:
        return sorted((e for t in self.tops.values() for e in t.plans), key=lambda e: e.latency)


def best_estimate(name, model, prefix, cluster, gbs, options, sizes, best_l=float("inf"), top=None):
    """(best feasible Estimate or None, first infeasible Estimate seen) over micro-batch sizes.
    With `top` (a TopK, or a PerSizeTop; dapple only) the search also collects its best distinct
    plans there."""
    best, infeasible = None, None
    per_size = isinstance(top, PerSizeTop)
    bound = best_l
    for mbs in sizes:
        size_top = top.for_size(mbs) if per_size else top
        # A per-size pool keeps its own best plans: the bound of one size must not cut another's.
        est = _run_one(name, model, prefix, cluster, gbs, mbs, options, bound if per_size else best_l, size_top)
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
    unknown = [kind for kind in opts.schedules if kind not in SCHEDULE_KINDS]
    if unknown or not opts.schedules:
        raise PlanningError(f"unknown schedules {unknown}; expected some of {', '.join(SCHEDULE_KINDS)}")
    if opts.select not in SELECTIONS:
        raise PlanningError(f"unknown selection {opts.select!r}; expected one of {', '.join(SELECTIONS)}")
    if isinstance(opts.profile_memory, str):
        try:
            opts.profile_memory = parse_size(opts.profile_memory)
        except MemoryInputError as e:
            raise PlanningError(str(e)) from None
    return opts


def model_of(profile, opts: Options) -> ModelProfile:
    """The planner's ModelProfile; warns once when its memory figures are only a lower bound."""
    if isinstance(profile, LayerCostProfile):
        try:
            model = ModelProfile.from_proto(profile, opts.profile_memory)
        except MemoryInputError as e:
            raise PlanningError(str(e)) from None
    else:
        model = profile
    if model.memory_source == "lower_bound":
        warnings.warn(f"{model.name}: {LOWER_BOUND_NOTE}", MemoryLowerBoundWarning, stacklevel=3)
    return model


def memory_error(model, prefix, cluster, options, sizes, global_batch_size) -> str:
    """Why nothing fits: a layer that alone exceeds a device for one sample, or else the first
    stage over memory in the most memory-frugal plan tried (smallest micro-batch, one stage per
    device on the time-balanced partition, policy A), with its overshoot."""
    need = [cm.memory_bytes(prefix, i, i + 1, 1, 1, options.optimizer_multiplier) for i in range(model.num_layers)]
    worst = max(range(model.num_layers), key=lambda i: need[i])
    cap = cluster.device_memory_bytes
    if need[worst] > cap:
        return (f"layer {model.names[worst]} ({model.descriptions[worst]}) alone needs "
                f"{need[worst] / 2**30:.2f} GiB for one sample, {(need[worst] - cap) / 2**30:.2f} GiB over "
                f"the {cap / 2**30:.2f} GiB device memory")
    total = cluster.num_servers * cluster.devices_per_server
    parts = min(total, len(candidate_cuts(prefix)) + 1)
    mbs = min(sizes)
    est = evaluate(model, prefix, cluster, baselines.balanced_stages(model, prefix, parts), global_batch_size, mbs,
                   options,
                   policy="A")
    if est.violation:
        return (f"even with micro-batches of {mbs} and one stage per device ({len(est.stages)} stages, "
                f"policy A): {est.violation}")
    return ""


def choose_by_simulation(candidates: Sequence[Estimate], model, cluster, global_batch_size: int,
                         link_contention: bool = False, schedules: Sequence[str] = ("dapple",)):
    """(the candidate with the lowest simulated iteration time, {id(candidate): simulated ms}); each candidate
    runs the fastest of `schedules` that fits (planner/planning/schedule_choice.py). The candidates simulated
    within the profile's spread of it are recorded on it as ties (planner/planning/ties.py)."""
    sims, described = _simulated(candidates, model, cluster, global_batch_size, link_contention, schedules)
    chosen = min(candidates, key=lambda e: (sims[id(e)], e.latency))
    _record_ties(chosen, candidates, sims, described, model.relative_spread)
    return chosen, sims


def _simulated(candidates: Sequence[Estimate], model, cluster, global_batch_size: int, link_contention: bool,
               schedules: Sequence[str]):
    """({id(candidate): simulated ms, the fastest fitting of `schedules`}, {id(candidate): ties.describe})."""
    sims, described = {}, {}
    for est in candidates:
        proto = to_plan(est, model, cluster, global_batch_size, "dapple")
        described[id(est)] = ties_lib.describe(proto)
        if len(schedules) > 1:
            weigh_schedules(proto, model, schedules, link_contention=link_contention)
            fitting = [e.simulated_iteration_ms for e in proto.schedule_estimates if e.fits]
            sims[id(est)] = min(fitting or [e.simulated_iteration_ms for e in proto.schedule_estimates])
        else:
            sims[id(est)] = simulate_plan(proto, model, link_contention=link_contention).iteration_ms
    return sims, described


def _record_ties(chosen: Estimate, candidates: Sequence[Estimate], sims, described, spread: float) -> None:
    """Records on `chosen` the profile's spread and the other candidates simulated within it of `chosen` (a plan
    found twice, by two searches, is one plan: its fastest simulation)."""
    chosen.profile_spread = spread
    others = {}
    for est in candidates:
        d = described[id(est)]
        if d != described[id(chosen)]:
            others[d] = min(sims[id(est)], others.get(d, sims[id(est)]))
    chosen.ties = tuple(ties_lib.tied(sims[id(chosen)], others.items(), spread))


def _noisy_ties(best: Estimate, base: Sequence[Estimate], model, prefix, cluster, global_batch_size: int,
                opts: Options, sizes) -> None:
    """With a noisy profile (planner/planning/ties.py) and the plan chosen by L, which compares it with nothing
    else: the SIM_CANDIDATES best distinct DAPPLE plans whose L is within the profile's spread of `best`'s, over
    `sizes`, and the baselines' within it, are simulated beside `best`; those simulated within the spread of it are
    recorded on it as ties. `best` stays the choice."""
    limit = best.latency * (1 + model.relative_spread)
    near = TopK(SIM_CANDIDATES, limit)
    for mbs in sizes:
        search(SearchInput(model, prefix, cluster, global_batch_size, mbs, opts), best_latency=limit, top=near)
    candidates = [best] + [e for e in near.plans + list(base) if e.latency < limit]
    sims, described = _simulated(candidates, model, cluster, global_batch_size, opts.link_contention,
                                 opts.schedules)
    _record_ties(best, candidates, sims, described, model.relative_spread)


def plan_estimates(profile, cluster, global_batch_size: int, planner: str = "dapple", **options) -> Dict[str, object]:
    """Runs one planner (or "all"); returns {"results": {name: Estimate or an error string},
    "simulated": {id(Estimate): ms} for the plans simulated during selection, ...}."""
    opts = _options(options)
    model = model_of(profile, opts)
    prefix = cm.Prefix(model)
    sizes = micro_batch_sizes(global_batch_size, opts.micro_batch_sizes)
    names = list(PLANNERS) if planner == "all" else [planner]
    if planner not in PLANNERS and planner != "all":
        raise PlanningError(f"unknown planner {planner!r}; expected one of {', '.join(PLANNERS)} or all")
    results: Dict[str, object] = {}
    simulated: Dict[int, float] = {}
    for name in BASELINES if "dapple" in names else names:
        best, bad = best_estimate(name, model, prefix, cluster, global_batch_size, opts, sizes)
        if best is None:
            detail = bad.violation if bad is not None else memory_error(model, prefix, cluster, opts, sizes, global_batch_size)
            best = f"the model fits no {name} plan in memory: {detail}" if detail else "no plan"
        results[name] = best
    if "dapple" in names:
        results["dapple"], simulated = _dapple_result(model, prefix, cluster, global_batch_size, opts, sizes, results)
        if planner != "all":
            results = {"dapple": results["dapple"]}
    return {"model": model, "prefix": prefix, "results": results, "options": opts, "simulated": simulated}


def _dapple_result(model, prefix, cluster, global_batch_size: int, opts: Options, sizes, baseline_results):
    """(the DAPPLE planner's Estimate, or why no plan fits; {id(Estimate): simulated ms} of the
    candidates simulated to select it). The baselines' plans bound its search and compete with it."""
    # dp (no overlap) costs a slower runtime than the real one: not a DAPPLE plan.
    base = [r for k, r in baseline_results.items() if isinstance(r, Estimate) and k != "dp"]
    floor = min((r.latency for r in base), default=float("inf"))
    seed = None
    full_sizes = sizes
    large = cluster.num_servers * cluster.devices_per_server > LARGE_CLUSTER_DEVICES
    if large:
        # Large clusters: a coarse pass over every size first; its best plan bounds the full
        # search, which refines that plan's micro-batch size only (an approximation, like the
        # rest of the large-cluster search: dapple_planner.py).
        seed, _ = best_estimate("dapple_prepass", model, prefix, cluster, global_batch_size, opts, sizes, floor)
        floor = seed.latency if seed is not None else floor
        full_sizes = [seed.micro_batch_size] if seed is not None else sizes
    use_sim = opts.select == "simulation" and not large
    top = PerSizeTop(SIM_CANDIDATES) if use_sim else None
    best, bad = best_estimate("dapple", model, prefix, cluster, global_batch_size, opts, full_sizes,
                              float("inf") if use_sim else floor, top)
    best = best or seed
    if opts.recompute is None and not use_sim and not (large and best is not None):
        best = _with_recompute(model, prefix, cluster, global_batch_size, opts, sizes, best, base, floor)
    simulated: Dict[int, float] = {}
    if use_sim and (top.plans or base):
        best, simulated = choose_by_simulation(top.plans + base, model, cluster, global_batch_size,
                                               opts.link_contention, opts.schedules)
    if best is None and base:
        best = min(base, key=lambda r: r.latency)
    if best is not None and not use_sim and not large and ties_lib.noisy(model.relative_spread):
        _noisy_ties(best, base, model, prefix, cluster, global_batch_size, opts, full_sizes)
    if best is None:
        detail = memory_error(model, prefix, cluster, opts, sizes, global_batch_size)
        if not detail:
            detail = bad.violation if bad is not None else "; ".join(
                str(r) for r in baseline_results.values() if isinstance(r, str))
        return f"the model fits no plan in memory: {detail}", simulated
    return best, simulated


def _with_recompute(model, prefix, cluster, global_batch_size: int, opts: Options, sizes, best, base, floor):
    """`best`, or a faster plan with re-computation (issue 12): every stage keeps only its boundary
    inputs per in-flight micro-batch and recomputes its forward in its backward. Searched when no plan
    fits without it, and otherwise over the micro-batch sizes larger than the best plan's only,
    bounded by its L: RC adds time, so it wins only where those sizes do not fit without it.
    (Searching every size tripled GNMT-16's planning time; Options(recompute=True) searches only RC
    plans.)"""
    rc_opts = Options(**{**opts.__dict__, "recompute": True})
    incumbent = best or min(base, key=lambda r: r.latency, default=None)
    if incumbent is None:
        return best_estimate("dapple", model, prefix, cluster, global_batch_size, rc_opts, sizes, floor)[0]
    larger = [size for size in sizes if size > incumbent.micro_batch_size]
    faster, _ = best_estimate("dapple", model, prefix, cluster, global_batch_size, rc_opts, larger,
                              incumbent.latency) if larger else (None, None)
    if faster is not None and faster.latency < incumbent.latency:
        return faster
    return best


def plan(profile, cluster, global_batch_size: int, planner: str = "dapple", simulate: bool = False,
         **options) -> plan_pb2.Plan:
    """The best plan of one planner as a plan_pb2.Plan; PlanningError if none fits."""
    if planner == "all":
        raise PlanningError("plan() returns one plan; use plan_all() for planner='all'")
    return plan_all(profile, cluster, global_batch_size, planner=planner, simulate=simulate, **options)[planner]


def plan_all(profile, cluster, global_batch_size: int, planner: str = "all", simulate: bool = True,
             **options) -> Dict[str, object]:
    """{planner name: plan_pb2.Plan, or an error string for a planner with no feasible plan}.

    With `simulate`, each plan's simulated_iteration_ms is filled by planner/simulation/simulator.py (the
    analytic estimated_iteration_ms and its Tw/Ts/Te stay the paper's formula 2).
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
            if simulate:
                result = simulate_plan(plans[name], model, link_contention=out["options"].link_contention,
                                       overlap_allreduce=name != "dp")
                plans[name].simulated_iteration_ms = result.iteration_ms
                note = disagreement_text(plans[name], result) if name == "dapple" else ""
                if note:
                    warnings.warn(f"{model.name}: the chosen plan's {note}", SimulationDisagreement, stacklevel=2)
            if name == "dapple" and len(out["options"].schedules) > 1:
                weigh_schedules(plans[name], model, out["options"].schedules,
                                link_contention=out["options"].link_contention)
        else:
            if planner != "all":
                raise PlanningError(f"{name}: {r}")
            plans[name] = r
    return plans


def plan_from_profiles(profiles, cluster, global_batch_size: int, **options) -> plan_pb2.Plan:
    """plan() with profiles measured at several batch sizes ({batch size: ModelProfile}): compute per sample is
    not the same at every size (small slices use a device less well). For each micro-batch size, every planner
    (DAPPLE's and the baselines) runs with the profile measured nearest to each slice size that size can give
    (micro-batch / replicas); each plan found is then costed (formula 2) with the profile nearest to its own
    largest slice; the lowest cost that fits in memory wins (its `planner` field names the planner that found
    it). Cost: formula 2 (L); with select="simulation", the simulated iteration time of each plan found (by the
    same profile; ties: lower L)."""
    if not profiles:
        raise PlanningError("plan_from_profiles needs at least one profile")
    sizes = micro_batch_sizes(global_batch_size, options.pop("micro_batch_sizes", None))
    devices = cluster.num_servers * cluster.devices_per_server
    opts = _options(options)
    options.pop("select", None)  # the planners search by L; the plans they find are then ranked by `opts.select`
    best, best_key, errors, ranked = None, (float("inf"),), [], []
    for mbs in sizes:
        tried = {nearest_profile_size(profiles, -(-mbs // r)) for r in range(1, min(devices, mbs) + 1)}
        for size in sorted(tried):
            # every planner's plan is a candidate: the best under one profile need not be the best re-costed
            found = plan_all(profiles[size], cluster, global_batch_size, "all", simulate=False,
                             micro_batch_sizes=[mbs], **options)
            for name, candidate in found.items():
                if isinstance(candidate, str):
                    errors.append(f"micro-batch {mbs}, {name}: {candidate}")
                    continue
                recosted, model = _costed_by_its_slice(candidate, profiles, cluster, global_batch_size, opts)
                if recosted.violation:  # fits under one profile, not under the one of its slices
                    errors.append(f"micro-batch {mbs}, {name}: {recosted.violation}")
                    continue
                proto = to_plan(recosted, model, cluster, global_batch_size, candidate.planner)
                proto.schedule = candidate.schedule  # e.g. zero bubble or interleaved, as plan_all chose
                key = (recosted.latency,)
                if opts.select == "simulation":
                    key = (simulate_plan(proto, model, link_contention=opts.link_contention).iteration_ms,) + key
                    ranked.append((ties_lib.describe(proto), key[0]))
                if key < best_key:
                    best, best_key = proto, key
    if best is None:
        raise PlanningError("no plan at any micro-batch size: " + "; ".join(errors))
    if opts.select == "simulation":
        spread = max(getattr(p, "relative_spread", 0.0) for p in profiles.values())
        best.simulated_iteration_ms = best_key[0]
        fastest = {}
        for description, ms in ranked:  # one plan found under several profiles: its fastest costing
            fastest[description] = min(ms, fastest.get(description, ms))
        mine = ties_lib.describe(best)
        ties_lib.record(best, spread, ties_lib.tied(best_key[0], [(d, ms) for d, ms in fastest.items() if d != mine],
                                                    spread))
    return best


def nearest_profile_size(profiles, samples: int) -> int:
    """The batch size, among the profiles' ({batch size: profile}), nearest to `samples` (the smaller on a tie)."""
    return min(profiles, key=lambda b: (abs(b - samples), b))


def largest_slice_of(plan: plan_pb2.Plan) -> int:
    """The most samples one device computes at once in the plan (its micro-batch over a stage's replicas)."""
    return max(-(-plan.micro_batch_size // len(st.device_ids)) for st in plan.stages)


def _costed_by_its_slice(candidate: plan_pb2.Plan, profiles, cluster, global_batch_size: int, opts: Options):
    """(Estimate, ModelProfile): the plan costed, with its own schedule and warm-up policy, by the profile
    measured nearest to its largest replica slice."""
    mbs = candidate.micro_batch_size
    model = profiles[nearest_profile_size(profiles, largest_slice_of(candidate))]
    stages = [(st.first_layer, st.last_layer + 1, tuple(st.device_ids)) for st in candidate.stages]
    schedule = "gpipe" if candidate.schedule == plan_pb2.GPIPE else "dapple"
    policy = {plan_pb2.POLICY_A: "A", plan_pb2.POLICY_B: "B"}.get(candidate.policy)
    recompute = any(st.recompute for st in candidate.stages)
    est = evaluate(model, cm.Prefix(model), cluster, stages, global_batch_size, mbs,
                   Options(**{**opts.__dict__, "recompute": recompute}), schedule=schedule, policy=policy)
    return est, model

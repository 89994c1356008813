"""The DAPPLE planner (paper section 4.3): dynamic programming over (layers planned, devices
used, device set) with the Fresh First / Append First / Scatter First placement policies.

State T_PL(c, g): the first c layers (topological order) are planned as stages on the device set
g (kept as per-server used-device counts; a stage takes the lowest free ids of a server); the
remaining layers [c, N) form one last stage replicated on every device not in g. From each state
the last stage is split at a cut c' into a new stage [c, c') on r devices (placed by each policy)
and a new last stage [c', N) on the rest. Each candidate is a complete plan, costed with
formula 2 (L = Tw + Ts + Te, pivot by Algorithm 1); per (c', g') only the lowest L is kept
(memoized search). DP-only (c = 0) and straight plans are special cases.

Memory: a candidate whose planned stages (all but the last) do not fit on some device is
pruned (their K_i only grows as more stages are added); one whose last stage does not fit is
kept for further splitting but is not a valid plan.

Pruning (prune=True, the default): formula 2 with Algorithm 1 gives L >= M (F_s + B_s) for every
stage s, and with the pivot's wait (cost_model.pivot_wait_ms) L >= sum_s (F_s + B_s), one micro-batch
through every stage (both checked on random stage lists in tests/test_planner_search.py), so a
candidate is skipped when M (F+B) of one of its planned stages, or of the fastest possible stage for
the remaining layers on the remaining devices (M (micro-batch * work / free devices + 2 overhead)),
or the F+B of its planned stages plus that fastest remaining stage's, reaches the best latency found
so far; complete plans are costed as soon as they are generated so that bound
tightens early. prune=False is the plain memoized search (bound (M-1)(F_s+B_s) of planned stages
only), the reference the tests compare against.

Cut candidates: runs of layers with no compute and no parameters (e.g. tuple indexing) do not
change any stage's compute or weights, so within such a run only the boundary with the fewest
crossing bytes is considered (exact under this cost model).

Large clusters (more than LARGE_CLUSTER_DEVICES devices; the paper's 16-device configurations
are never affected) use an approximate, smaller search space so that planning stays under a
minute for 256 layers on 128 x 8 devices:
- replication counts are powers of two up to one server and whole servers on a geometric grid
  (replication_candidates);
- only the Append First placement is tried, so every stage is a contiguous range of device ids
  and a state is identified by (cut, devices used);
- when there are more than LARGE_MAX_CUTS cut candidates they are thinned to LARGE_MAX_CUTS
  evenly spaced by compute (coarsen_cuts); planner/planning/api.py first runs a pass with
  LARGE_PREPASS_CUTS cuts, whose best plan seeds the bound of the full pass.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from planner.planning import cost_model as cm
from planner.planning.plan_eval import Estimate, Options, evaluate

PLACEMENT_POLICIES = ("fresh", "append", "scatter")
LARGE_CLUSTER_DEVICES = 64
LARGE_MAX_CUTS = 64
LARGE_PREPASS_CUTS = 16


def place(used: Tuple[int, ...], count: int, per_server: int, policy: str) -> Optional[Tuple[int, ...]]:
    """Devices-per-server taken by a new stage of `count` devices under a placement policy.

    fresh:   fill fresh (unused) servers first, in order, then partially used ones;
    append:  fill partially used servers first, then fresh ones;
    scatter: spread one device at a time round-robin over the used servers that have free devices
             (over all servers when none is used yet), then over the others.
    Returns the per-server counts taken, or None if there are not enough free devices.
    """
    free = [per_server - u for u in used]
    if sum(free) < count:
        return None
    take = [0] * len(used)
    if policy in ("fresh", "append"):
        fresh = [s for s in range(len(used)) if used[s] == 0]
        partial = [s for s in range(len(used)) if 0 < used[s] < per_server]
        order = fresh + partial if policy == "fresh" else partial + fresh
        left = count
        for s in order:
            t = min(free[s], left)
            take[s] = t
            left -= t
            if left == 0:
                break
        return tuple(take)
    if policy != "scatter":
        raise ValueError(f"unknown placement policy {policy!r}")
    groups = [[s for s in range(len(used)) if 0 < used[s] < per_server]]
    groups.append([s for s in range(len(used)) if used[s] == 0])
    if not groups[0]:
        groups = [groups[1]]
    left = count
    for group in groups:
        while left > 0:
            progressed = False
            for s in group:
                if left > 0 and take[s] < free[s]:
                    take[s] += 1
                    left -= 1
                    progressed = True
            if not progressed:
                break
    return tuple(take)


def device_ids(used: Tuple[int, ...], take: Tuple[int, ...], per_server: int) -> Sequence[int]:
    """The device ids a placement takes; a range when they are contiguous (cheap to hash)."""
    blocks = [(s * per_server + used[s], take[s]) for s in range(len(take)) if take[s]]
    if all(a + k == b for (a, k), (b, _) in zip(blocks, blocks[1:])):
        return range(blocks[0][0], blocks[-1][0] + blocks[-1][1]) if blocks else ()
    return tuple(a + i for a, k in blocks for i in range(k))


def coarsen_cuts(prefix: cm.Prefix, cuts: List[int], limit: int) -> List[int]:
    """At most `limit` of `cuts`, the ones closest to evenly spaced fractions of total compute."""
    if len(cuts) <= limit:
        return cuts
    work = [f + b for f, b in zip(prefix.fwd, prefix.bwd)]
    picked = set()
    for q in range(1, limit + 1):
        goal = work[-1] * q / (limit + 1)
        picked.add(min(cuts, key=lambda x: (abs(work[x] - goal), x)))
    return sorted(picked)


def candidate_cuts(prefix: cm.Prefix) -> List[int]:
    """Stage boundaries worth trying (1..N-1), one per run of cost-free layers."""
    model = prefix.model
    n = model.num_layers
    cuts: List[int] = []
    run: List[int] = []
    for c in range(1, n):
        run.append(c)
        layer = model  # layer c-... decide whether boundary c can slide to c+1 at no cost
        free_layer = (c < n and layer.forward_ms[c] == 0 and layer.backward_ms[c] == 0
                      and layer.parameter_bytes[c] == 0)
        if not free_layer or c == n - 1:
            cuts.append(min(run, key=lambda x: (prefix.cut[x], x)))
            run = []
    return cuts


def replication_candidates(total: int, per_server: int) -> List[int]:
    """All counts 1..total-1 on small clusters (<= LARGE_CLUSTER_DEVICES devices); on large ones
    powers of two up to per_server and whole-server multiples on a roughly geometric grid
    (1, 2, 3, 4, 6, 8, 12, 16, ... servers)."""
    if total <= LARGE_CLUSTER_DEVICES:
        return list(range(1, total))
    out = {1 << e for e in range(per_server.bit_length()) if 1 << e <= per_server}
    k = 1
    while k * per_server < total:
        out.add(k * per_server)
        if (3 * k // 2) * per_server < total:
            out.add((3 * k // 2) * per_server)
        k *= 2
    return sorted(x for x in out if x < total)


class TopK:
    """The k lowest-latency distinct feasible plans offered so far (several searches may share
    one, e.g. over micro-batch sizes). bound() is what a search must beat to matter: the k-th
    latency once k plans are kept, else `limit`."""

    def __init__(self, k: int, limit: float = float("inf")):
        self.k = k
        self.limit = limit
        self.plans: List[Estimate] = []
        self._keys = set()

    def bound(self) -> float:
        if len(self.plans) >= self.k:
            return min(self.limit, self.plans[-1].latency)
        return self.limit

    def offer(self, est: Estimate) -> None:
        if not est.feasible or est.latency >= self.bound():
            return
        key = (est.micro_batch_size, tuple((a, b, tuple(d)) for a, b, d in est.stages))
        if key in self._keys:
            return
        self._keys.add(key)
        self.plans.append(est)
        self.plans.sort(key=lambda e: e.latency)
        while len(self.plans) > self.k:
            gone = self.plans.pop()
            self._keys.discard((gone.micro_batch_size, tuple((a, b, tuple(d)) for a, b, d in gone.stages)))


class _State:
    __slots__ = ("stages", "fwd", "bwd", "tail", "latency", "used", "steady_bound")

    def __init__(self, stages, fwd, bwd, tail, latency, used, steady_bound):
        self.stages = stages      # [(first, end, devices)] of planned stages
        self.fwd = fwd            # interleaved compute/comm forward times of planned stages
        self.bwd = bwd
        self.tail = tail
        self.latency = latency
        self.used = used
        self.steady_bound = steady_bound


def search(model, prefix: cm.Prefix, cluster, global_batch_size: int, micro_batch_size: int, options: Options,
           best_latency: float = float("inf"), policies: Sequence[str] = PLACEMENT_POLICIES,
           replications: Optional[Sequence[int]] = None, start_used: Optional[Tuple[int, ...]] = None,
           straight: bool = False, prune: bool = True, max_cuts: Optional[int] = None,
           top: Optional[TopK] = None) -> Optional[Estimate]:
    """Runs the DP for one micro-batch size; returns the best feasible plan found whose latency
    is below `best_latency` (None if none).

    `replications` limits stage replication counts; `start_used` marks devices as unavailable
    (per-server counts); `straight` accepts only plans whose last stage has one device; `prune`
    adds the remaining-work bound (module docstring); prune=False is the plain memoized search;
    `max_cuts` overrides LARGE_MAX_CUTS on large clusters; with `top`, every complete feasible plan
    is offered to it and the search prunes against top.bound() (also capped by `best_latency`)."""
    per_server = cluster.devices_per_server
    total = all_devices = cluster.num_servers * per_server
    n = model.num_layers
    mbs = micro_batch_size
    m = global_batch_size // mbs
    m1 = m - 1
    mult = m if prune else m1  # L >= M (F_s + B_s) for every stage s (tests/test_cost_model.py)
    oh = options.overhead_ms
    cuts = candidate_cuts(prefix)
    if total > LARGE_CLUSTER_DEVICES:
        cuts = coarsen_cuts(prefix, cuts, max_cuts or LARGE_MAX_CUTS)
        policies = [p for p in policies if p == "append"] or list(policies)[:1]
    if not straight and mbs * min(len(cuts) + 1, options.max_stages or n) < total - sum(start_used or ()):
        return None  # every plan uses every device, at most mbs per stage: too few stages possible
    reps = list(replications) if replications is not None else replication_candidates(total, per_server)
    reps = [r for r in reps if r <= mbs]
    max_stages = options.max_stages or n
    overlap = options.overlap
    contention = options.link_contention
    mem_cap = cluster.device_memory_bytes
    opt = options.optimizer_multiplier
    recompute = bool(options.recompute)
    pf, pb, pp = prefix.fwd, prefix.bwd, prefix.params
    # F + B per sample (a recomputing stage runs its forward twice): the pruning bounds use it
    work = [pf[i] * (2 if recompute else 1) + pb[i] for i in range(n + 1)]
    ar_cache: Dict[Tuple[int, ...], float] = {}
    xfer_cache: Dict[Tuple, float] = {}
    cost_cache: Dict[Tuple, Tuple[float, float, float]] = {}
    fits_cache: Dict[Tuple, bool] = {}
    free_cache: Dict[Tuple[int, ...], Tuple[int, ...]] = {}
    placement_cache: Dict[Tuple, List] = {}  # (used, r) -> [(device ids, used after)]

    def ar_per_byte(devs):
        v = ar_cache.get(devs)
        if v is None:
            v = ar_cache[devs] = cm.allreduce_ms_per_byte(cluster, devs) if len(devs) > 1 else 0.0
        return v

    def xfer(src, dst):
        if isinstance(src, range) and isinstance(dst, range):
            # Contiguous ranges: the cost is invariant under shifts by whole servers.
            base = src.start - src.start % per_server
            key = (src.start - base, len(src), dst.start - base, len(dst))
        else:
            key = (src, dst)
        v = xfer_cache.get(key)
        if v is None:
            v = xfer_cache[key] = cm.transfer_ms_per_byte(cluster, src, dst, mbs, contention)
        return v

    def stage_costs(first, end, devs):
        r = len(devs)
        per_byte = ar_per_byte(devs)
        key = (first, end, r, per_byte)
        v = cost_cache.get(key)
        if v is not None:
            return v
        sl = -(-mbs // r)
        f = sl * (pf[end] - pf[first]) + oh
        b = sl * (pb[end] - pb[first]) + oh + (f - oh if recompute else 0.0)
        if r == 1:
            t = 0.0
        elif overlap:
            t = cm.allreduce_tail_ms(model, first, end, sl, per_byte)
        else:
            t = (pp[end] - pp[first]) * per_byte
        v = cost_cache[key] = (f, b, t)
        return v

    def fits(first, end, r, k):
        key = (first, end, r, k)
        v = fits_cache.get(key)
        if v is None:
            sl = -(-mbs // r)
            v = fits_cache[key] = cm.memory_bytes(prefix, first, end, sl, k, opt, num_micro_batches=m,
                                                          recompute=recompute) <= mem_cap
        return v

    def rest_fill(c, free):
        """F+B of the fastest possible stage holding layers [c, n) on `free` devices."""
        if not prune or free <= 0:
            return 0.0
        return mbs * (work[n] - work[c]) / free + 2 * oh

    def rest_bound(c, free):
        """M (F+B) of the fastest possible stage holding layers [c, n) on `free` devices."""
        return m * rest_fill(c, free)

    best: Optional[Estimate] = None
    if top is not None:
        top.limit = min(top.limit, best_latency)
    best_l = best_latency if top is None else top.bound()

    def consider(est):
        """Records a costed complete plan; returns the new pruning bound."""
        nonlocal best
        if est.feasible and (best is None or est.latency < best.latency) and est.latency < best_latency:
            best = est
        if top is not None:
            top.offer(est)
            return top.bound()
        return best.latency if best is not None else best_latency
    if start_used is None:
        start_used = tuple([0] * cluster.num_servers)
    root = _State([], [], [], [], 0.0, start_used, 0.0)
    frontier: Dict[int, Dict[Tuple[int, ...], _State]] = {0: {start_used: root}}

    def extended(state, first, end, devs):
        """The state's forward/backward/tail lists with stage [first, end) on devs appended (after
        the communication stage from the previous stage, if any)."""
        f, b, t = stage_costs(first, end, devs)
        if not state.stages:
            return [f], [b], [t]
        x = prefix.cut[first] * xfer(state.stages[-1][2], devs)
        return state.fwd + [x, f], state.bwd + [x, b], state.tail + [0.0, t]

    def complete(state, c):
        """Costs state + last stage [c, n) on all free devices; returns (L, devs) or None."""
        used = state.used
        devs = free_cache.get(used)
        if devs is None:
            ids = tuple(s * per_server + i for s in range(len(used)) for i in range(used[s], per_server))
            if ids and ids[-1] - ids[0] == len(ids) - 1:
                ids = range(ids[0], ids[-1] + 1)
            devs = free_cache[used] = ids
        if not devs or len(devs) > mbs or (straight and len(devs) != 1):
            return None
        fw, bw, tl = extended(state, c, n, devs)
        return cm.pipeline_latency(fw, bw, tl, m)[0], devs

    for c in [0] + cuts:
        states = frontier.pop(c, None)
        if not states:
            continue
        for state in sorted(states.values(), key=lambda st: st.latency):
            if state.steady_bound >= best_l:
                continue
            num = len(state.stages)
            free_total = all_devices - sum(state.used)
            if rest_bound(c, free_total) >= best_l:
                continue
            filled = sum(state.fwd) + sum(state.bwd) if prune else 0.0  # L >= the fill of every stage
            if filled + rest_fill(c, free_total) >= best_l:
                continue
            # The state as a complete plan.
            res = complete(state, c)
            if res is not None and res[0] < best_l:
                stages = state.stages + [(c, n, res[1])]
                est = evaluate(model, prefix, cluster, stages, global_batch_size, mbs, options)
                best_l = consider(est)
            if num + 2 > max_stages:
                continue
            # K_i under policy A for the stages planned so far (only grows with more stages).
            s_total = num + 2
            if not all(fits(a, e, len(d), min(s_total - i, m)) for i, (a, e, d) in enumerate(state.stages)):
                continue
            for r in reps:
                if r >= free_total:
                    break
                if free_total - r > mbs and not straight:
                    continue
                sl = -(-mbs // r)
                placements = placement_cache.get((state.used, r))
                if placements is None:
                    placements, seen = [], set()
                    for pol in policies:
                        take = place(state.used, r, per_server, pol)
                        if take is None or take in seen:
                            continue
                        seen.add(take)
                        placements.append((device_ids(state.used, take, per_server),
                                           tuple(u + k for u, k in zip(state.used, take))))
                    placement_cache[(state.used, r)] = placements
                rest_free = free_total - r
                for c2 in cuts:
                    if c2 <= c:
                        continue
                    steady = mult * (sl * (work[c2] - work[c]) + 2 * oh)
                    if steady >= best_l:
                        break
                    if rest_bound(c2, rest_free) >= best_l:
                        continue
                    if prune and filled + steady / mult + rest_fill(c2, rest_free) >= best_l:
                        continue
                    if not fits(c, c2, r, min(2, m)):
                        continue
                    for devs, new_used in placements:
                        fw, bw, tl = extended(state, c, c2, devs)
                        bound = steady
                        if prune and not state.stages:
                            # The first stage is never after the pivot: L >= M (F_0+B_0) + its AllReduce tail.
                            bound += tl[0]
                            if bound >= best_l:
                                continue
                        child = _State(state.stages + [(c, c2, devs)], fw, bw, tl, 0.0, new_used,
                                       max(state.steady_bound, bound))
                        res = complete(child, c2)
                        if res is None:
                            if not straight:
                                continue
                            # Incomplete straight prefix: rank by its slowest stage so far.
                            child.latency = child.steady_bound + sum(fw) + sum(bw)
                        else:
                            child.latency = res[0]
                            if prune and res[0] < best_l:
                                # Cost it as a complete plan now: a lower best_l prunes sooner.
                                est = evaluate(model, prefix, cluster, child.stages + [(c2, n, res[1])],
                                               global_batch_size, mbs, options)
                                best_l = consider(est)
                        bucket = frontier.setdefault(c2, {})
                        old = bucket.get(new_used)
                        if old is None or child.latency < old.latency:
                            bucket[new_used] = child
    return best

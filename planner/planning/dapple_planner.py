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

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from planner.formats import plan_pb2
from planner.formats.model_profile import ModelProfile
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
        # boundary c can slide to c + 1 at no cost when layer c has no compute and no parameters
        free_layer = model.forward_ms[c] == 0 and model.backward_ms[c] == 0 and model.parameter_bytes[c] == 0
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


@dataclasses.dataclass(frozen=True)
class SearchInput:
    """What one search plans: a model (and its prefix sums) on a cluster, at one global and
    micro-batch size, under the planners' options."""

    model: ModelProfile
    prefix: cm.Prefix
    cluster: plan_pb2.Cluster
    global_batch_size: int
    micro_batch_size: int
    options: Options


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """Which plans a search considers; the defaults allow every plan.

    `policies`: the placement policies tried; `replications` limits stage replication counts;
    `start_used` marks devices as unavailable (per-server counts); `straight` accepts only plans
    whose last stage has one device; `max_cuts` overrides LARGE_MAX_CUTS on large clusters."""

    policies: Sequence[str] = PLACEMENT_POLICIES
    replications: Optional[Sequence[int]] = None
    start_used: Optional[Tuple[int, ...]] = None
    straight: bool = False
    max_cuts: Optional[int] = None


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


class _StageCosts:
    """Formula 2's terms of candidate stages for one search, and whether they fit in memory,
    cached by what they depend on."""

    def __init__(self, problem: SearchInput):
        options = problem.options
        self.model = problem.model
        self.prefix = problem.prefix
        self.cluster = problem.cluster
        self.per_server = problem.cluster.devices_per_server
        self.mbs = problem.micro_batch_size
        self.m = problem.global_batch_size // self.mbs
        self.oh = options.overhead_ms
        self.overlap = options.overlap
        self.contention = options.link_contention
        self.mem_cap = problem.cluster.device_memory_bytes
        self.opt = options.optimizer_multiplier
        self.recompute = bool(options.recompute)
        self._ar: Dict[Tuple[int, ...], float] = {}
        self._xfer: Dict[Tuple, float] = {}
        self._cost: Dict[Tuple, Tuple[float, float, float]] = {}
        self._fits: Dict[Tuple, bool] = {}
        self._free: Dict[Tuple[int, ...], Sequence[int]] = {}

    def ar_per_byte(self, devs) -> float:
        v = self._ar.get(devs)
        if v is None:
            v = self._ar[devs] = cm.allreduce_ms_per_byte(self.cluster, devs) if len(devs) > 1 else 0.0
        return v

    def xfer(self, src, dst) -> float:
        if isinstance(src, range) and isinstance(dst, range):
            # Contiguous ranges: the cost is invariant under shifts by whole servers.
            base = src.start - src.start % self.per_server
            key = (src.start - base, len(src), dst.start - base, len(dst))
        else:
            key = (src, dst)
        v = self._xfer.get(key)
        if v is None:
            v = self._xfer[key] = cm.transfer_ms_per_byte(self.cluster, src, dst, self.mbs, self.contention)
        return v

    def stage(self, first, end, devs) -> Tuple[float, float, float]:
        """(forward, backward, AllReduce tail) of stage [first, end) on devs."""
        r = len(devs)
        per_byte = self.ar_per_byte(devs)
        key = (first, end, r, per_byte)
        v = self._cost.get(key)
        if v is not None:
            return v
        prefix, oh = self.prefix, self.oh
        sl = -(-self.mbs // r)
        f = sl * (prefix.fwd[end] - prefix.fwd[first]) + oh
        b = sl * (prefix.bwd[end] - prefix.bwd[first]) + oh + (f - oh if self.recompute else 0.0)
        if r == 1:
            t = 0.0
        elif self.overlap:
            t = cm.allreduce_tail_ms(self.model, first, end, sl, per_byte)
        else:
            t = (prefix.params[end] - prefix.params[first]) * per_byte
        v = self._cost[key] = (f, b, t)
        return v

    def fits(self, first, end, r, k) -> bool:
        """Whether stage [first, end) on r devices fits in memory with k micro-batches in flight."""
        key = (first, end, r, k)
        v = self._fits.get(key)
        if v is None:
            sl = -(-self.mbs // r)
            v = self._fits[key] = cm.memory_bytes(self.prefix, first, end, sl, k, self.opt, num_micro_batches=self.m,
                                                   recompute=self.recompute) <= self.mem_cap
        return v

    def free_devices(self, used: Tuple[int, ...]) -> Sequence[int]:
        """The ids of the devices not in `used` (per-server counts); a range when contiguous."""
        devs = self._free.get(used)
        if devs is None:
            per_server = self.per_server
            ids = tuple(s * per_server + i for s in range(len(used)) for i in range(used[s], per_server))
            if ids and ids[-1] - ids[0] == len(ids) - 1:
                ids = range(ids[0], ids[-1] + 1)
            devs = self._free[used] = ids
        return devs

    def extended(self, state: _State, first, end, devs):
        """The state's forward/backward/tail lists with stage [first, end) on devs appended (after
        the communication stage from the previous stage, if any)."""
        f, b, t = self.stage(first, end, devs)
        if not state.stages:
            return [f], [b], [t]
        x = self.prefix.cut[first] * self.xfer(state.stages[-1][2], devs)
        return state.fwd + [x, f], state.bwd + [x, b], state.tail + [0.0, t]


class _Search:
    """One run of the DP for one micro-batch size (see search()); the methods are its steps.

    `frontier` maps a cut c to the states whose planned stages end at c, one per device set;
    `best_l` is the pruning bound, the latency a candidate must beat to matter."""

    def __init__(self, problem: SearchInput, space: SearchSpace, prune: bool):
        self.problem = problem
        self.space = space
        self.prune = prune
        self.costs = _StageCosts(problem)
        cluster, options = problem.cluster, problem.options
        self.per_server = cluster.devices_per_server
        self.total = cluster.num_servers * self.per_server
        self.n = problem.model.num_layers
        self.mbs = problem.micro_batch_size
        self.m = problem.global_batch_size // self.mbs
        self.mult = self.m if prune else self.m - 1  # L >= M (F_s + B_s) for every stage s (tests/test_cost_model.py)
        self.oh = options.overhead_ms
        self.max_stages = options.max_stages or self.n
        self.cuts = candidate_cuts(problem.prefix)
        self.policies = space.policies
        if self.total > LARGE_CLUSTER_DEVICES:
            self.cuts = coarsen_cuts(problem.prefix, self.cuts, space.max_cuts or LARGE_MAX_CUTS)
            self.policies = [p for p in space.policies if p == "append"] or list(space.policies)[:1]
        reps = (list(space.replications) if space.replications is not None
                else replication_candidates(self.total, self.per_server))
        self.reps = [r for r in reps if r <= self.mbs]
        pf, pb = problem.prefix.fwd, problem.prefix.bwd
        # F + B per sample (a recomputing stage runs its forward twice): the pruning bounds use it
        self.work = [pf[i] * (2 if options.recompute else 1) + pb[i] for i in range(self.n + 1)]
        self.placement_cache: Dict[Tuple, List] = {}  # (used, r) -> [(device ids, used after)]
        self.frontier: Dict[int, Dict[Tuple[int, ...], _State]] = {}
        self.best: Optional[Estimate] = None
        self.best_latency = float("inf")
        self.best_l = float("inf")
        self.top: Optional[TopK] = None

    def too_few_stages(self) -> bool:
        """Every plan uses every device, at most mbs per stage: whether too few stages are possible."""
        if self.space.straight:
            return False
        stages = min(len(self.cuts) + 1, self.problem.options.max_stages or self.n)
        return self.mbs * stages < self.total - sum(self.space.start_used or ())

    def run(self, best_latency: float, top: Optional[TopK]) -> Optional[Estimate]:
        """Expands the states cut by cut, each cut's cheapest first; returns the best plan."""
        self.best_latency, self.top = best_latency, top
        if top is not None:
            top.limit = min(top.limit, best_latency)
        self.best_l = best_latency if top is None else top.bound()
        start_used = self.space.start_used
        if start_used is None:
            start_used = tuple([0] * self.problem.cluster.num_servers)
        self.frontier = {0: {start_used: _State([], [], [], [], 0.0, start_used, 0.0)}}
        for c in [0] + self.cuts:
            states = self.frontier.pop(c, None)
            if not states:
                continue
            for state in sorted(states.values(), key=lambda st: st.latency):
                self.expand(state, c)
        return self.best

    def rest_fill(self, c, free) -> float:
        """F+B of the fastest possible stage holding layers [c, n) on `free` devices."""
        if not self.prune or free <= 0:
            return 0.0
        return self.mbs * (self.work[self.n] - self.work[c]) / free + 2 * self.oh

    def rest_bound(self, c, free) -> float:
        """M (F+B) of the fastest possible stage holding layers [c, n) on `free` devices."""
        return self.m * self.rest_fill(c, free)

    def consider(self, stages) -> None:
        """Costs a complete plan, records it, and lowers the pruning bound."""
        p = self.problem
        est = evaluate(p.model, p.prefix, p.cluster, stages, p.global_batch_size, p.micro_batch_size, p.options)
        best = self.best
        if est.feasible and (best is None or est.latency < best.latency) and est.latency < self.best_latency:
            self.best = best = est
        if self.top is not None:
            self.top.offer(est)
            self.best_l = self.top.bound()
        else:
            self.best_l = best.latency if best is not None else self.best_latency

    def complete(self, state: _State, c):
        """Costs state + last stage [c, n) on all free devices; returns (L, devs) or None."""
        devs = self.costs.free_devices(state.used)
        if not devs or len(devs) > self.mbs or (self.space.straight and len(devs) != 1):
            return None
        fw, bw, tl = self.costs.extended(state, c, self.n, devs)
        return cm.pipeline_latency(fw, bw, tl, self.m)[0], devs

    def expand(self, state: _State, c) -> None:
        """Unless the bounds rule it out: the state as a complete plan, then its splits of the
        last stage at every replication count."""
        if state.steady_bound >= self.best_l:
            return
        free_total = self.total - sum(state.used)
        if self.rest_bound(c, free_total) >= self.best_l:
            return
        filled = sum(state.fwd) + sum(state.bwd) if self.prune else 0.0  # L >= the fill of every stage
        if filled + self.rest_fill(c, free_total) >= self.best_l:
            return
        res = self.complete(state, c)
        if res is not None and res[0] < self.best_l:
            self.consider(state.stages + [(c, self.n, res[1])])
        if not self.can_grow(state):
            return
        for r in self.reps:
            if r >= free_total:
                break
            if free_total - r > self.mbs and not self.space.straight:
                continue
            self.split(state, c, r, free_total - r, filled)

    def can_grow(self, state: _State) -> bool:
        """Whether another stage may follow the state's: within max_stages, and with its planned
        stages fitting under K_i of policy A (which only grows with more stages)."""
        s_total = len(state.stages) + 2
        if s_total > self.max_stages:
            return False
        fits, m = self.costs.fits, self.m
        return all(fits(a, e, len(d), min(s_total - i, m)) for i, (a, e, d) in enumerate(state.stages))

    def placements(self, used: Tuple[int, ...], r: int) -> List:
        """[(device ids, used after)] of a new stage of r devices, one per distinct placement."""
        placements = self.placement_cache.get((used, r))
        if placements is None:
            placements, seen = [], set()
            for pol in self.policies:
                take = place(used, r, self.per_server, pol)
                if take is None or take in seen:
                    continue
                seen.add(take)
                placements.append((device_ids(used, take, self.per_server), tuple(u + k for u, k in zip(used, take))))
            self.placement_cache[(used, r)] = placements
        return placements

    def split(self, state: _State, c, r, rest_free, filled) -> None:
        """The children of a state whose new stage [c, c2) has r devices, over the cuts c2."""
        sl = -(-self.mbs // r)
        placements = self.placements(state.used, r)
        work, mult, oh, prune = self.work, self.mult, self.oh, self.prune
        for c2 in self.cuts:
            if c2 <= c:
                continue
            steady = mult * (sl * (work[c2] - work[c]) + 2 * oh)
            if steady >= self.best_l:
                break
            if self.rest_bound(c2, rest_free) >= self.best_l:
                continue
            if prune and filled + steady / mult + self.rest_fill(c2, rest_free) >= self.best_l:
                continue
            if not self.costs.fits(c, c2, r, min(2, self.m)):
                continue
            for devs, new_used in placements:
                self.add_child(state, c, c2, devs, new_used, steady)

    def add_child(self, state: _State, c, c2, devs, new_used, steady) -> None:
        """The state with new stage [c, c2) on devs: costed as a complete plan when it is one, and
        kept in the frontier at c2 if it is the cheapest for its device set."""
        fw, bw, tl = self.costs.extended(state, c, c2, devs)
        bound = steady
        if self.prune and not state.stages:
            # The first stage is never after the pivot: L >= M (F_0+B_0) + its AllReduce tail.
            bound += tl[0]
            if bound >= self.best_l:
                return
        child = _State(state.stages + [(c, c2, devs)], fw, bw, tl, 0.0, new_used, max(state.steady_bound, bound))
        res = self.complete(child, c2)
        if res is None:
            if not self.space.straight:
                return
            # Incomplete straight prefix: rank by its slowest stage so far.
            child.latency = child.steady_bound + sum(fw) + sum(bw)
        else:
            child.latency = res[0]
            if self.prune and res[0] < self.best_l:
                # Cost it as a complete plan now: a lower best_l prunes sooner.
                self.consider(child.stages + [(c2, self.n, res[1])])
        bucket = self.frontier.setdefault(c2, {})
        old = bucket.get(new_used)
        if old is None or child.latency < old.latency:
            bucket[new_used] = child


def search(problem: SearchInput, space: SearchSpace = SearchSpace(), best_latency: float = float("inf"),
           prune: bool = True, top: Optional[TopK] = None) -> Optional[Estimate]:
    """Runs the DP for one micro-batch size; returns the best feasible plan found whose latency
    is below `best_latency` (None if none).

    `space` restricts the plans considered (SearchSpace); `prune` adds the remaining-work bound
    (module docstring); prune=False is the plain memoized search; with `top`, every complete
    feasible plan is offered to it and the search prunes against top.bound() (also capped by
    `best_latency`)."""
    run = _Search(problem, space, prune)
    if run.too_few_stages():
        return None
    return run.run(best_latency, top)

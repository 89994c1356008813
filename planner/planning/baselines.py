"""Baseline planners, costed with the same model and returned as the same Estimate:

- dp / dp_overlap: data parallelism with gradient accumulation (one stage on every device),
  AllReduce after the last backward, or overlapped with the last micro-batch's backward;
- straight: one stage per device, no replication (partition chosen by the DAPPLE DP restricted
  to replication 1);
- gpipe: torchgpipe's balance-by-time block partition (minimise the slowest stage's F+B, ignoring
  communication) into one stage per device, GPipe schedule (all M forwards in flight);
- pipedream: PipeDream's hierarchical planner (planner/planning/pipedream_partition.py), minimising the
  slowest replicated stage.
"""

from __future__ import annotations

from typing import List, Optional

from planner.planning.dapple_planner import SearchInput, SearchSpace, candidate_cuts, search
from planner.planning.pipedream_partition import pipedream_stages
from planner.planning.plan_eval import Estimate, Options, evaluate


def data_parallel(model, prefix, cluster, gbs, mbs, options: Options, overlap: bool) -> Estimate:
    n = model.num_layers
    total = cluster.num_servers * cluster.devices_per_server
    opts = Options(**{**options.__dict__, "overlap": overlap})
    return evaluate(model, prefix, cluster, [(0, n, tuple(range(total)))], gbs, mbs, opts, policy="A")


# Above this many stages the straight baseline is the time-balanced partition alone.
STRAIGHT_MAX_DP_STAGES = 64


def straight(model, prefix, cluster, gbs, mbs, options: Options, best_latency: float = float("inf")) -> Optional[Estimate]:
    """The DAPPLE DP restricted to one device per stage, seeded with the time-balanced partition
    (the best of the two; the seed only lets the search prune sooner). Like search(), returns
    None when nothing beats `best_latency`."""
    total = cluster.num_servers * cluster.devices_per_server
    stages = min(total, len(candidate_cuts(prefix)) + 1)
    start = _reserve(cluster, total - stages)
    seed = evaluate(model, prefix, cluster, balanced_stages(model, prefix, stages), gbs, mbs, options)
    if not seed.feasible or seed.latency >= best_latency or (len(seed.stages) != stages
                                                             and stages <= STRAIGHT_MAX_DP_STAGES):
        seed = None  # the DP plans exactly `stages` stages; a seed with fewer is outside its space
    if stages > STRAIGHT_MAX_DP_STAGES:
        return seed  # the DP over hundreds of one-device stages is too slow; balanced partition only
    floor = seed.latency if seed is not None else best_latency
    found = search(SearchInput(model, prefix, cluster, gbs, mbs, options),
                   SearchSpace(replications=[1], start_used=start, straight=True), best_latency=floor)
    return found if found is not None else seed


def balanced_stages(model, prefix, parts):
    """One device per block of the balance-by-time partition into at most `parts` blocks."""
    n = model.num_layers
    costs = [model.forward_ms[i] + model.backward_ms[i] for i in range(n)]
    edges = [0] + balanced_partition(costs, candidate_cuts(prefix), parts) + [n]
    return [(edges[i], edges[i + 1], (i,)) for i in range(len(edges) - 1)]


def _reserve(cluster, count):
    """Per-server used counts that leave the last `count` devices out of a plan."""
    per = cluster.devices_per_server
    used = [0] * cluster.num_servers
    s = cluster.num_servers - 1
    while count > 0:
        t = min(per, count)
        used[s] = t
        count -= t
        s -= 1
    return tuple(used)


def balanced_partition(costs: List[float], boundaries: List[int], parts: int) -> List[int]:
    """Block partition of a sequence (cuts restricted to `boundaries`) into at most `parts`
    blocks minimising the largest block sum; returns the chosen cut positions."""
    n = len(costs)
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    bounds = sorted(set(b for b in boundaries if 0 < b < n))

    def cuts_for(limit):
        cuts, start = [], 0
        prev = None
        for b in bounds + [n]:
            if pre[b] - pre[start] > limit:
                if prev is None or prev == start:
                    return None
                cuts.append(prev)
                start = prev
                if pre[b] - pre[start] > limit:
                    return None
            prev = b
        return cuts

    lo, hi = 0.0, pre[n]
    best = cuts_for(hi) or []
    for _ in range(60):
        mid = (lo + hi) / 2
        c = cuts_for(mid)
        if c is not None and len(c) + 1 <= parts:
            hi, best = mid, c
        else:
            lo = mid
    return best


def gpipe(model, prefix, cluster, gbs, mbs, options: Options) -> Estimate:
    total = cluster.num_servers * cluster.devices_per_server
    return evaluate(model, prefix, cluster, balanced_stages(model, prefix, total), gbs, mbs, options,
                    schedule="gpipe")


def pipedream(model, prefix, cluster, gbs, mbs, options: Options) -> Estimate:
    """PipeDream's hierarchical DP (level 1: devices of a server over NVLink; level 2: servers
    over Ethernet), then the stages are laid out on consecutive devices. The partition does not
    depend on the micro-batch size, so it is computed once per (profile, cluster)."""
    key = (id(prefix), cluster.num_servers, cluster.devices_per_server, cluster.intra_server_bandwidth,
           cluster.inter_server_bandwidth)
    cached = _PIPEDREAM_CACHE.get(key)
    if cached is None or cached[0] is not prefix:
        cached = _PIPEDREAM_CACHE[key] = (prefix, pipedream_stages(model, prefix, cluster))
        while len(_PIPEDREAM_CACHE) > 8:
            _PIPEDREAM_CACHE.pop(next(iter(_PIPEDREAM_CACHE)))
    return evaluate(model, prefix, cluster, cached[1], gbs, mbs, options)


_PIPEDREAM_CACHE: dict = {}

"""Baseline planners, costed with the same model and returned as the same Estimate:

- dp / dp_overlap: data parallelism with gradient accumulation (one stage on every device),
  AllReduce after the last backward, or overlapped with the last micro-batch's backward;
- straight: one stage per device, no replication (partition chosen by the DAPPLE DP restricted
  to replication 1);
- gpipe: torchgpipe's balance-by-time block partition (minimise the slowest stage's F+B, ignoring
  communication) into one stage per device, GPipe schedule (all M forwards in flight);
- pipedream: PipeDream's hierarchical planner objective (its paper, section 3.1): per level of
  the hierarchy, A(j, m) = min over i, m' of max(A(i, m - m'), 2 C_i, T(i+1..j, m')) with
  T = max(compute, weight sync 4 (m-1) |w| / (m B)) / m, minimising the slowest replicated stage.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Tuple

from planner import cost_model as cm
from planner.dapple_planner import candidate_cuts, search
from planner.plan_eval import Estimate, Options, evaluate


def data_parallel(model, prefix, cluster, gbs, mbs, options: Options, overlap: bool) -> Estimate:
    n = model.num_layers
    total = cluster.num_servers * cluster.devices_per_server
    opts = Options(**{**options.__dict__, "overlap": overlap})
    return evaluate(model, prefix, cluster, [(0, n, tuple(range(total)))], gbs, mbs, opts, policy="A")


def straight(model, prefix, cluster, gbs, mbs, options: Options) -> Optional[Estimate]:
    total = cluster.num_servers * cluster.devices_per_server
    stages = min(total, len(candidate_cuts(prefix)) + 1, mbs * 0 + total)
    start = _reserve(cluster, total - stages)
    return search(model, prefix, cluster, gbs, mbs, options, replications=[1], start_used=start, straight=True)


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
    n = model.num_layers
    costs = [model.forward_ms[i] + model.backward_ms[i] for i in range(n)]
    cuts = balanced_partition(costs, candidate_cuts(prefix), total)
    edges = [0] + cuts + [n]
    stages = [(edges[i], edges[i + 1], (i,)) for i in range(len(edges) - 1)]
    return evaluate(model, prefix, cluster, stages, gbs, mbs, options, schedule="gpipe")


def pipedream(model, prefix, cluster, gbs, mbs, options: Options) -> Estimate:
    """PipeDream's hierarchical DP (level 1: devices of a server over NVLink; level 2: servers
    over Ethernet), then the stages are laid out on consecutive devices."""
    cuts = [0] + candidate_cuts(prefix) + [model.num_layers]
    per, servers = cluster.devices_per_server, cluster.num_servers
    comp = [prefix.fwd[c] + prefix.bwd[c] for c in cuts]
    par = [prefix.params[c] for c in cuts]
    k = len(cuts)

    def level(bw, units, block_time):
        """A(i, j, m): best (bottleneck, [(i, j, m)]) for cut-index range [i, j) on m units."""

        @functools.lru_cache(maxsize=None)
        def a(i, j, m):
            t = block_time(i, j, m)
            best = (t, ((i, j, m),))
            for mid in range(i + 1, j):
                comm = 2 * prefix.cut[cuts[mid]] / bw * 1e3
                for m2 in range(1, m):
                    t2 = block_time(mid, j, m2)
                    if t2 >= best[0]:
                        continue
                    left = a(i, mid, m - m2)
                    v = max(left[0], comm, t2)
                    if v < best[0]:
                        best = (v, left[1] + ((mid, j, m2),))
            return best

        return a

    def sync(nbytes, m, bw):
        return 4 * (m - 1) * nbytes / (m * bw) * 1e3 if m > 1 else 0.0

    def t1(i, j, m):
        return max(comp[j] - comp[i], sync(par[j] - par[i], m, cluster.intra_server_bandwidth)) / m

    level1 = level(cluster.intra_server_bandwidth, per, t1)
    if servers == 1:
        blocks = [(1, list(level1(0, k - 1, per)[1]))]
    else:
        def t2(i, j, m):
            inner = level1(i, j, per)[0] if per > 1 else comp[j] - comp[i]
            return max(inner, sync(par[j] - par[i], m, cluster.inter_server_bandwidth) / m) / m

        level2 = level(cluster.inter_server_bandwidth, servers, t2)
        blocks = [(m, list(level1(i, j, per)[1]) if per > 1 else [(i, j, 1)])
                  for i, j, m in level2(0, k - 1, servers)[1]]
    # A level-2 block of m servers holds its level-1 stages; a stage of r devices takes r
    # devices on each of the block's servers.
    stages, server = [], 0
    for m, inner in blocks:
        offset = 0
        for a, b, r in inner:
            devs = tuple(s * per + offset + d for s in range(server, server + m) for d in range(r))
            stages.append((cuts[a], cuts[b], devs))
            offset += r
        server += m
    return evaluate(model, prefix, cluster, stages, gbs, mbs, options)

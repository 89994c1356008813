"""PipeDream's partitioning planner (its paper, section 3.1), the `pipedream` baseline's stages.

Per level of the hierarchy (level 1: the devices of a server over NVLink; level 2: servers over
Ethernet), A(i, j, m) is the slowest stage of the best split of cut range [i, j) over m units:
    A(i, j, m) = min(T(i, j, m), min over mid, m' of max(A(i, mid, m - m'), 2 C_mid, T(mid, j, m')))
with T = max(compute, weight sync 4 (m-1) |w| / (m B)) / m and C_mid the activation transfer at
cut mid. Level 2's T of a block is level 1's best for it on a whole server. The stages are then
laid out on consecutive devices.

Solved bottom-up, one start cut i at a time (A(i, ., .) depends only on A(i, mid, .) and on
blocks T(mid, j, .)), in flat lists: the same values, choices and tie-breaking as the recursive
form, 3-4x faster (planning time target of issue 4).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

from planner.planning.dapple_planner import candidate_cuts

# Large inputs are coarsened so the O(cuts^3 units^2) DP stays fast: at most this many cut
# positions (evenly spaced by compute) and, above 16 units, unit counts on a geometric grid.
PIPEDREAM_MAX_CUTS = 64

Block = Tuple[int, int, int]  # (first cut index, end cut index, units)


class _Level:
    """A(i, j, m) of one hierarchy level over cut indices 0..k-1 and 1..units units."""

    def __init__(self, k: int, units: int, comm_at: List[float], block_time: Callable[[int, int, int], float]):
        self.k, self.units, self.comm_at, self.block_time = k, units, comm_at, block_time
        grid = sorted({x for x in range(1, 5)} | {2**e for e in range(units.bit_length())}
                      | {3 * 2**e for e in range(units.bit_length())})
        self.splits = [list(range(1, m)) if units <= 16 else [x for x in grid if x < m] for m in range(units + 1)]
        self.rows: Dict[int, List[float]] = {}
        self.solved: Dict[int, Tuple[List[List[float]], List[list]]] = {}

    def row(self, i: int, j: int) -> List[float]:
        """T(i, j, m) for m = 0..units (index 0 unused)."""
        key = i * self.k + j
        r = self.rows.get(key)
        if r is None:
            r = self.rows[key] = [0.0] + [self.block_time(i, j, m) for m in range(1, self.units + 1)]
        return r

    def _solve(self, i: int):
        k, units, comm_at, splits, row = self.k, self.units, self.comm_at, self.splits, self.row
        best: List[List[float]] = [[0.0] * (units + 1) for _ in range(k)]
        pick: List[list] = [[None] * (units + 1) for _ in range(k)]
        for j in range(i + 1, k):
            own = row(i, j)
            to_j: List = [None] * j  # T(mid, j, .), computed when first needed (level 2's calls level 1)
            best_j, pick_j = best[j], pick[j]
            for m in range(1, units + 1):
                b, p = own[m], None
                split = splits[m]
                for mid in range(i + 1, j):
                    comm = comm_at[mid]
                    if comm >= b:
                        continue
                    times = to_j[mid]
                    if times is None:
                        times = to_j[mid] = row(mid, j)
                    left_row = best[mid]
                    for m2 in split:
                        t2 = times[m2]
                        if t2 >= b:
                            continue
                        left = left_row[m - m2]
                        v = left if left > t2 else t2
                        if comm > v:
                            v = comm
                        if v < b:
                            b, p = v, (mid, m2)
                best_j[m], pick_j[m] = b, p
        self.solved[i] = (best, pick)
        return best, pick

    def value(self, i: int, j: int, m: int) -> float:
        table = self.solved.get(i) or self._solve(i)
        return table[0][j][m]

    def blocks(self, i: int, j: int, m: int) -> List[Block]:
        """The best split of [i, j) over m units, as blocks in order."""
        out: List[Block] = []
        while True:
            pick = (self.solved.get(i) or self._solve(i))[1][j][m]
            if pick is None:
                out.append((i, j, m))
                return out[::-1]
            mid, m2 = pick
            out.append((mid, j, m2))
            j, m = mid, m - m2


def pipedream_stages(model, prefix, cluster) -> List[Tuple[int, int, Tuple[int, ...]]]:
    """[(first layer, end layer, device ids)] of PipeDream's plan for `cluster`."""
    inner = candidate_cuts(prefix)
    if len(inner) > PIPEDREAM_MAX_CUTS:
        total = prefix.fwd[-1] + prefix.bwd[-1]
        picked = []
        for q in range(1, PIPEDREAM_MAX_CUTS + 1):
            goal = total * q / (PIPEDREAM_MAX_CUTS + 1)
            c = min(inner, key=lambda x: abs(prefix.fwd[x] + prefix.bwd[x] - goal))
            if c not in picked:
                picked.append(c)
        inner = sorted(picked)
    cuts = [0] + inner + [model.num_layers]
    per, servers = cluster.devices_per_server, cluster.num_servers
    comp = [prefix.fwd[c] + prefix.bwd[c] for c in cuts]
    par = [prefix.params[c] for c in cuts]
    k = len(cuts)

    def comm_at(bw):  # both directions across each cut
        return [2 * prefix.cut[c] / bw * 1e3 for c in cuts]

    def sync(nbytes, m, bw):
        return 4 * (m - 1) * nbytes / (m * bw) * 1e3 if m > 1 else 0.0

    def t1(i, j, m):
        return max(comp[j] - comp[i], sync(par[j] - par[i], m, cluster.intra_server_bandwidth)) / m

    level1 = _Level(k, per, comm_at(cluster.intra_server_bandwidth), t1)
    if servers == 1:
        blocks = [(1, level1.blocks(0, k - 1, per))]
    else:
        def t2(i, j, m):
            inner_time = level1.value(i, j, per) if per > 1 else comp[j] - comp[i]
            return max(inner_time, sync(par[j] - par[i], m, cluster.inter_server_bandwidth) / m) / m

        level2 = _Level(k, servers, comm_at(cluster.inter_server_bandwidth), t2)
        blocks = [(m, level1.blocks(i, j, per) if per > 1 else [(i, j, 1)])
                  for i, j, m in level2.blocks(0, k - 1, servers)]
    # A level-2 block of m servers holds its level-1 stages; a stage of r devices takes r
    # devices on each of the block's servers.
    stages, server = [], 0
    for m, inner_blocks in blocks:
        offset = 0
        for a, b, r in inner_blocks:
            devs = tuple(s * per + offset + d for s in range(server, server + m) for d in range(r))
            stages.append((cuts[a], cuts[b], devs))
            offset += r
        server += m
    return stages

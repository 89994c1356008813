"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24): per stage, an order
of forward (F), input-gradient (B) and weight-gradient (W) tasks.

Splitting a backward into B, which the previous stage waits for, and W, which nobody waits for until
the AllReduce and the apply step, lets W fill the pipeline's bubbles. The orders are built by list
scheduling on unit costs (F = B = W = 1, transfers free), the heuristic of the paper's section 3.2:
whenever a stage is free it runs, in this order of preference,
1. the next B, when the next stage has sent its gradient;
2. the next F, when the previous stage has sent its activation, unless the stage already holds
   `forward_cap` micro-batches between F and B or `live_cap` micro-batches between F and W (a
   micro-batch's activations live until its W);
3. the oldest W still pending.
The first stage, whose B no stage waits for, prefers its next F to its next B: it then runs 1F1B with each
W right after its B (F0 F1 B0 W0 F2 B1 W1 ... at S = 2), the paper's ZB-H1 order there, and never holds a
W's inputs beside a new forward's activations (the same unit-cost steps on every S <= 8, M <= 4S checked;
B first made it run B1 before F2 and hold W1's inputs beside F2's activations).
Variants:
- "zb-h1": forward_cap = DAPPLE's K_i (its warm-up policy, or K_i given), live_cap = max K_i: the peak
  memory of DAPPLE's 1F1B on its first stage, on every stage.
- "zb-h2": forward_cap = 2(S - i) - 1, live_cap = 2S - 1 (both capped by D): more warm-up forwards fill
  the bubble before the first backward, for about twice the activation memory of policy A.
On unit costs zb-h1 reaches the bound 3M + S - 1 of the paper's ZB-H1 for two stages (1F1B: 3(M + S - 1));
for deeper pipelines this greedy order can be a few units longer than that bound (4 stages, M = 8: 29
vs 27; 1F1B 33): WORKSPACE_NOTES.md, "Zero-bubble schedules".
"""

from typing import List, Optional, Sequence, Tuple

KINDS = ("zb-h1", "zb-h2")


def caps(kind: str, warmup: Sequence[int], max_in_flight: Optional[int] = None) -> Tuple[Tuple[int, ...], int]:
    """(forward_cap per stage, live_cap) of a zero-bubble variant; `warmup`: DAPPLE's K_i for the same plan."""
    num_stages = len(warmup)
    if kind == "zb-h1":
        forward = list(warmup)
    else:
        forward = [2 * (num_stages - i) - 1 for i in range(num_stages)]
        if max_in_flight is not None:
            forward = [min(k, max_in_flight) for k in forward]
    forward = [max(1, k) for k in forward]
    return tuple(forward), max(forward)


def stage_orders(num_stages: int, num_micro_batches: int, forward_cap: Sequence[int],
                 live_cap: int) -> List[List[Tuple[str, int]]]:
    """Per stage, the (kind, micro_batch) order the list scheduling of the module docstring gives."""
    s_count, m = num_stages, num_micro_batches
    forwards, backwards, weights = [0] * s_count, [0] * s_count, [0] * s_count
    forward_done = [[None] * m for _ in range(s_count)]  # unit time at which F(s, i) ends
    backward_done = [[None] * m for _ in range(s_count)]
    free_at = [0] * s_count
    orders: List[List[Tuple[str, int]]] = [[] for _ in range(s_count)]
    remaining, now = 3 * m * s_count, 0

    def ended(times, i):
        return times[i] is not None and times[i] <= now

    while remaining:
        if now > 6 * m * s_count:
            raise ValueError(f"no zero-bubble order for {s_count} stages, M={m}, caps {list(forward_cap)}/{live_cap}")
        for s in range(s_count):
            if free_at[s] > now:
                continue
            b, f = backwards[s], forwards[s]
            can_forward = (f < m and f - b < forward_cap[s] and f - weights[s] < live_cap
                           and (s == 0 or ended(forward_done[s - 1], f)))
            if s == 0 and can_forward:
                orders[s].append(("F", f))
                forward_done[s][f] = now + 1
                forwards[s] += 1
            elif b < f and ended(forward_done[s], b) and (s == s_count - 1 or ended(backward_done[s + 1], b)):
                orders[s].append(("B", b))
                backward_done[s][b] = now + 1
                backwards[s] += 1
            elif can_forward:
                orders[s].append(("F", f))
                forward_done[s][f] = now + 1
                forwards[s] += 1
            elif weights[s] < b:
                orders[s].append(("W", weights[s]))
                weights[s] += 1
            else:
                continue
            free_at[s] = now + 1
            remaining -= 1
        now += 1
    return orders

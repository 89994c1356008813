"""Interleaved 1F1B (Narayanan et al., SC'21, Megatron-LM): each of P device groups holds v non-adjacent
stages (chunks), stage s on group s % P, and runs the tasks of all its stages in one merged order.

Group p walks "virtual micro-batches": forward number k (0 <= k < M v) is micro-batch
(k // (P v)) P + k % P of its chunk (k // P) % v, i.e. P micro-batches through one chunk, then the same
P through the next chunk; backward number k visits the chunks in reverse. Group p runs
(P - p - 1) 2 + (v - 1) P + 1 forwards before its first backward (capped at M v), then alternates one
backward and one forward, then drains the backwards. This needs M to be a multiple of P. With v = 1 it is DAPPLE's
1F1B with policy A.

    >>> for p, order in enumerate(lane_orders(2, 2, 4)):
    ...     print(p, " ".join(f"{k}{m}.s{s}" for k, s, m in order))
    0 F0.s0 F1.s0 F0.s2 F1.s2 F2.s0 B0.s2 F3.s0 B1.s2 F2.s2 B0.s0 F3.s2 B1.s0 B2.s2 B3.s2 B2.s0 B3.s0
    1 F0.s1 F1.s1 F0.s3 B0.s3 F1.s3 B1.s3 F2.s1 B0.s1 F3.s1 B1.s1 F2.s3 B2.s3 F3.s3 B3.s3 B2.s1 B3.s1
"""

from typing import List, Tuple


def check(num_stages: int, num_lanes: int, num_micro_batches: int) -> str:
    """Why these numbers cannot run interleaved ('' when they can)."""
    if num_lanes < 1 or num_stages % num_lanes:
        return (f"the interleaved schedule needs the stages ({num_stages}) to be a multiple of the device groups "
                f"({num_lanes}): stage s runs on group s % {num_lanes}")
    if num_stages > num_lanes and num_micro_batches % num_lanes:
        return (f"the interleaved schedule needs M ({num_micro_batches}) to be a multiple of the device groups "
                f"({num_lanes})")
    return ""


def warmup_forwards(lane: int, num_lanes: int, chunks: int, num_micro_batches: int) -> int:
    """Forwards group `lane` runs before its first backward."""
    if chunks == 1:
        return min(num_lanes - lane, num_micro_batches)
    return min((num_lanes - lane - 1) * 2 + (chunks - 1) * num_lanes + 1, num_micro_batches * chunks)


def lane_orders(num_lanes: int, chunks: int, num_micro_batches: int) -> List[List[Tuple[str, int, int]]]:
    """Per device group, its (kind "F"/"B", stage, micro-batch) order (module docstring)."""
    p_count, v, m = num_lanes, chunks, num_micro_batches
    total = m * v

    def virtual(lane: int, k: int, forward: bool) -> Tuple[int, int]:
        chunk = (k // p_count) % v
        if not forward:
            chunk = v - 1 - chunk
        micro_batch = (k // (p_count * v)) * p_count + k % p_count
        return chunk * p_count + lane, micro_batch

    orders = []
    for lane in range(p_count):
        warm = warmup_forwards(lane, p_count, v, m)
        order = [("F",) + virtual(lane, k, True) for k in range(warm)]
        forwards, backwards = warm, 0
        while backwards < total:
            order.append(("B",) + virtual(lane, backwards, False))
            backwards += 1
            if forwards < total:
                order.append(("F",) + virtual(lane, forwards, True))
                forwards += 1
        orders.append(order)
    return orders

"""Measuring several things in interleaved rounds: each round takes every measurement once, in turn.

A shared machine's speed moves over seconds to minutes. Measuring all of one thing, then all of the next, lets a
slow minute land on one of them alone; measuring them in rounds (all layers of all batch sizes in turn, several
rounds) lets it fall on all alike, so the medians over rounds keep their ratios, and the rounds' range (the
spread) says how much the machine moved meanwhile.
"""

import statistics
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple


def measure_in_rounds(measures: Dict[Hashable, Callable[[], float]], rounds: int,
                      after_round: Optional[Callable[[int, Dict[Hashable, List[float]]], None]] = None
                      ) -> Dict[Hashable, List[float]]:
    """{key: one sample per round}: each round calls every measure once, in the dict's order;
    `after_round(r, samples so far)` after each (r from 1)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    samples: Dict[Hashable, List[float]] = {key: [] for key in measures}
    for r in range(rounds):
        for key, measure in measures.items():
            samples[key].append(float(measure()))
        if after_round is not None:
            after_round(r + 1, samples)
    return samples


def median_and_spread(values: Sequence[float]) -> Tuple[float, float]:
    """(median, relative spread): the spread is (largest - smallest) / median (0 for a zero median)."""
    median = statistics.median(values)
    return median, ((max(values) - min(values)) / median if median > 0 else 0.0)

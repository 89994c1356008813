"""Measuring several things in interleaved rounds: each round takes every measurement once, in turn.

A shared machine's speed moves over seconds to minutes. Measuring all of one thing, then all of the next, lets a
slow minute land on one of them alone; measuring them in rounds (all layers of all batch sizes in turn, several
rounds) lets it fall on all alike, so the medians over rounds keep their ratios, and the rounds' range (the
spread) says how much the machine moved meanwhile. A spread above NOISY_SPREAD (planner/planning/ties.py) says
the machine was busy: dapple_profile warns (noise_warning), and the planner names the plans it cannot order.
"""

import statistics
from typing import Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

from planner.formats import layer_cost_pb2
from planner.planning.ties import NOISY_SPREAD, noisy


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


def noise_warning(profiles: Mapping[int, layer_cost_pb2.LayerCostProfile], runs: int) -> str:
    """The one line dapple_profile prints when its profiles ({batch size: profile}) were measured on a busy machine
    (the noisiest's spread above NOISY_SPREAD), "" otherwise; `runs`: the timed runs per measurement used.

    The figure is each profile's relative_spread, its whole step's (largest - smallest) / median over the rounds:
    it is what the profile records and what the planner reads for ties, so this line and the plan's report quote
    one number; and the whole step is the longest single measurement, so its spread is the machine moving, where a
    small layer's time (tens of microseconds less a no-op's run) spreads 200-600% over the same rounds. More timed
    runs per round make each round's median, and so the spread, steadier; more rounds do not narrow a range.
    """
    size, profile = max(profiles.items(), key=lambda item: item[1].relative_spread, default=(0, None))
    if profile is None or not noisy(profile.relative_spread):
        return ""
    spread = f"{profile.relative_spread:.0%}"
    return (f"warning: the whole step at batch {size} spread {spread} across its {profile.timing_rounds} rounds "
            f"(above {NOISY_SPREAD:.0%}): the machine was busy, and the planner will take plans within {spread} of "
            f"each other as ties; profile again on a quiet machine, or with more --runs per measurement (now {runs})")

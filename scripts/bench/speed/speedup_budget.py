"""Where a plan's speedup goes between the ideal and what the simulator predicts: the factors the speed
benchmark prints under its table (pure Python, no TensorFlow).

    ideal / slices / sharing = after compute;  after compute / rest = simulated speedup

- ideal: devices x M / (M + S - 1), the pipeline bubble only (BenchPlan.ideal_speedup; a schedule that splits
  the backward, zero bubble or input gradients first, shrinks the bubble below that, so rest can be < 1);
- slices: per-sample compute of the plan's slices over that of the whole batch, both measured by the
  profiler (e.g. 128-row matmuls slower per row than 1024-row ones);
- sharing: the measured slowdown of every worker computing at once (workers of one machine share its caches
  and memory bandwidth; Cluster.concurrent_compute_slowdown), for plans on more than one device;
- rest: what the simulator adds beyond that: transfers, the AllReduce, stage imbalance, the schedule.
A target above "after compute" is out of reach, whatever the transfers cost, of every order whose bubble is the
ideal's (GPipe, DAPPLE with whole backwards); a split backward beats it by the part of the bubble it removes
(two stages on unit costs: 3M + 2 units with input gradients first, 3M + 1 with ZB-H1, against 3M + 3). As far
as the profiles measured the slices right: on a machine whose speed moves, check the slices factor against the
runtime's own (one worker at M=m over M=1).
"""

import dataclasses
import statistics
from typing import Optional, Sequence

from planner.formats.model_profile import ModelProfile


def per_sample_ms(model: ModelProfile, stacked_model: Optional[ModelProfile] = None) -> float:
    """Forward + backward per sample (the profile's whole step over its batch, as the planner scales it); with
    `stacked_model`, the weight gradients (backward less its input-gradient part) costed by that profile, as a
    batched-w plan computes them over all micro-batches stacked."""
    if stacked_model is None or not model.backward_input_ms or not stacked_model.backward_input_ms:
        return sum(model.forward_ms) + sum(model.backward_ms)
    weights = sum(b - i for b, i in zip(stacked_model.backward_ms, stacked_model.backward_input_ms))
    return sum(model.forward_ms) + sum(model.backward_input_ms) + weights


@dataclasses.dataclass(frozen=True)
class SpeedupBudget:
    ideal: float
    slices: float
    sharing: float
    simulated: float  # the simulated single-worker step over the plan's

    @property
    def after_compute(self) -> float:
        return self.ideal / self.slices / self.sharing

    @property
    def rest(self) -> float:
        return self.after_compute / self.simulated

    def text(self, measured: float, round_speedups: Sequence[float] = ()) -> str:
        """One line; the measured speedup over the simulated one (the single worker and the plan measured side
        by side, so it holds where the machine's speed moved between profiling and timing, unlike the step
        times' ratio); with the speedups of single rounds (>= 4), their middle half too: how far this machine
        moved while the plans ran side by side."""
        spread = ""
        if len(round_speedups) >= 4:
            low, _, high = statistics.quantiles(round_speedups, n=4)
            spread = f" (rounds' middle half {low:.2f}-{high:.2f})"
        return (f"ideal {self.ideal:.2f} / slices {self.slices:.2f} / sharing {self.sharing:.2f} = after compute "
                f"{self.after_compute:.2f}; / transfers, AllReduce, imbalance {self.rest:.2f} = simulated "
                f"{self.simulated:.2f}; measured {measured:.2f}, {measured / self.simulated:.2f} of simulated{spread}")


def speedup_budget(ideal: float, num_devices: int, slice_model: ModelProfile, batch_model: ModelProfile,
                   sharing: float, simulated_single_ms: float, simulated_ms: float,
                   stacked_model: Optional[ModelProfile] = None) -> SpeedupBudget:
    """The factors of a plan whose slices were profiled as `slice_model` and whose whole batch as
    `batch_model` (its stacked weight gradients as `stacked_model`, batched-w plans); `sharing` (>= 1) counts
    only where the plan uses several devices."""
    if simulated_ms <= 0 or per_sample_ms(batch_model) <= 0:
        raise ValueError(f"no speedup budget from simulated {simulated_ms} ms and a batch profile of "
                         f"{per_sample_ms(batch_model)} ms per sample")
    return SpeedupBudget(ideal=ideal, slices=per_sample_ms(slice_model, stacked_model) / per_sample_ms(batch_model),
                         sharing=sharing if num_devices > 1 else 1.0,
                         simulated=simulated_single_ms / simulated_ms)

"""The planner's memory model: what one device of a stage holds.

A device of a stage holds (2 + optimizer multiplier) x the stage's parameters (weights, gradients,
optimizer state) plus, for each of its K_i in-flight micro-batch slices, the bytes every layer of
the stage keeps from its forward until its backward (the profile's kept bytes per sample, derived
from its memory figures in planner/formats/memory_figures.py; cost_model.memory_bytes adds it up).
Backward working memory (`backward_working_bytes`, measured by the profiler with the allocator): what
a layer's backward allocates at its peak besides its weight gradients (counted with the parameters):
input gradients and temporaries (an unrolled LSTM sums its per-step slice gradients from dense
buffers of the whole gate tensor). One backward runs at a time on
a device, so a stage needs it once, for one slice, and only beyond what the slice's later layers in
the stage have freed by then (`stage_working_bytes`), not per in-flight micro-batch.
"""

from __future__ import annotations

from typing import Sequence


def stage_working_bytes(working_per_sample: Sequence[float], first: int, end: int, slice_samples: int,
                        kept_per_sample: Sequence[float] = ()) -> float:
    """Backward working memory of a stage of layers [first, end) beyond one slice's kept bytes: one
    backward runs at a time, and while layer i's runs, the layers after it in the stage have freed
    what they kept for that slice, so the stage's peak adds slice x max_i (W_i - kept of layers
    i+1..end-1), at least 0. Without `kept_per_sample`: slice x the largest W_i."""
    later = sum(kept_per_sample[first + 1:end]) if kept_per_sample else 0.0
    extra = 0.0
    for i in range(first, end):
        extra = max(extra, working_per_sample[i] - later)
        if kept_per_sample and i + 1 < end:
            later -= kept_per_sample[i + 1]
    return slice_samples * extra


LOWER_BOUND_NOTE = ("the profile has no memory figures (no measured kept bytes or step memory, no --profile_memory): "
                    "activation memory counts only each layer's output bytes, so the planner's memory figures "
                    "are a lower bound")

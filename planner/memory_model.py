"""What a layer keeps alive for its backward pass: the activation term of the planner's memory model.

A device of a stage holds (2 + optimizer multiplier) x the stage's parameters (weights, gradients,
optimizer state) plus, for each of its K_i in-flight micro-batch slices, the bytes every layer of
the stage keeps from its forward until its backward ("kept bytes": the layer's inputs, attention
scores, LSTM gates, pre-activations, dropout masks, ...). A profile's `activation_bytes` are only
what a layer outputs, a lower bound of that.

Where the kept bytes come from, per sample (`kept_bytes_per_sample`):
1. The profile's step memory (`LayerCostProfile.step_peak_bytes`, measured by the profiler, or the
   `profile_memory` input for PipeDream files, e.g. the paper's Table 1 figure: BERT-48 11.4 GB at
   2): one training step at the profile batch size b holds the weights and their gradients plus
   what the forward keeps for backward, so the activation part is A = step - 2 x parameters
   (optimizer state is not part of one forward/backward step). A is spread over the layers in
   proportion to their measured kept bytes (`backward_kept_bytes`) when the profile has them,
   else in proportion to their output bytes; per sample it is divided by b.
2. Measured kept bytes without a step figure: used as they are.
3. Neither: the output bytes (a lower bound; `lower_bound` is True and the planner says so).
Backward working memory (`backward_working_bytes`, measured by the profiler with the allocator): what
a layer's backward allocates at its peak besides its weight gradients (counted with the parameters):
input gradients and temporaries (an unrolled LSTM sums its per-step slice gradients from dense
buffers of the whole gate tensor). One backward runs at a time on
a device, so a stage needs it once, for one slice: slice x the largest per-sample working bytes of its
layers (`stage_working_bytes`), not per in-flight micro-batch. The step's peak holds it once too: it
is at most every layer's kept bytes plus the largest working bytes, and the spread takes that bound
as the peak (A less the model's largest working bytes is spread over the kept bytes).
Input nodes (PipeDream's `Input*`) keep nothing: they are not layers (planner/profile.py).
"""

from __future__ import annotations

import os
import re
from typing import List, Optional, Sequence, Tuple

_UNITS = {"": 1.0, "B": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "KIB": 2.0**10, "MIB": 2.0**20, "GIB": 2.0**30, "TIB": 2.0**40}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
SIDE_FILE_SUFFIX = ".memory"


class MemoryInputError(ValueError):
    """A memory figure that cannot be read or used."""


def parse_size(text: str) -> float:
    """Bytes of a size such as `11.4GB` (decimal units, as the paper), `12GiB` or `4096`."""
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise MemoryInputError(f"cannot read memory size {text!r}: expected a number with an optional unit "
                               f"(B, KB, MB, GB, KiB, MiB, GiB), e.g. 11.4GB")
    return float(match.group(1)) * _UNITS[unit]


def side_file_memory(profile_path: str) -> Optional[float]:
    """The step memory written in `<profile_path>.memory` (one size, e.g. `11.4GB`), or None."""
    side = profile_path + SIDE_FILE_SUFFIX
    if not os.path.exists(side):
        return None
    with open(side, "r", encoding="utf-8") as f:
        text = f.read().strip()
    try:
        return parse_size(text)
    except MemoryInputError as e:
        raise MemoryInputError(f"{side}: {e}") from None


def kept_bytes_per_sample(output_bytes: Sequence[float], measured_kept: Sequence[float],
                          parameter_bytes: Sequence[float], is_input: Sequence[bool], batch_size: int,
                          step_bytes: Optional[float], model_name: str = "model",
                          working_bytes: Sequence[float] = ()) -> Tuple[List[float], str]:
    """(per-layer kept bytes per sample, source) with source one of "step", "measured", "lower_bound".

    `output_bytes`, `measured_kept` and `working_bytes` (backward working memory) are for the whole
    profile batch (0 / empty when not measured); `step_bytes` is the step memory at the profile batch
    size, or None. The step's activation part excludes the largest working bytes (held once, beside
    what the layers keep; at least 0: a step peak below one layer's backward leaves nothing to spread)."""
    has_measured = any(v > 0 for v in measured_kept)
    weights = [0.0 if inp else float(k if has_measured else o)
               for o, k, inp in zip(output_bytes, measured_kept, is_input)]
    if step_bytes is None or step_bytes <= 0:
        source = "measured" if has_measured else "lower_bound"
        return [w / batch_size for w in weights], source
    state = 2.0 * sum(parameter_bytes)
    activations = step_bytes - state
    if activations <= 0:
        raise MemoryInputError(
            f"{model_name}: step memory {step_bytes / 1e9:.3g} GB at batch {batch_size} is not more than its "
            f"weights and gradients (2 x {sum(parameter_bytes) / 1e9:.3g} GB): nothing left for activations")
    activations = max(activations - max(working_bytes, default=0.0), 0.0)
    total = sum(weights)
    if total <= 0:
        n = sum(1 for inp in is_input if not inp) or 1
        return [0.0 if inp else activations / n / batch_size for inp in is_input], "step"
    return [activations * w / total / batch_size for w in weights], "step"


def stage_working_bytes(working_per_sample: Sequence[float], first: int, end: int, slice_samples: int) -> float:
    """Backward working memory of a stage of layers [first, end): one slice of its largest layer's
    per-sample working bytes (one backward at a time)."""
    return slice_samples * max(working_per_sample[first:end], default=0.0)


LOWER_BOUND_NOTE = ("the profile has no memory figures (no measured kept bytes or step memory, no --profile_memory): "
                    "activation memory counts only each layer's output bytes, so the planner's memory figures "
                    "are a lower bound")

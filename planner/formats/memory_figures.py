"""A profile's memory figures and the per-layer kept bytes derived from them.

Kept bytes are what a layer keeps alive from its forward until its backward (its inputs, attention
scores, LSTM gates, pre-activations, dropout masks, ...); a profile's `activation_bytes` are only
what a layer outputs, a lower bound of that. The planner's memory model
(planner/planning/memory_model.py) counts them per in-flight micro-batch slice.

Where the kept bytes come from, per sample (`kept_bytes_per_sample`):
1. The profile's step memory (`LayerCostProfile.step_peak_bytes`, measured by the profiler, or the
   `profile_memory` input for PipeDream files, e.g. the paper's Table 1 figure: BERT-48 11.4 GB at
   2): one training step at the profile batch size b peaks holding the weights, the gradients
   produced so far and what the forward keeps for backward (optimizer state is not part of one
   forward/backward step; a step figure not above 2 x parameters is an error). The kept bytes are
   in proportion to the layers' measured kept bytes (`backward_kept_bytes`) when the profile has
   them, else to their output bytes, scaled to the step figure: for the profiler's own step peak,
   in time (`step_activation_scale`, below); for a figure from outside, whose step's timeline is
   unknown, A = step - 2 x parameters - the largest working bytes is spread (all alive at once,
   a lower bound of the activations); per sample they are divided by b.
2. Measured kept bytes without a step figure: used as they are.
3. Neither: the output bytes (a lower bound; `lower_bound` is True and the planner says so).
The profiler's step figure is read in time (`step_activation_scale`): a step peaks during some
layer i's backward, holding the weights, the gradients of layers i..n-1, the kept bytes of layers
0..i and layer i's working bytes; the kept bytes are scaled so that the largest of these is the
step figure. Input nodes (PipeDream's `Input*`) keep nothing: they are not layers
(planner/formats/profile.py).

Sizes are written like `11.4GB` (`parse_size`); a PipeDream text profile, which has no place for
its step memory, keeps it in the side file `<profile>.memory` (`side_file_memory`).
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
                          working_bytes: Sequence[float] = (), measured_step: bool = False) -> Tuple[List[float], str]:
    """(per-layer kept bytes per sample, source) with source one of "step", "measured", "lower_bound".

    `output_bytes`, `measured_kept` and `working_bytes` (backward working memory) are for the whole
    profile batch (0 / empty when not measured); `step_bytes` is the step memory at the profile batch
    size, or None. `measured_step`: `step_bytes` is the profiler's peak of a forward+backward step
    that fetches every gradient (LayerCostProfile.step_peak_bytes), decomposed in time
    (`step_activation_scale`). A figure from outside (the paper's Table 1, `profile_memory`) says
    nothing of when its step peaks: A = step - 2 x parameters - the largest working bytes (every
    term alive at once, a bound) is spread. At least 0: a step peak below one layer's backward
    leaves nothing to spread."""
    has_measured = any(v > 0 for v in measured_kept)
    weights = [0.0 if inp else float(k if has_measured else o)
               for o, k, inp in zip(output_bytes, measured_kept, is_input)]
    if step_bytes is None or step_bytes <= 0:
        source = "measured" if has_measured else "lower_bound"
        return [w / batch_size for w in weights], source
    state = 2.0 * sum(parameter_bytes)
    if step_bytes - state <= 0:
        raise MemoryInputError(
            f"{model_name}: step memory {step_bytes / 1e9:.3g} GB at batch {batch_size} is not more than its "
            f"weights and gradients (2 x {sum(parameter_bytes) / 1e9:.3g} GB): nothing left for activations")
    if sum(weights) <= 0:
        weights = [0.0 if inp else 1.0 for inp in is_input]
    if measured_step:
        scale = step_activation_scale(weights, parameter_bytes, step_bytes, working_bytes)
    else:
        scale = max(step_bytes - state - max(working_bytes, default=0.0), 0.0) / sum(weights)
    return [scale * w / batch_size for w in weights], "step"


def step_activation_scale(weights: Sequence[float], parameter_bytes: Sequence[float], step_bytes: float,
                          working_bytes: Sequence[float] = ()) -> float:
    """The c with which c x `weights` are the kept bytes of a step peaking at `step_bytes` (>= 0).

    A step runs its layers' backwards last to first. While layer i's backward runs, the device holds
    the weights (P), the gradients of layers i..n-1 (G_i), the kept bytes of layers 0..i (the later
    ones are freed: c x K_i) and layer i's working bytes (W_i). The step's peak is the largest of
    these, so c is the largest scale with P + G_i + c K_i + W_i <= step for every i. (Taking every
    gradient, every kept byte and the largest working bytes as alive at once undercounts: a VGG-19
    step peaks in its first layers' backward, when the conv layers' activations of the later layers
    are freed and almost every gradient exists; WORKSPACE_NOTES.md, "Planner fidelity" item 1.)"""
    params_total = float(sum(parameter_bytes))
    later_gradients = params_total
    kept = 0.0
    scale = None
    for i, (w, params) in enumerate(zip(weights, parameter_bytes)):
        kept += w
        working = working_bytes[i] if i < len(working_bytes) else 0.0
        if kept > 0:
            c = (step_bytes - params_total - later_gradients - working) / kept
            scale = c if scale is None else min(scale, c)
        later_gradients -= params
    return max(scale or 0.0, 0.0)


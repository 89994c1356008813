"""A warning for random ops (dropout, noise) in stages that split the batch.

A random op in a stage draws once per micro-batch slice: its clones for different micro-batches and
replicas draw different values, as the replicas of data-parallel training do. Training is then the same
in distribution as on one device, not the same numbers; build_pipeline says so (RandomOpsWarning)
instead of leaving a user to find out by comparing runs. Ops are recognized by type: TF's stateful random
kernels and the stateless ones Keras 3 builds its dropout from.
"""

import warnings
from typing import Sequence

RANDOM_OP_TYPES = frozenset({
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal", "RandomShuffle", "Multinomial",
    "RandomGamma", "RandomPoisson", "RandomPoissonV2", "StatelessRandomUniform", "StatelessRandomUniformV2",
    "StatelessRandomNormal", "StatelessRandomNormalV2", "StatelessTruncatedNormal", "StatelessTruncatedNormalV2",
    "StatelessRandomUniformInt", "StatelessRandomUniformIntV2", "StatelessRandomUniformFullInt",
    "StatelessRandomUniformFullIntV2", "StatelessMultinomial", "StatelessRandomBinomial",
})


class RandomOpsWarning(UserWarning):
    """Random ops draw per micro-batch slice: training equals one device in distribution, not in numbers."""


def warn_per_slice(stages: Sequence, layout) -> None:
    """Warns naming the random ops of stages (template.StageTemplate) whose batch is split (M > 1 or replicas);
    `layout`: the build's layout.PipelineLayout."""
    split = [layout.num_micro_batches > 1 or stage.replication > 1 for stage in layout.stages]
    named = [op.name for st, s in zip(stages, split) if s for op in st.ops if op.type in RANDOM_OP_TYPES]
    if not named:
        return
    shown = ", ".join(named[:5]) + (f" and {len(named) - 5} more" if len(named) > 5 else "")
    warnings.warn(
        f"random ops ({shown}) draw their values for each micro-batch slice separately (as data-parallel replicas "
        "do): training matches a single device in distribution, not number for number",
        RandomOpsWarning, stacklevel=3)

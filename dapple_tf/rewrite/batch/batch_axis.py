"""Which axis of a tensor crossing a stage boundary carries the batch: where micro-batches are split and joined.

The model's inputs are batch-leading, but what a model computes from them need not be: time-major sequence code
(TF1 Transformer-XL / XLNet, GNMT's `dynamic_rnn(time_major=True)`) transposes its inputs and keeps activations as
`[len, batch, d]`, and its masks as `[q, k, batch, 1]`. Between stages of different replication a boundary tensor is
cut into (and glued from) ranges of samples along its batch axis, and gradients come back the same way.

`find` decides the axis from what the ops compute (normalization.SampleAxes: the axis that indexes the samples,
followed through transposes, reshapes, broadcasts, einsums, ...), with the template's static shapes as the check:
the template is traced with an unknown batch size, so the batch axis has no static size there.
- One proven sample axis, of unknown size: that axis.
- Not proven (the output of a while loop, an op the analysis does not follow): axis 0 where its size is unknown (the
  rule before time-major models), else the one axis of unknown size; the stage builder then checks, when the step
  runs, that its size is the slice's sample count.
- Refused, naming the tensor: no axis follows the batch while the tensor depends on it (a statistic over the batch,
  a hard-coded batch size), or two axes do (an in-batch similarity matrix `[batch, batch]`, or two axes of unknown
  size where nothing is proven).
"""

import tensorflow as tf

from dapple_tf.errors import DappleError
from dapple_tf.rewrite.batch import normalization


def _statistic(t: tf.Tensor, producer: int, consumer: int) -> DappleError:
    return DappleError(
        f"{t.name} (shape {t.shape}) crosses from stage {producer} to stage {consumer} and depends on the batch, but "
        "its first dimension is not the batch, nor is any other (a statistic over the batch, or a hard-coded batch "
        "size); micro-batches cannot be split there: move the stage boundary")


def _ambiguous(t: tf.Tensor, axes, producer: int, consumer: int, why: str) -> DappleError:
    first, second = sorted(axes)[:2]
    return DappleError(
        f"{t.name} (shape {t.shape}) crosses from stage {producer} to stage {consumer}, and {why} axes {first} and "
        f"{second} both follow the batch: micro-batches cannot be split there unambiguously. Move the stage boundary, "
        f"or give the tensor a static size on every axis but its batch axis before the boundary "
        f"(tf.ensure_shape or set_shape)")


def find(t: tf.Tensor, sample_axes: normalization.SampleAxes, producer: int, consumer: int) -> int:
    """The batch axis of `t` (computed from the inputs by stage `producer`, read by stage `consumer`): see the module
    docstring. Axis 0 when `t`'s rank is unknown (checked when the step runs)."""
    rank = t.shape.rank
    if rank is None:
        return 0
    if rank == 0:
        raise _statistic(t, producer, consumer)
    dims = t.shape.as_list()
    unknown = [a for a, size in enumerate(dims) if size is None]
    proven = sample_axes.of(t)
    if proven is not None:
        if len(proven) > 1:
            raise _ambiguous(t, proven, producer, consumer, "by what the operations compute,")
        if not proven or dims[next(iter(proven))] is not None:
            raise _statistic(t, producer, consumer)
        return next(iter(proven))
    if not unknown:
        raise _statistic(t, producer, consumer)
    if 0 in unknown or len(unknown) == 1:
        return unknown[0]
    raise _ambiguous(t, unknown, producer, consumer, "nothing proves which axis holds the samples, and")

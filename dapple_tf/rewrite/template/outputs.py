"""Extra outputs of a model: `model_fn` may return `(loss, {"name": tensor, ...})`.

Each extra tensor is computed by the clones of the stage that computes it and combined over the
micro-batches and replicas into one global-batch value:
- BATCH: a tensor with a batch axis (logits, predictions; time-major ones [len, batch, ...] too:
  batch_axis.py): the clones' rows, concatenated in sample order along it;
- MEAN: a floating-point scalar that is a mean over the samples (accuracy, a loss term): the clones'
  values weighted by their slice's share of the global batch;
- FIXED: a tensor that does not depend on the inputs (a weight norm, a learning rate): fetched as it is;
- INPUT: one of the (global-batch) inputs itself;
- FIRST: a batch-leading tensor of which the first micro-batch's rows are enough (what image and histogram
  summaries show: summaries.py).
Anything else (a batch statistic that is not a scalar mean) is refused at build time.
"""

import dataclasses
from typing import Dict, List, Mapping, Sequence, Tuple

import tensorflow as tf

from dapple_tf.rewrite.batch import microbatch
from dapple_tf.errors import DappleError

BATCH, MEAN, FIXED, INPUT, FIRST = "batch", "mean", "fixed", "input", "first"


@dataclasses.dataclass
class ExtraOutput:
    name: str
    tensor: tf.Tensor  # in the template
    kind: str
    stage: int = -1  # BATCH/MEAN: the stage whose clones compute it
    axis: int = 0  # BATCH/FIRST: the batch axis


def split_model_result(result) -> Tuple[tf.Tensor, Dict[str, tf.Tensor]]:
    """(loss, extra outputs by name) from what model_fn returned: a loss or (loss, {name: tensor})."""
    if not isinstance(result, (tuple, list)):
        return result, {}
    if len(result) != 2 or not isinstance(result[1], Mapping):
        kinds = ", ".join("Tensor" if tf.is_tensor(r) else type(r).__name__ for r in result)
        raise DappleError(
            f"model_fn returned a {type(result).__name__} of ({kinds}); it must return the scalar loss, or "
            '(loss, {"name": tensor, ...}) to also fetch extra outputs, e.g. (loss, {"logits": logits})'
        )
    loss, extras = result
    checked = {}
    for name, value in extras.items():
        if not isinstance(name, str) or not name:
            raise DappleError(f"extra output names must be non-empty strings, got {name!r}")
        try:
            checked[name] = tf.convert_to_tensor(value)
        except (TypeError, ValueError) as e:
            raise DappleError(f"extra output {name!r} is not a tensor: {type(value).__name__} ({e})") from None
    return loss, checked


def classify(name: str, tensor: tf.Tensor, input_names, batch_dependent, batch_axis_of=None) -> ExtraOutput:
    """The kind of an extra output, from its template tensor; raises for one that cannot be combined.
    batch_axis_of(tensor): the batch axis of a tensor whose first dimension has a static size (None: refused)."""
    if tensor.name in input_names:
        return ExtraOutput(name, tensor, INPUT)
    if tensor.op not in batch_dependent:
        return ExtraOutput(name, tensor, FIXED)
    rank = tensor.shape.rank
    if rank == 0:
        if not tensor.dtype.is_floating:
            raise DappleError(
                f"extra output {name!r} ({tensor.name}) is a {tensor.dtype.name} scalar computed from the batch; a "
                "scalar output must be a floating-point mean over the samples (cast it before the mean)"
            )
        return ExtraOutput(name, tensor, MEAN)
    if rank is not None and tf.compat.dimension_value(tensor.shape[0]) is None:
        return ExtraOutput(name, tensor, BATCH)
    if rank and batch_axis_of is not None:
        try:
            return ExtraOutput(name, tensor, BATCH, axis=batch_axis_of(tensor))
        except DappleError:
            pass
    raise DappleError(
        f"extra output {name!r} ({tensor.name}) has shape {tensor.shape}: an output computed from the batch must have "
        "the batch as its leading dimension (concatenated over micro-batches) or be a scalar mean over the samples "
        "(averaged); reduce it to one of those"
    )


def check_clone_rows(extra: ExtraOutput, clone_tensor: tf.Tensor, rows: int) -> None:
    if clone_tensor.shape.rank and tf.compat.dimension_value(clone_tensor.shape[extra.axis]) not in (None, rows):
        raise DappleError(
            f"extra output {extra.name!r} ({extra.tensor.name}) has {clone_tensor.shape[extra.axis]} rows for a slice "
            f"of {rows} samples: its dimension {extra.axis} is not the batch"
        )


def clone_keys(extra: ExtraOutput, num_micro_batches: int, replicas: int) -> List[Tuple[int, int]]:
    """The (micro-batch, replica) clones whose values `combine` reads for `extra`, in the order it reads them."""
    if extra.kind in (FIXED, INPUT):
        return []
    micro_batches = 1 if extra.kind == FIRST else num_micro_batches
    return [(m, j) for m in range(micro_batches) for j in range(replicas)]


def combine(
    extra: ExtraOutput,
    per_clone: Mapping[Tuple[int, int], tf.Tensor],
    sizes: Sequence[int],
    num_micro_batches: int,
    devices: Sequence[str],
    inputs: Mapping[str, tf.Tensor],
) -> tf.Tensor:
    """The global-batch value of `extra` from its clones' values, keyed (micro-batch, replica)."""
    if extra.kind == FIXED:
        return extra.tensor
    if extra.kind == INPUT:
        return inputs[extra.tensor.name]
    global_batch = sum(sizes) * num_micro_batches
    order = clone_keys(extra, num_micro_batches, len(sizes))
    with tf.device(devices[0]), tf.name_scope("dapple/outputs"):
        if extra.kind in (BATCH, FIRST):
            for m, j in order:
                check_clone_rows(extra, per_clone[(m, j)], sizes[j])
            return microbatch.concat_rows([per_clone[key] for key in order], extra.axis)
        dtype = extra.tensor.dtype
        return tf.add_n([per_clone[(m, j)] * tf.constant(sizes[j] / global_batch, dtype) for m, j in order])

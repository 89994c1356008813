"""Micro-batches and slices: how the global batch is cut, and moving slices between stages.

The global batch of N samples is cut into M micro-batches of N / M samples; a stage replicated
on r devices cuts each micro-batch into r contiguous slices whose sizes differ by at most one.
`gather_rows` builds one destination slice from another stage's slices (1:N, N:1, N:M,
uneven): the concatenation of the overlapping parts of the source slices, on the destination's
device. Gradients travel back the same way, cut by the program's `gradient_pieces`. Rows are taken along the tensor's batch
axis (`axis`: batch_axis.py), 0 but for time-major tensors. The sizes, offsets and overlaps are the pipeline
program's (planner/formats/program.py): the numbers `dapple_plan --explain` prints.
"""

from typing import Sequence, Tuple

import tensorflow as tf

from dapple_tf.errors import PlanError
from planner.formats.program import offsets


def micro_batch_size(global_batch_size: int, num_micro_batches: int, replications: Sequence[int]) -> int:
    """N / M, after checking that M divides N and every replica slice is non-empty."""
    if global_batch_size % num_micro_batches:
        divisors = [m for m in range(1, global_batch_size + 1) if global_batch_size % m == 0]
        raise PlanError(
            f"the global batch size {global_batch_size} is not divisible by {num_micro_batches} micro-batches; "
            f"valid micro-batch counts: {divisors}"
        )
    size = global_batch_size // num_micro_batches
    for stage, r in enumerate(replications):
        if r > size:
            raise PlanError(
                f"stage {stage} is replicated on {r} devices but a micro-batch has only {size} samples "
                f"(global batch {global_batch_size} / {num_micro_batches} micro-batches): some replicas would get an "
                "empty slice; use fewer micro-batches or fewer replicas"
            )
    return size


def rows(tensor: tf.Tensor, first: int, end: int, axis: int = 0) -> tf.Tensor:
    """Rows [first, end) of `tensor` along `axis`."""
    return tensor[(slice(None),) * axis + (slice(first, end),)]


def gather_rows(
    tensors: Sequence[tf.Tensor], src_sizes: Sequence[int], start: int, size: int, axis: int = 0
) -> Tuple[tf.Tensor, ...]:
    """Rows [start, start + size) of the row blocks `tensors` (of sizes `src_sizes`, along `axis`), as pieces.

    With the consumer's device scope active this is the consumer's side of a split/concat:
    whole blocks pass through, partial blocks are sliced. Concatenate the pieces along `axis`.
    """
    end, pieces = start + size, []
    for tensor, s_start, s_size in zip(tensors, offsets(src_sizes), src_sizes):
        lo, hi = max(start, s_start), min(end, s_start + s_size)
        if lo >= hi:
            continue
        pieces.append(tensor if (lo, hi) == (s_start, s_start + s_size) else rows(tensor, lo - s_start, hi - s_start,
                                                                                   axis))
    return tuple(pieces)


def concat_rows(pieces: Sequence[tf.Tensor], axis: int = 0) -> tf.Tensor:
    return pieces[0] if len(pieces) == 1 else tf.concat(list(pieces), axis=axis)

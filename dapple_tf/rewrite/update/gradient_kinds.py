"""Which variables get gradients of gathered rows (IndexedSlices) from every stage that reads them, told from the
template's operations.

One graph sees every clone's gradient and sums a variable as gathered rows only where every device's gradient was
(gradients.GradientAccumulator). A per-host graph sees its own devices' alone, and every task must take the same
decision: a table gathered in one task's stage and multiplied whole in another's (tied input and output embeddings)
is summed dense by both. tf.gradients gives a resource variable gathered rows when each of its uses in the stage is
a row lookup, directly (ResourceGather) or of its value (Gather of a ReadVariableOp or Identity of it); uses that
carry no gradient (its shape, a summary: nothing the stage outputs depends on them) do not count. The task's own
stages are checked against what their clones got.
"""

from typing import Sequence, Set

import tensorflow as tf

from dapple_tf.rewrite.graphs import graph_walk

_GATHERS = {"ResourceGather", "Gather", "GatherV2"}
_PASS_THROUGH = {"ReadVariableOp", "Identity"}
_NO_GRADIENT = {"Shape", "ShapeN", "Size", "Rank", "VariableShape", "VarIsInitializedOp", "StopGradient"}


def gathered_rows_only(tensor: tf.Tensor, ops: Set[tf.Operation]) -> bool:
    """Whether tf.gradients gives `tensor` (a variable's handle, or its value) gathered rows from its uses among
    `ops` (the operations of a stage that its differentiable outputs or its loss depend on)."""
    for op in tensor.consumers():
        if op not in ops or op.type in _NO_GRADIENT:
            continue
        if op.type in _GATHERS and op.inputs[0] is tensor:
            continue
        if op.type in _PASS_THROUGH and gathered_rows_only(op.outputs[0], ops):
            continue
        return False
    return True


def carrying_gradients(targets: Sequence[tf.Operation], ops: Set[tf.Operation]) -> Set[tf.Operation]:
    """The operations among `ops` whose outputs `targets` (a stage's differentiable outputs and loss) take gradients
    from: reached through float (and resource) inputs, not through an operation that passes none back."""
    return graph_walk.ancestors_within(targets, ops, control=False, through=lambda op, t: op.type not in _NO_GRADIENT
                                       and (t.dtype.is_floating or t.dtype == tf.resource))

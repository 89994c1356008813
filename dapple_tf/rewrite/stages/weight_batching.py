"""Weight gradients of all micro-batches as one operation (schedule "dapple-batched-w").

A dense layer's weight gradient is x^T dy, a matrix product that sums over the rows of the micro-batch;
the M micro-batches' gradients, added up in a running sum, equal one product over their rows stacked:
concat(x_1..x_M)^T concat(dy_1..dy_M). The one product is cheaper than M products of M-times-thinner
matrices plus M - 1 additions of the whole weight (one CPU core, 1024 x 1024 layer, M = 8 slices of 128
rows: 1.17-1.44x the time of the whole batch's product with the running sum, 1.06-1.12x stacked;
scripts/bench/runtime/weight_products.py).

`batch_weight_gradients` does this where every micro-batch's gradient of a (variable, device) is such a
product (`MatMul` contracting the first dimension of both inputs), used only by the running sum, made in
the backward tasks of one stage replica: the per-micro-batch products and the additions leave their
tasks (nothing fetches or waits for them, so they never run), and the stacked product becomes the
stage's W task of the last micro-batch, which the schedule runs after every backward of the stage. Each
backward task keeps everything else: the input gradients (first, tasks.input_gradients_first) and the
weight gradients that cannot be stacked (biases, convolutions, embeddings, weights several layers
share). Until the W each micro-batch keeps its x and dy.
"""

from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from dapple_tf.rewrite.update.gradients import GradientAccumulator, Key
from dapple_tf.rewrite.stages.tasks import TaskKey, TaskOps
from planner.formats.schedule import BACKWARD, WEIGHT, Task


def _stackable(grad: tf.Tensor) -> bool:
    """True for a matrix product that sums over the rows of both its inputs (x^T dy)."""
    op = grad.op
    return op.type == "MatMul" and op.get_attr("transpose_a") and not op.get_attr("transpose_b")


def _backward_task_of(task_ops: TaskOps) -> Dict[tf.Operation, TaskKey]:
    return {op: key for key, ops in task_ops.ops.items() if key[0].kind == BACKWARD for op in ops}


def _batchable(key: Key, accumulator: GradientAccumulator, task_of: Dict[tf.Operation, TaskKey]) -> Optional[List[TaskKey]]:
    """The backward tasks of `key`'s per-micro-batch products, if they can be stacked into one; else None."""
    parts, sum_ops = accumulator.parts.get(key), accumulator.sum_ops.get(key, [])
    if not parts or len(parts) < 2 or not all(_stackable(g) for g in parts):
        return None
    summing = set(sum_ops)
    if any(set(g.consumers()) - summing or g.op._control_outputs for g in parts):  # pylint: disable=protected-access
        return None
    # each partial sum feeds only the next addition (the last one: whatever uses the total, which is replaced)
    if any(set(op.outputs[0].consumers()) != {nxt} or op._control_outputs  # pylint: disable=protected-access
           for op, nxt in zip(sum_ops, sum_ops[1:])):
        return None
    tasks = [task_of.get(g.op) for g in parts]
    if any(t is None for t in tasks) or len({(t[0].stage, t[1]) for t in tasks}) != 1 or len(set(tasks)) != len(tasks):
        return None
    return tasks


def batch_weight_gradients(task_ops: TaskOps, accumulator: GradientAccumulator) -> Tuple[Key, ...]:
    """Replaces each batchable running sum of weight gradients by one stacked product (module docstring);
    returns the keys it replaced, in the order their gradients were made."""
    task_of = _backward_task_of(task_ops)
    position = {op: i for i, op in enumerate(task_ops.graph.get_operations())}
    replaced = []
    for key in sorted(accumulator.parts, key=lambda k: position[accumulator.last_gradient[k].op]):
        tasks = _batchable(key, accumulator, task_of)
        if tasks is None:
            continue
        parts, sum_ops = accumulator.parts[key], accumulator.sum_ops[key]
        last, replica = max(tasks, key=lambda t: t[0].micro_batch)
        dropped = {g.op for g in parts} | set(sum_ops)
        for task in set(tasks):
            task_ops.ops[task] = [op for op in task_ops.ops[task] if op not in dropped]
        variable, device = key
        with task_ops.capture(Task(last.stage, WEIGHT, last.micro_batch), replica), tf.device(device), tf.control_dependencies(None), \
                tf.name_scope(f"batched_weight_gradient/{variable.op.name}"):
            rows = tf.concat([g.op.inputs[0] for g in parts], axis=0)
            gradients = tf.concat([g.op.inputs[1] for g in parts], axis=0)
            total = tf.matmul(rows, gradients, transpose_a=True)
        accumulator.replace_sum(key, total)
        replaced.append(key)
    return tuple(replaced)

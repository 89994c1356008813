"""The template's placement, made one TensorFlow can honour where a TensorArray spans two stages' layers.

The template's operations are placed by their layers' stages (pipeline._LayerPlacer) while model_fn runs, and they
stay in the graph the session places. TF1 `dynamic_rnn` (control flow v1) writes its input into a TensorArray with
a scatter colocated with that input, and reads it in its loop: when the input comes from an earlier stage's layer
(a decoder fed the embeddings of the stage before), the TensorArray's writer and readers get two devices, though
every op using one TensorArray must be on one device, and so must the gradient ops colocated with them (the
script's own `tf.gradients(..., colocate_gradients_with_ops=True)`). The session then refuses the graph ("Cannot
colocate nodes ... incompatible ids").

`unify` finds such groups (ops joined by edges of a TensorArray's or stack's handle, and by colocation with one
another) and moves every op of a group to the device most of them have. Only template ops move, and nothing runs
them: each stage's clones are imported with their devices cleared (graph_defs.py). Variables and what is colocated
with them are never moved.
"""

import collections
from typing import Dict, Sequence

import tensorflow as tf

_VARIABLE_OPS = ("VarHandleOp", "VariableV2", "Variable")


def _colocated(op: tf.Operation):
    """The names of the ops `op` is colocated with (its `_class` attribute), itself left out."""
    return [g.decode()[len("loc:@"):] for g in op.colocation_groups() if g.decode()[len("loc:@"):] != op.name]


def unify(ops: Sequence[tf.Operation]) -> int:
    """Gives each group of `ops` that must share a device (see the module docstring) one device; returns how many
    ops moved."""
    by_name = {op.name: op for op in ops}
    parent: Dict[tf.Operation, tf.Operation] = {op: op for op in ops}

    def root(op):
        while parent[op] is not op:
            parent[op] = parent[parent[op]]
            op = parent[op]
        return op

    def variable_side(op):
        return op.type in _VARIABLE_OPS or any(by_name.get(n) is not None and by_name[n].type in _VARIABLE_OPS
                                               for n in _colocated(op))

    resources = set()
    for op in ops:
        if variable_side(op):
            continue
        for t in op.inputs:
            if t.dtype == tf.resource and t.op in parent and not variable_side(t.op):
                parent[root(op)] = root(t.op)
                resources.add(t.op)
        for name in _colocated(op):
            other = by_name.get(name)
            if other is not None and not variable_side(other):
                parent[root(op)] = root(other)
    groups = collections.defaultdict(list)
    for op in ops:
        groups[root(op)].append(op)
    moved = 0
    for members in groups.values():
        devices = collections.Counter(op.device for op in members if op.device)
        if len(devices) < 2 or not any(op in resources for op in members):
            continue
        device = devices.most_common(1)[0][0]
        for op in members:
            if op.device != device:
                op._set_device(device)  # pylint: disable=protected-access
                moved += 1
    return moved

"""Walking a graph: whether an op depends on any of some ops; the ops some ops depend on (all, within a set, or in
creation order); the ops reachable from some ops."""

from typing import Callable, Collection, List, Optional, Sequence, Set

import tensorflow as tf


def depends_on_any(op: tf.Operation, targets: Collection[tf.Operation]) -> bool:
    """True if `op` is one of `targets` or depends on one of them (data inputs and control inputs)."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        if current in targets:
            return True
        if current in seen:
            continue
        seen.add(current)
        stack.extend(t.op for t in current.inputs)
        stack.extend(current.control_inputs)
    return False


def ancestors_within(ops: Sequence[tf.Operation], within: Collection[tf.Operation], control: bool = True,
                     through: Optional[Callable[[tf.Operation, tf.Tensor], bool]] = None) -> Set[tf.Operation]:
    """`ops` and every operation of `within` they depend on (data inputs, and control inputs unless `control` is
    False), walking only through `within`, and only along the data inputs `through(op, input)` accepts if given."""
    found, stack = set(), [op for op in ops if op in within]
    while stack:
        op = stack.pop()
        if op in found:
            continue
        found.add(op)
        stack.extend(t.op for t in op.inputs if t.op in within and (through is None or through(op, t)))
        if control:
            stack.extend(c for c in op.control_inputs if c in within)
    return found


def descendants(starts: Sequence[tf.Operation], stop_types: Collection[str] = (), control: bool = False
                ) -> Set[tf.Operation]:
    """`starts` and every op reachable from them through data edges (and control edges if `control`: a value read
    after an assign under a control dependency, as a metric's update gives it, depends on what the assign wrote),
    not entering ops of `stop_types`."""
    control_outputs = {}
    if control and starts:
        for op in starts[0].graph.get_operations():
            for c in op.control_inputs:
                control_outputs.setdefault(c, []).append(op)
    seen, stack = set(), list(starts)
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend(c for out in op.outputs for c in out.consumers() if c.type not in stop_types)
        stack.extend(c for c in control_outputs.get(op, ()) if c.type not in stop_types)
    return seen


def ancestors(op: tf.Operation) -> Set[tf.Operation]:
    """`op` and every op it depends on (data and control inputs)."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        stack.extend(t.op for t in current.inputs)
        stack.extend(current.control_inputs)
    return seen


def ancestors_in_order(ops: Sequence[tf.Operation], keep) -> List[tf.Operation]:
    """The ops `ops` compute from through data edges (not `ops` themselves), walking only through ops for which
    `keep(op)` holds, in creation order (a topological order)."""
    seen, stack = set(), [t.op for op in ops for t in op.inputs]
    while stack:
        op = stack.pop()
        if op in seen or not keep(op):
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
    return sorted(seen, key=lambda o: o._id)  # pylint: disable=protected-access

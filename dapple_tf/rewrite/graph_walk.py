"""Walking a graph upstream: whether an op depends on any of some ops; the ops some ops depend on within a set."""

from typing import Collection, Sequence, Set

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


def ancestors_within(ops: Sequence[tf.Operation], within: Collection[tf.Operation], control: bool = True) -> Set[tf.Operation]:
    """`ops` and every operation of `within` they depend on (data inputs, and control inputs unless `control` is
    False), walking only through `within`."""
    found, stack = set(), [op for op in ops if op in within]
    while stack:
        op = stack.pop()
        if op in found:
            continue
        found.add(op)
        stack.extend(t.op for t in op.inputs if t.op in within)
        if control:
            stack.extend(c for c in op.control_inputs if c in within)
    return found

"""Walking a graph upstream: whether an op depends on any of some ops, through data or control edges."""

from typing import Collection

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

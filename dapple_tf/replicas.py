"""Variable copies: one copy of each variable on every device whose stage replica reads it.

The user's variable is the copy on its own device (the stage's first device, where the template
placed it); the other devices get local copies. Copies (and their optimizer slots) live in
LOCAL_VARIABLES, so checkpoints hold exactly the single-device model's variables. Every copy
applies the same all-reduced gradient; `broadcast_op` sets copies (and slots) from the user's
variables after initialization or a restore.
"""

from typing import Dict, List, Tuple

import tensorflow as tf

_GLOBAL = tf.compat.v1.GraphKeys.GLOBAL_VARIABLES
_LOCAL = tf.compat.v1.GraphKeys.LOCAL_VARIABLES


def canonical_device(device: str) -> str:
    """A device string in one spelling: "/device:CPU:0" for "/cpu:0" and for
    "/job:localhost/replica:0/task:0/device:CPU:0"; another job's device gets its full name
    ("/job:worker/replica:0/task:1/device:CPU:0" for "/job:worker/task:1/cpu:0"), as TF lists it."""
    spec = tf.DeviceSpec.from_string(device)
    if spec.job == "localhost" and spec.replica in (None, 0) and spec.task in (None, 0):
        spec = spec.replace(job=None, replica=None, task=None)
    elif spec.job is not None:
        spec = spec.replace(replica=spec.replica or 0, task=spec.task or 0)
    return spec.to_string()


class VariableCopies:
    """Per variable, the copy on each device that reads it."""

    def __init__(self):
        self._copies: Dict[tf.Variable, Dict[str, tf.Variable]] = {}

    def handle_for(self, variable: tf.Variable, device: str) -> tf.Tensor:
        """The resource handle of `variable`'s copy on `device`, created on first use."""
        copies = self._copies.setdefault(variable, {})
        if not copies:
            # The user's variable, under its own device ("" if unplaced: then every reader gets a copy).
            copies[canonical_device(variable.device) if variable.device else ""] = variable
        if device not in copies:
            with tf.device(device), tf.control_dependencies(None):
                copies[device] = tf.compat.v1.Variable(
                    tf.zeros(variable.shape, variable.dtype.base_dtype),
                    trainable=False,
                    collections=[_LOCAL],
                    name=f"{variable.op.name}/dapple_copy",
                    use_resource=True,
                )
        return copies[device].handle

    def copies_of(self, variable: tf.Variable) -> Dict[str, tf.Variable]:
        """Device -> copy (the user's variable included, under its own device, "" if unplaced)."""
        return dict(self._copies.get(variable, {}))

    def extra_copies(self) -> List[Tuple[tf.Variable, tf.Variable]]:
        """(user's variable, copy) for every copy that is not the user's variable."""
        return [(v, c) for v, copies in self._copies.items() for c in copies.values() if c is not v]

    def localize_slots(self, optimizer) -> List[Tuple[tf.Variable, tf.Variable]]:
        """Moves the optimizer slots of copies into LOCAL_VARIABLES; returns (user slot, copy slot)."""
        pairs = []
        graph = tf.compat.v1.get_default_graph()
        global_vars = graph.get_collection_ref(_GLOBAL)
        for variable, copy in self.extra_copies():
            for name in optimizer.get_slot_names():
                user_slot, copy_slot = optimizer.get_slot(variable, name), optimizer.get_slot(copy, name)
                if copy_slot is None:
                    continue
                if copy_slot in global_vars:
                    global_vars.remove(copy_slot)
                    graph.add_to_collection(_LOCAL, copy_slot)
                if user_slot is not None:
                    pairs.append((user_slot, copy_slot))
        return pairs

    def broadcast_op(self, slot_pairs=()) -> tf.Operation:
        """Assigns every copy (and copy slot) the value of its user variable."""
        assigns = []
        for source, target in self.extra_copies() + list(slot_pairs):
            with tf.device(target.device):
                assigns.append(target.assign(source.read_value()).op)
        return tf.group(*assigns, name="dapple_broadcast_variables")

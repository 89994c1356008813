"""Variable copies: one copy of each variable on every device whose stage replica reads it.

The user's variable is the copy on its own device (the stage's first device, where the template
placed it); the other devices get local copies. Copies (and their optimizer slots) live in
LOCAL_VARIABLES (apply_step.py moves the copies' optimizer slots there), so checkpoints hold exactly the
single-device model's variables. Every copy applies the same all-reduced gradient; `broadcast_op` sets copies
(and slots) from the user's variables after initialization or a restore; `stale_copy_check` catches a restore
that skipped it.
"""

import dataclasses
from typing import Dict, List, Tuple

import tensorflow as tf

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
                    constraint=variable.constraint,  # the optimizer applies it to the copy as to the variable
                )
        return copies[device].handle

    def copies_of(self, variable: tf.Variable) -> Dict[str, tf.Variable]:
        """Device -> copy (the user's variable included, under its own device, "" if unplaced)."""
        return dict(self._copies.get(variable, {}))

    def extra_copies(self) -> List[Tuple[tf.Variable, tf.Variable]]:
        """(user's variable, copy) for every copy that is not the user's variable."""
        return [(v, c) for v, copies in self._copies.items() for c in copies.values() if c is not v]

    def broadcast_op(self, slot_pairs=()) -> tf.Operation:
        """Assigns every copy (and copy slot) the value of its user variable."""
        assigns = []
        for source, target in self.extra_copies() + list(slot_pairs):
            with tf.device(target.device):
                assigns.append(target.assign(source.read_value()).op)
        return tf.group(*assigns, name="dapple_broadcast_variables")

    def stale_copy_check(self) -> "StaleCopyCheck":
        """Ops for the first step after local initialization: fail unless every copy equals its
        user's variable (a checkpoint restored, or a variable assigned, without the broadcast).

        Per pair of devices (the variables', the copies') and dtype, a local flag on the copies' device (reset by
        local init, so by `local_init_op`) makes later steps skip the comparison. Each side's conditional reads
        only its own device's variables (a conditional's captured handles cross devices in every step, taken or
        not): the variables' side sends their values flattened into one tensor (empty once checked), the
        copies' side compares. A skipped check ends on the copies' device without waiting for that tensor.
        """
        groups = _by_device_pair(self.extra_copies())
        if not groups:
            return StaleCopyCheck(tf.no_op(name="dapple_stale_copy_check"), {})
        by_device: Dict[str, List[tf.Operation]] = {}
        for key, group in groups.items():
            by_device.setdefault(key[1], []).append(_checked_pair(*key, group))
        checks = {device: ops[0] if len(ops) == 1 else tf.group(*ops) for device, ops in by_device.items()}
        return StaleCopyCheck(tf.group(*checks.values(), name="dapple_stale_copy_check"), checks)


@dataclasses.dataclass(frozen=True)
class StaleCopyCheck:
    """The stale-copy check: `op` the whole check; `by_device` the comparing on each device holding copies.

    A TF collective op that has started in a step that fails aborts the process's collectives for good ("Restart
    your program to reset"), and the step the check fails in is one to come back from (by local_init_op): TF
    collectives wait for the whole check (`after_all`)."""
    op: tf.Operation
    by_device: Dict[str, tf.Operation]
    _after_all: Dict[str, tf.Operation] = dataclasses.field(default_factory=dict)

    def after_all(self, device: str) -> tf.Operation:
        """An operation on `device` that runs once the whole check has (one per device)."""
        if device not in self._after_all:
            with tf.device(device), tf.control_dependencies(None), tf.control_dependencies([self.op]):
                self._after_all[device] = tf.no_op(name="dapple_after_stale_copy_check")
        return self._after_all[device]

    def hold_collectives(self, operations) -> None:
        """Makes the TF collective ops among `operations` (the clones' synchronized batch norms, built before the
        check) wait for the whole check."""
        if not self.by_device:
            return
        for op in operations:
            if op.type.startswith("Collective"):
                op._add_control_inputs([self.after_all(op.device)])  # pylint: disable=protected-access


def _by_device_pair(pairs: List[Tuple[tf.Variable, tf.Variable]]
                    ) -> Dict[Tuple[str, str, tf.DType], List[Tuple[tf.Variable, tf.Variable]]]:
    """(variable, copy) pairs by (the variable's device, the copy's device, dtype), in their order."""
    groups: Dict[Tuple[str, str, tf.DType], List[Tuple[tf.Variable, tf.Variable]]] = {}
    for variable, copy in pairs:
        groups.setdefault((variable.device, copy.device, variable.dtype.base_dtype), []).append((variable, copy))
    return groups


def _checked_pair(variable_device: str, copy_device: str, dtype: tf.DType,
                  group: List[Tuple[tf.Variable, tf.Variable]]) -> tf.Operation:
    """The stale-copy check of one pair of devices: the variables' values sent while the copies' flag is False,
    compared with the copies on their device, the flag set once all are equal."""
    with tf.device(copy_device), tf.control_dependencies(None):
        checked = tf.compat.v1.Variable(False, trainable=False, collections=[_LOCAL], name="dapple_copies_checked",
                                        use_resource=True)
        done = checked.read_value()
    with tf.device(variable_device):
        values = tf.cond(done, lambda: tf.zeros([0], dtype), lambda: tf.concat(
            [tf.reshape(variable.read_value(), [-1]) for variable, _ in group], 0), name="dapple_stale_copy_values")

    def compare():
        pieces = tf.split(values, [copy.shape.num_elements() for _, copy in group])
        asserts = [tf.debugging.Assert(tf.reduce_all(tf.equal(tf.reshape(copy.read_value(), [-1]), piece)),
                                       [_STALE_MESSAGE.format(name=variable.op.name)])
                   for (variable, copy), piece in zip(group, pieces)]
        with tf.control_dependencies(asserts):
            return checked.assign(True, read_value=True)

    with tf.device(copy_device):
        return tf.cond(done, lambda: tf.constant(True), compare, name="dapple_stale_copy_check").op


_STALE_MESSAGE = (
    "dapple_tf: the pipeline's copy of variable {name} differs from the variable: a checkpoint was restored (or "
    "a variable assigned) without updating the copies, so replicas would train on stale weights; run "
    "sess.run(handle.local_init_op) after Saver.restore or an assignment (MonitoredSession / Scaffold run it)"
)

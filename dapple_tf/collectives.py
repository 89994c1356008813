"""Gradient AllReduce across the devices that hold copies of the same variables.

TF collective ops (`collective_ops.all_reduce`): NCCL on GPUs, ring on CPUs (virtual CPU
devices included). Gradients of one device set and dtype are flattened into one buffer, reduced
once, and cut back into shapes.
"""

import zlib
from typing import Callable, Dict, List, Optional, Sequence

import tensorflow as tf
from tensorflow.python.ops import collective_ops


class CollectiveKeys:
    """Keys for the collectives of one build_pipeline call.

    A group key names a device set (the same set always gets the same key: a CRC of the names);
    instance keys start at the graph's operation count when the build began, so builds in one
    graph never share one (each build adds more operations than it uses instance keys).
    """

    def __init__(self, graph: tf.Graph):
        self._next_instance = len(graph.get_operations()) + 1

    @staticmethod
    def group_key(devices: Sequence[str]) -> int:
        return zlib.crc32(",".join(devices).encode()) & 0x7FFFFFFF or 1

    def instance_key(self) -> int:
        return self.instance_keys(1)

    def instance_keys(self, count: int) -> int:
        """The first of `count` consecutive unused instance keys."""
        self._next_instance += count
        return self._next_instance - count


def communication_hint(devices: Sequence[str]) -> str:
    return "nccl" if all(tf.DeviceSpec.from_string(d).device_type == "GPU" for d in devices) else "auto"


def all_reduce_sum(
    grads_per_device: Dict[str, List[tf.Tensor]], keys: CollectiveKeys, after: Dict[str, tf.Tensor] = None,
    cross_process_reduce: Optional[Callable[[tf.Tensor], tf.Tensor]] = None,
) -> Dict[str, List[tf.Tensor]]:
    """Sums, element-wise across devices, lists of same-shaped tensors; one collective per call.

    `grads_per_device[d][i]` lives on device d; every device gets the list of sums. On device d
    the collective starts after `after[d]` (if given), so every device launches collectives in
    the same order. `cross_process_reduce`, if given, is applied once to the summed buffer (on the
    first device) and its result is what every device gets (hierarchical: in-process, then across).
    """
    after = after or {}
    devices = sorted(grads_per_device)
    if cross_process_reduce is not None:
        return _reduce_across_processes(grads_per_device, keys, after, cross_process_reduce)
    if len(devices) == 1:
        return dict(grads_per_device)
    group_key, instance_key = keys.group_key(devices), keys.instance_key()
    shapes = [g.shape for g in grads_per_device[devices[0]]]
    sizes = [s.num_elements() for s in shapes]
    result = {}
    for device in devices:
        with tf.device(device), tf.control_dependencies([after[device]] if device in after else []):
            flat = tf.concat([tf.reshape(g, [-1]) for g in grads_per_device[device]], axis=0)
            summed = collective_ops.all_reduce(
                flat, len(devices), group_key, instance_key, "Add", "Id", communication_hint=communication_hint(devices)
            )
            result[device] = [tf.reshape(p, s) for p, s in zip(tf.split(summed, sizes), shapes)]
    return result


def _reduce_across_processes(grads_per_device, keys, after, cross_process_reduce):
    devices = sorted(grads_per_device)
    first = devices[0]
    if len(devices) > 1:
        in_process = all_reduce_sum(grads_per_device, keys, after)
    else:
        in_process = dict(grads_per_device)
    shapes = [g.shape for g in in_process[first]]
    with tf.device(first):
        flat = tf.concat([tf.reshape(g, [-1]) for g in in_process[first]], axis=0)
        total = cross_process_reduce(flat)
    result = {}
    for device in devices:
        # Every device's collective must run even though only the first one's sum is read.
        with tf.device(device), tf.control_dependencies([in_process[device][0]]):
            parts = tf.split(tf.identity(total), [s.num_elements() for s in shapes])
            result[device] = [tf.reshape(p, s) for p, s in zip(parts, shapes)]
    return result

"""Scalars summed over the cluster's tasks in one fixed order, the same in one graph and in per-host graphs.

A value held on several devices (a sum of squares for clipping, of a table's gathered rows for a script's norm)
is summed on each task (its devices in order), then over the plan's tasks in order, 0 for a task holding none. In a
per-host graph each task sends its sum to the device that adds them up (one scalar per task and step), so the
additions, and the bits, are those of the one graph.
"""

from typing import Callable, Dict, List, Optional, Sequence

import tensorflow as tf

from dapple_tf.rewrite.hosts import host_part
from dapple_tf.rewrite.update.collectives import ordered_sum  # re-exported: a sum in a fixed order


def first_devices(plan_devices: Sequence[str]) -> Dict[str, str]:
    """Task -> its first device of the plan."""
    out: Dict[str, str] = {}
    for d in sorted(plan_devices):
        out.setdefault(host_part.task_of(d), d)
    return out


def summed_over_tasks(by_device: Dict[str, tf.Tensor], device: str, plan_devices: Sequence[str], host,
                      key: Callable[[str], str], dtype: tf.DType = tf.float32) -> Optional[tf.Tensor]:
    """The sum, in `dtype`, of the scalars `by_device` (device -> scalar) on `device`: per task, then over the plan's
    tasks in order. In a per-host graph a task's sum goes to `device` through queue `key(task)`: None where `device`
    is another task's."""
    by_task: Dict[str, List[tf.Tensor]] = {}
    for d in sorted(by_device):
        task = host.task if host.per_host and host.is_local(d) else host_part.task_of(d)  # unplaced: this task's
        with tf.device(d):
            by_task.setdefault(task, []).append(tf.cast(by_device[d], dtype))
    terms = []
    for task in sorted(set(first_devices(plan_devices)) | set(by_task)):
        if host.per_host and task != host.task:
            if host.is_local(device):
                terms.append(host.receive(key(task), dtype, tf.TensorShape([]), device))
            continue
        sums = by_task.get(task)
        with tf.device(sums[0].device if sums else device):
            term = ordered_sum(sums) if sums else tf.constant(0, dtype)
        if host.is_local(device):
            terms.append(term)
        else:
            host.send(key(task), term, device)
    if not host.is_local(device):
        return None
    with tf.device(device):
        return ordered_sum(terms)


def shared_from(make: Callable[[], tf.Tensor], device: str, plan_devices: Sequence[str], host,
                key: Callable[[str], str], dtype: tf.DType = tf.float32) -> tf.Tensor:
    """A scalar `make()` builds on `device` (a clipping scale), where this graph reads it: there, and in a per-host
    graph sent from there to every other task of the plan, which receives it through queue `key(task)` on its first
    device."""
    if host.is_local(device):
        value = make()
        for task, first in sorted(first_devices(plan_devices).items()):
            if host.per_host and task != host.task:
                host.send(key(task), value, first)
        return value
    return host.receive(key(host.task), dtype, tf.TensorShape([]), first_devices(plan_devices)[host.task])

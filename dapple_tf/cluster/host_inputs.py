"""Per-host training reads the global batch in every task, and every task must read the same one: a task whose
input_fn gives another batch (a dataset shuffled without a seed) would feed its stages features that do not match
the other tasks' labels, and nothing would fail. `SameInputsHook` compares a fingerprint of each task's first
batch across the tasks and stops training, naming the tasks, when they differ.
"""

import json
from typing import Sequence

import tensorflow as tf

from dapple_tf.cluster import host_signals
from dapple_tf.errors import PerHostError


def fingerprint(tensors) -> tf.Tensor:
    """Per input tensor, the sum over its rows of (row index + 1) x the row's sum, in float64 (strings hashed):
    equal batches give equal values, the same rows in another order other ones."""
    values = []
    for t in tf.nest.flatten(tensors):
        if t is None:
            continue
        with tf.name_scope("dapple/input_fingerprint"):
            if t.dtype == tf.string:
                t = tf.strings.to_hash_bucket_fast(t, 2**31 - 1)
            x = tf.cast(t, tf.float64)
            rows = tf.reshape(x, [tf.shape(x)[0], -1]) if t.shape.rank else tf.reshape(x, [1, 1])
            weights = tf.cast(tf.range(1, tf.shape(rows)[0] + 1), tf.float64)
            values.append(tf.reduce_sum(tf.reduce_sum(rows, 1) * weights))
    return tf.stack(values)


class SameInputsHook(tf.compat.v1.train.SessionRunHook):
    """After each task's first step, every task tells every other the fingerprint of the batch it read; a task that
    read another batch than the first task stops every task with a PerHostError naming it."""

    def __init__(self, cluster, tasks: Sequence[int], inputs, timeout_s: float):
        self._cluster, self._tasks, self._timeout_s = cluster, list(tasks), timeout_s
        self._fingerprint = fingerprint(inputs)
        self._done = False

    def before_run(self, run_context):
        return None if self._done else tf.compat.v1.train.SessionRunArgs(self._fingerprint)

    def after_run(self, run_context, run_values):
        if self._done:
            return
        self._done = True
        mine = json.dumps([float(v).hex() for v in run_values.results])
        texts = host_signals.exchange_texts(self._cluster, self._tasks, mine, self._timeout_s, name="input_check")
        first = self._tasks[0]
        differing = [t for t in self._tasks if texts[t] != texts[first]]
        if differing:
            raise PerHostError(
                f"worker task(s) {differing} read another batch than worker task {first} in their first step: training "
                "per host needs every task to read the same batches (an input_fn of the step, or a dataset without "
                "unseeded shuffling)")

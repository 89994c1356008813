"""Sync batch norm in per-host graphs of CPU tasks: the statistics' sums over a stage's replicas through queues.

In one graph, and per host on GPUs, a synchronized statistic is all-reduced by a TF collective
(sync_batch_norm.py). Per-host sessions of CPU tasks did not run TF's collective ring reliably (docs/design.md,
per-host graphs), so there the stage's GraphDef holds a marker instead of each collective (sync_batch_norm.marker: an
Identity of the local sum, with the attribute MARKER naming the sum within the stage). Once a clone is imported, `replace_markers` sums
the replicas' values in each clone: every replica sends its local value to every other replica's device
(host_part's queues, one per sum, clone and replica pair) and adds them all in replica order, so that every replica
gets the same bits (which matched the one graph's collective to the bit in every case tried: tests/test_per_host.py).
The sum's gradient is the same sum of every replica's upstream gradient, sent and added alike (the
gradient registered here, keyed by the attribute EXCHANGE on the sum).
"""

import json
from typing import Sequence

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from dapple_tf.rewrite.batch.sync_batch_norm import MARKER
from dapple_tf.rewrite.hosts import host_part

EXCHANGE = "_dapple_replicas_exchange"
_GRADIENT = "DappleHostReplicasSum"


def replace_markers(ops: Sequence[tf.Operation], key: str, replica: int, devices: Sequence[str]) -> int:
    """Replaces every marker among `ops` (one clone's, replica `replica` of `devices`) by the sum over the replicas;
    `key` names the clone alike in every task's graph (stage, micro-batch, forward or recomputed). Returns how many."""
    markers = [op for op in ops if MARKER in op.node_def.attr]
    for op in markers:
        total = _summed(op.inputs[0], f"{key}/{op.get_attr(MARKER)}", replica, devices)
        for consumer in list(op.outputs[0].consumers()):
            for index, tensor in enumerate(consumer.inputs):
                if tensor is op.outputs[0]:
                    consumer._update_input(index, total)  # pylint: disable=protected-access
    return len(markers)


def _summed(value: tf.Tensor, key: str, replica: int, devices: Sequence[str]) -> tf.Tensor:
    """The sum, whose gradient is summed the same way (key + "/gradient")."""
    total = _exchange(value, key, replica, devices)
    with tf.compat.v1.get_default_graph().gradient_override_map({"Identity": _GRADIENT}):
        summed = tf.identity(total, name="replicas_sum")
    described = json.dumps({"key": key, "replica": replica, "devices": list(devices)})
    summed.op._set_attr(EXCHANGE, attr_value_pb2.AttrValue(s=described.encode()))  # pylint: disable=protected-access
    return summed


def _exchange(value: tf.Tensor, key: str, replica: int, devices: Sequence[str]) -> tf.Tensor:
    """Sends `value` to every other replica and adds every replica's value in replica order, on this replica's
    device; the sends run before the sum is read (a control edge: nothing else of this graph waits for them)."""
    here = devices[replica]
    with tf.compat.v1.colocate_with(None, ignore_existing=True):  # a gradient's ops are colocated with its op
        sends = [host_part.send(f"{key}/{replica}-{peer}", value, device)
                 for peer, device in enumerate(devices) if peer != replica]
        terms = [value if peer == replica else host_part.receive(f"{key}/{peer}-{replica}", value.dtype, value.shape,
                                                                   here)
                 for peer in range(len(devices))]
        with tf.device(here):
            total = terms[0]
            for term in terms[1:]:
                total = total + term
            with tf.control_dependencies(sends):
                return tf.identity(total)


@tf.RegisterGradient(_GRADIENT)
def _replicas_sum_gradient(op, grad):
    """Every replica's upstream gradient, summed over the replicas as the forward values were."""
    described = json.loads(op.get_attr(EXCHANGE).decode())
    return [_exchange(grad, described["key"] + "/gradient", described["replica"], described["devices"])]

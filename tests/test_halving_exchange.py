"""The all-reduce of groups of three devices or more (rewrite/update/halving_exchange.py): recursive halving and
doubling, the same additions in a per-host graph as in the one graph, and O(log n) operations per device."""

import numpy as np
import pytest
import tensorflow as tf

from dapple_tf.rewrite.update import collectives, halving_exchange
from dapple_tf.rewrite.hosts.host_part import HostPart
from tests.pipeline_harness import SESSION_CONFIG, cpu


def _task_device(t):
    return f"/job:worker/replica:0/task:{t}/device:CPU:0"


def _sums(values, per_host, tasks):
    """Every device's sum, from one graph over this process's devices, or per host: a graph per task (`tasks` of
    them, devices dealt round the tasks), all in one session over queues on this process's devices."""
    with tf.Graph().as_default():
        sums, sends = {}, []
        parts = range(tasks) if per_host else [None]
        for part in parts:
            buffers = {}
            for d, v in enumerate(values):
                ours = part is None or d % tasks == part
                with tf.device(cpu(d)):
                    buffers[cpu(d)] = tf.constant(v) if ours else None
            host = _TaskOfDevices({cpu(d) for d in range(len(values)) if d % tasks == part}) if per_host else None
            sums.update(halving_exchange.halving_doubling_sum(buffers, host, "test"))
            sends += host.sends() if per_host else []
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            return [sess.run((sums, sends))[0] for _ in range(2)]  # the queues are left empty after a step


class _TaskOfDevices(HostPart):
    """A per-host graph's part whose task is a set of this process's devices."""

    def __init__(self, devices):  # pylint: disable=super-init-not-called
        self._devices = devices
        self._sends, self._takes = [], []

    def is_local(self, device):
        return device in self._devices


@pytest.mark.parametrize("num_devices", [3, 4, 5, 7, 8])
def test_per_host_graphs_sum_as_the_one_graph_to_the_bit(num_devices):
    rng = np.random.default_rng(num_devices)
    size = 37  # not a multiple of the rows: the last row is padded
    values = [(rng.standard_normal(size) * 10.0 ** rng.integers(-3, 4, size)).astype(np.float32)
              for _ in range(num_devices)]
    one_graph = _sums(values, per_host=False, tasks=1)[0]
    exact = np.sum(np.array(values, np.float64), axis=0)
    for d in range(num_devices):
        np.testing.assert_allclose(one_graph[cpu(d)], exact, rtol=1e-5, atol=1e-3)
        assert one_graph[cpu(d)].tobytes() == one_graph[cpu(0)].tobytes()
    for tasks in (2, num_devices):
        for step in _sums(values, per_host=True, tasks=tasks):
            assert {d: s.tobytes() for d, s in step.items()} == {d: s.tobytes() for d, s in one_graph.items()}


def test_integers_sum_exactly_on_every_device():
    values = [(np.arange(10) * 8 ** d).astype(np.float32) for d in range(6)]  # below 2**24: any order is exact
    for step in _sums(values, per_host=True, tasks=6):
        for d in range(6):
            assert step[cpu(d)].tolist() == np.sum(values, axis=0).tolist()


def test_a_per_host_device_adds_operations_by_the_logarithm_of_the_group():
    counts = {}
    for num_devices in (4, 8, 16, 32):
        with tf.Graph().as_default() as graph:
            buffers = {_task_device(t): None for t in range(num_devices)}
            with tf.device(cpu(0)):
                buffers[_task_device(0)] = tf.zeros([1000])
            halving_exchange.halving_doubling_sum(buffers, HostPart(_task_device(0), list(buffers)), "test")
            counts[num_devices] = len(graph.get_operations())
    per_doubling = counts[8] - counts[4]
    assert 0 < per_doubling < 30 and counts[16] - counts[8] == counts[32] - counts[16] == per_doubling, counts


def test_exchange_sum_halves_and_doubles_groups_of_three_devices():
    with tf.Graph().as_default() as graph:
        per_device = {}
        for d in range(3):
            with tf.device(cpu(d)):
                per_device[cpu(d)] = [tf.fill([2, 3], float(d + 1)), tf.constant(10.0 * (d + 1))]
        sums = collectives.exchange_sum(per_device)
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            got = sess.run(sums)
    assert all(got[cpu(d)][0].tolist() == [[6.0] * 3] * 2 and got[cpu(d)][1] == 60.0 for d in range(3))
    # device 2 folds into device 0, devices 0 and 1 add each other's half
    assert len([op for op in graph.get_operations() if op.type == "AddV2"]) == 1 + 2

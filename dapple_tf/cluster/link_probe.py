"""Measures the link between two devices as the runtime uses it: latency and bandwidth of a transfer.

A single session step sends a tensor back and forth between the two devices `round_trips` times
(each hop data-dependent on the last, so hops never overlap), for a small and a large tensor. The
time of one hop is latency + bytes / bandwidth; the two sizes give both terms. Measuring inside one
step leaves out the client's per-step cost (session dispatch), which the pipeline does not pay per
transfer; graph rewriting is off for the probe (it would fold the chain of identities). On a TF cluster the hops between tasks go through gRPC exactly like activations between
stages. `measure_allreduce` times the runtime's own gradient AllReduce across devices, which the
cost model's ring formula then uses (Cluster.allreduce_bandwidth); `measure_concurrent_slowdown` how
much devices that share a machine slow each other when they all compute (CPU workers share caches
and memory bandwidth; Cluster.concurrent_compute_slowdown).
"""

import copy
import dataclasses
import statistics
import time

import tensorflow as tf

SMALL_BYTES = 4 * 1024
LARGE_BYTES = 4 * 2**20


@dataclasses.dataclass(frozen=True)
class LinkMeasurement:
    latency_s: float  # one transfer of (almost) nothing
    bandwidth: float  # bytes/s beyond the latency

    def transfer_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth


def _hop_seconds(target: str, config, device_a: str, device_b: str, nbytes: int, round_trips: int,
                 repeats: int) -> float:
    config = copy.deepcopy(config)
    config.graph_options.rewrite_options.disable_meta_optimizer = True  # keep every hop's Identity
    with tf.Graph().as_default():
        with tf.device(device_a):
            x = tf.Variable(tf.zeros([nbytes // 4], tf.float32), name="link_probe")
            y = x.read_value()
        for _ in range(round_trips):
            for device in (device_b, device_a):
                with tf.device(device):
                    y = tf.identity(y)
        with tf.device(device_a):
            done = tf.reduce_sum(y[:1])
        with tf.compat.v1.Session(target, config=config) as sess:
            sess.run(x.initializer)
            sess.run(done)
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                sess.run(done)
                samples.append(time.perf_counter() - start)
            with tf.device(device_a):
                nothing = tf.reduce_sum(x[:1])
            sess.run(nothing)
            base = statistics.median(_timed(sess, nothing) for _ in range(repeats))
    return max(0.0, statistics.median(samples) - base) / (2 * round_trips)


def _timed(sess, fetch) -> float:
    start = time.perf_counter()
    sess.run(fetch)
    return time.perf_counter() - start


def measure_allreduce(target: str, config, devices, nbytes: int = 16 * 2**20, repeats: int = 5) -> float:
    """Bytes/s per device of the runtime's AllReduce across these devices (collectives.all_reduce_sum: the
    exchange between processes), in the ring formula's terms: 2 (n-1)/n * nbytes / time."""
    from dapple_tf.rewrite.update import collectives

    with tf.Graph().as_default():
        per_device, values = {}, []
        for i, device in enumerate(devices):
            with tf.device(device):
                v = tf.Variable(tf.ones([4, nbytes // 16]), name=f"allreduce_probe_{i}")
                values.append(v)
                per_device[device] = [v.read_value()[k] for k in range(4)]  # four gradients of a bucket
        sums = collectives.all_reduce_sum(per_device, collectives.CollectiveKeys(tf.compat.v1.get_default_graph()))
        done = []
        for device in devices:
            with tf.device(device):
                done.append(tf.add_n([tf.reduce_sum(t[:1]) for t in sums[device]]))
        with tf.compat.v1.Session(target, config=config) as sess:
            sess.run([v.initializer for v in values])
            sess.run(done)
            elapsed = statistics.median(_timed(sess, done) for _ in range(repeats))
            with tf.device(devices[0]):
                nothing = tf.reduce_sum(values[0][0, :1])
            sess.run(nothing)
            base = statistics.median(_timed(sess, nothing) for _ in range(repeats))
    n = len(devices)
    return 2.0 * (n - 1) / n * nbytes / max(elapsed - base, 1e-9)


def measure_concurrent_slowdown(target: str, config, devices, make_step, repeats: int = 7) -> float:
    """How much slower a device computes while every device computes (Cluster.concurrent_compute_slowdown):
    the median, over `repeats` back-to-back pairs, of one step on every device at once over the same step on
    the first device alone (pairs, so that a machine whose speed drifts slows both sides alike), at least 1.
    `make_step()` builds one step's operations under the current device scope."""
    with tf.Graph().as_default():
        steps = []
        for i, device in enumerate(devices):
            with tf.device(device), tf.compat.v1.variable_scope(f"slowdown_probe_{i}"):
                steps.append(make_step())
        with tf.compat.v1.Session(target, config=config) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            everywhere = [op for ops in steps for op in ops]
            sess.run(everywhere)
            sess.run(steps[0])
            ratios = [_timed(sess, everywhere) / _timed(sess, steps[0]) for _ in range(repeats)]
    return max(1.0, statistics.median(ratios))


def measure_link(target: str, config, device_a: str, device_b: str, round_trips: int = 8,
                 repeats: int = 5) -> LinkMeasurement:
    """Latency and bandwidth between two devices of the session target's cluster."""
    small = _hop_seconds(target, config, device_a, device_b, SMALL_BYTES, round_trips, repeats)
    large = _hop_seconds(target, config, device_a, device_b, LARGE_BYTES, round_trips, repeats)
    bandwidth = (LARGE_BYTES - SMALL_BYTES) / max(large - small, 1e-9)
    return LinkMeasurement(latency_s=max(small - SMALL_BYTES / bandwidth, 0.0), bandwidth=bandwidth)

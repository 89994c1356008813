"""Timing a session run: warm-up runs, then the median of timed runs, minus the session's own overhead."""

import statistics
import time

import tensorflow as tf


def median_run_ms(sess, fetches, feed_dict=None, warmup=2, runs=5):
    """Median wall-clock milliseconds of `sess.run(fetches, feed_dict)` after `warmup` untimed runs."""
    for _ in range(warmup):
        sess.run(fetches, feed_dict=feed_dict)
    samples = []
    for _ in range(max(1, runs)):
        start = time.perf_counter()
        sess.run(fetches, feed_dict=feed_dict)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def session_overhead_ms(sess, graph, device, warmup=5, runs=21):
    """Median time of running a no-op on `device`: the per-run cost every timed run also pays."""
    with graph.as_default(), tf.device(device):
        noop = tf.no_op(name="profiler_overhead_probe")
    return median_run_ms(sess, noop, warmup=warmup, runs=runs)

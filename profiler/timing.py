"""Timing a session run: warm-up runs, then the median of timed runs, minus the session's own overhead."""

import statistics
import time

import tensorflow as tf


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def median_run_ms(sess, fetches, feed_dict=None, warmup=2, runs=5, clock="wall"):
    """Median milliseconds of `sess.run(fetches, feed_dict)` after `warmup` untimed runs.

    clock "wall": elapsed time; "cpu": this process's CPU time (all threads), which other processes'
    load on a shared machine does not inflate; use it with single-threaded sessions.
    """
    timer = CLOCKS[clock]
    for _ in range(warmup):
        sess.run(fetches, feed_dict=feed_dict)
    samples = []
    for _ in range(max(1, runs)):
        start = timer()
        sess.run(fetches, feed_dict=feed_dict)
        samples.append((timer() - start) * 1e3)
    return statistics.median(samples)


def alternating_median_ms(runs, rounds=5, steps=5):
    """{name: median over `rounds` of median_run_ms(sess, fetches, warmup=1, runs=steps)} for
    runs = {name: (sess, fetches)}, measured in alternating rounds so that a shared machine's changing
    load hits every variant alike; also {name: fastest round} as the second result."""
    samples = {name: [] for name in runs}
    for _ in range(max(1, rounds)):
        for name, (sess, fetches) in runs.items():
            samples[name].append(median_run_ms(sess, fetches, warmup=1, runs=steps))
    return ({name: statistics.median(v) for name, v in samples.items()},
            {name: min(v) for name, v in samples.items()})


def overhead_probe(graph, device):
    """A no-op on `device`: running it with a feed dict costs what a timed run pays besides computing."""
    with graph.as_default(), tf.device(device):
        return tf.no_op(name="profiler_overhead_probe")


def round_ms(sess, fetches, probe, feed_dict=None, warmup=1, runs=2, clock="wall"):
    """One round's net milliseconds of `fetches`: `warmup` untimed runs, then `runs` timed runs of `fetches`
    alternating with runs of the no-op `probe` under the same feeds; the median of the first less the fastest of
    the second (the per-run cost's floor: noise only adds to it), >= 0. Profiles are measured in rounds of these
    (profiler/rounds.py)."""
    timer = CLOCKS[clock]
    for _ in range(warmup):
        sess.run(fetches, feed_dict=feed_dict)
    target, overhead = [], []
    for _ in range(max(1, runs)):
        for samples, what in ((target, fetches), (overhead, probe)):
            start = timer()
            sess.run(what, feed_dict=feed_dict)
            samples.append((timer() - start) * 1e3)
    return max(statistics.median(target) - min(overhead), 0.0)


def net_run_ms(sess, fetches, probe, feed_dict=None, warmup=2, runs=5, clock="wall"):
    """median_run_ms of `fetches` minus that of the no-op `probe` run with the same feeds (>= 0).

    The probe's run pays the session's per-run cost and the feeding (numpy to tensor copies)
    but computes nothing, so the difference is the time of the fetched ops themselves.
    """
    total = median_run_ms(sess, fetches, feed_dict, warmup, runs, clock)
    overhead = median_run_ms(sess, probe, feed_dict, warmup, max(runs, 5), clock)
    return max(total - overhead, 0.0)

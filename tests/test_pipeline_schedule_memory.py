"""Each schedule's memory in the runtime: per-device peaks of what a traced step allocates
(dapple_tf.trace.step_stats.step_allocation_peaks), for two equal stages at M=4. ZB-H1 keeps about 1F1B's peak
(the zero-bubble paper's claim, issue 21), GPipe and ZB-H2 hold more."""

import statistics

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import step_stats_pb2

import dapple_tf
from dapple_tf.trace.step_stats import step_allocation_peaks
from tests.pipeline_harness import SESSION_CONFIG, cpu

WIDTH, MICRO_BATCH, M = 256, 64, 4


def equal_stages_model_fn(features, labels):
    """Four equal hidden layers (four tanh each: activations their backward keeps) and a small loss layer."""
    h = features
    for i in range(4):
        with dapple_tf.layer(f"hidden{i}"):
            w = tf.compat.v1.get_variable(f"w{i}", [WIDTH, WIDTH], initializer=tf.compat.v1.glorot_uniform_initializer())
            h = tf.tanh(tf.matmul(h, w))
            for _ in range(3):
                h = tf.tanh(h * 1.01)
    with dapple_tf.layer("loss"):
        w = tf.compat.v1.get_variable("w_out", [WIDTH, 1])
        return tf.reduce_mean(tf.square(tf.matmul(h, w)[:, 0] - labels))


def device_peaks(schedule, stage_functions):
    """[stage 0 device, stage 1 device] step allocation peaks in bytes, median over 3 traced steps."""
    rng = np.random.RandomState(0)
    with tf.Graph().as_default():
        x = tf.constant(rng.randn(MICRO_BATCH * M, WIDTH).astype(np.float32))
        y = tf.constant(rng.randn(MICRO_BATCH * M).astype(np.float32))
        plan = dapple_tf.Plan.from_stages([(0, 1, [cpu(0)]), (2, 4, [cpu(1)])], M)
        handle = dapple_tf.build_pipeline(equal_stages_model_fn, x, y, tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                          plan, dapple_tf.PipelineOptions(schedule=schedule,
                                                                          stage_functions=stage_functions))
        peaks = []
        with tf.compat.v1.Session(config=handle.session_config(SESSION_CONFIG)) as sess:
            sess.run(handle.initializer)
            sess.run(handle.train_op)
            for _ in range(3):
                metadata = tf.compat.v1.RunMetadata()
                sess.run(handle.train_op, run_metadata=metadata,
                         options=tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
                by_device = step_allocation_peaks(metadata.step_stats)
                peaks.append([next(v for d, v in by_device.items() if d.endswith(f"CPU:{i}")) for i in (0, 1)])
    return [statistics.median(p[i] for p in peaks) for i in (0, 1)]


@pytest.mark.parametrize("stage_functions", [False, True], ids=["clones", "functions"])
def test_zb_h1_keeps_the_1f1b_peak_and_gpipe_does_not(stage_functions):
    peaks = {s: device_peaks(s, stage_functions) for s in ("dapple", "zb-h1", "zb-h2", "gpipe")}
    activation = 4 * 4 * MICRO_BATCH * WIDTH  # one layer's four tanh outputs for one micro-batch
    # The highest device peak, on the first stage (two micro-batches in flight): ZB-H1 within 10% of 1F1B. Measured
    # +0% with functions, +0 to +7.7% with clones over runs (TF 2.15 and 2.21). The first stage runs 1F1B's order
    # with each W right after its B (F0 F1 B0 W0 F2 B1 W1 ...), so what moves its peak is the order of the
    # operations inside the tasks: which micro-batch's weight gradients are still live at the peak (single
    # traced steps -4% to +8%). A whole extra micro-batch would be +15-25%.
    assert max(peaks["zb-h1"]) <= 1.10 * max(peaks["dapple"]), peaks
    assert peaks["dapple"][0] > peaks["dapple"][1], peaks
    # what is measured moves with the schedule: the last stage holds a second micro-batch for its deferred W
    # (its stage: two layers' activations, partly released by B: +0.75 to +1.0 activation over runs, as the
    # 1F1B side moves by a quarter), GPipe all four, ZB-H2 more warm-up forwards
    assert peaks["zb-h1"][1] > peaks["dapple"][1] + activation / 2, peaks
    assert all(g > d + activation for g, d in zip(peaks["gpipe"], peaks["dapple"])), peaks
    assert max(peaks["zb-h2"]) > 1.2 * max(peaks["dapple"]), peaks


def test_step_allocation_peaks_sum_records_in_time_order():
    stats = step_stats_pb2.StepStats()
    dev = stats.dev_stats.add(device="/device:CPU:0")
    for node_records in ([(10, 100), (40, -100)], [(20, 50), (30, -50)], [(35, 70)]):
        memory = dev.node_stats.add().memory.add()
        for micros, nbytes in node_records:
            memory.allocation_records.add(alloc_micros=micros, alloc_bytes=nbytes)
    stats.dev_stats.add(device="/device:CPU:1").node_stats.add()  # nothing allocated: left out
    # live: 100 at 10, 150 at 20, 100 at 30, 170 at 35, 70 at 40
    assert step_allocation_peaks(stats) == {"/device:CPU:0": 170}

"""Per-device step allocation peaks of each schedule, for two equal stages at M=4, each stage in its own worker
task (two in-process `tf.distribute.Server`s): the activation a stage sends is copied into the next task, as
between separate devices. (Virtual CPU devices of one process share the buffer instead: what the next stage
keeps for its deferred W is then counted on the sending device.)

    python -m tests.schedule_memory_probe dapple zb-h1   # prints {"dapple": {"clones": [p0, p1], ...}, ...}

Run in its own process by tests/test_pipeline_schedule_memory.py, so that the servers end with it.
"""

import json
import socket
import statistics
import sys

import numpy as np
import tensorflow as tf

import dapple_tf
from dapple_tf.trace.step_stats import step_allocation_peaks

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


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device(task):
    return f"/job:worker/replica:0/task:{task}/device:CPU:0"


def device_peaks(target, schedule, stage_functions, steps=3):
    """[stage 0 task, stage 1 task] step allocation peaks in bytes, median over `steps` traced steps."""
    rng = np.random.RandomState(0)
    with tf.Graph().as_default():
        with tf.device(_device(0)):
            x = tf.constant(rng.randn(MICRO_BATCH * M, WIDTH).astype(np.float32))
            y = tf.constant(rng.randn(MICRO_BATCH * M).astype(np.float32))
        plan = dapple_tf.Plan.from_stages([(0, 1, [_device(0)]), (2, 4, [_device(1)])], M)
        handle = dapple_tf.build_pipeline(equal_stages_model_fn, x, y, tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                          plan, dapple_tf.PipelineOptions(schedule=schedule,
                                                                          stage_functions=stage_functions,
                                                                          traced_functions=True))
        peaks = []
        with tf.compat.v1.Session(target, config=handle.session_config(tf.compat.v1.ConfigProto())) as sess:
            sess.run(handle.initializer)
            sess.run(handle.train_op)
            for _ in range(steps):
                metadata = tf.compat.v1.RunMetadata()
                sess.run(handle.train_op, run_metadata=metadata,
                         options=tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
                by_device = step_allocation_peaks(metadata.step_stats)
                peaks.append([next(v for d, v in by_device.items() if f"/task:{i}/" in d) for i in (0, 1)])
    return [statistics.median(p[i] for p in peaks) for i in (0, 1)]


def main(schedules):
    spec = tf.train.ClusterSpec({"worker": [f"127.0.0.1:{_free_port()}" for _ in range(2)]})
    # One inter-op thread per task: a call op's arguments (stage functions) are released by the thread that
    # launched it, which under CPU contention can run after the task's next call has started, so a step's peak
    # then counts a micro-batch's activations twice (TF 2.21 beside a test run: 12 of 120 steps, +512 or
    # +1024 KiB on the first stage; 0 of 120 with one thread).
    config = tf.compat.v1.ConfigProto(device_count={"CPU": 1}, inter_op_parallelism_threads=1)
    servers = [tf.distribute.Server(spec, "worker", task, config=config) for task in range(2)]
    result = {schedule: {rewrite: device_peaks(servers[0].target, schedule, rewrite == "functions")
                         for rewrite in ("clones", "functions")}
              for schedule in schedules}
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])

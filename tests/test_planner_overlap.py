"""What the runtime does with a replicated stage's gradient AllReduce, measured on a timeline (TF
RunMetadata step stats on virtual CPU devices): the collective starts only after the stage's last
backward pass has ended, so the planner models no backward/AllReduce overlap (Options.overlap False;
the dp_overlap baseline keeps it as the paper's "DP Overlap")."""

import numpy as np
import tensorflow as tf

import dapple_tf
from planner.plan_eval import Options


def model_fn(features, labels):
    h = features
    for i in range(4):
        with dapple_tf.layer(f"dense{i}"):
            w = tf.compat.v1.get_variable(f"w{i}", [h.shape[1], 256])
            h = tf.tanh(tf.matmul(h, w))
    with dapple_tf.layer("loss"):
        w = tf.compat.v1.get_variable("w_out", [256, 1])
        return tf.reduce_mean(tf.square(tf.matmul(h, w)[:, 0] - labels))


def test_allreduce_starts_after_the_stages_last_backward():
    assert Options().overlap is False
    rng = np.random.RandomState(0)
    devices = ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]  # virtual CPUs (tests/conftest.py)
    with tf.Graph().as_default():
        x = tf.constant(rng.randn(64, 32).astype(np.float32))
        y = tf.constant(rng.randn(64).astype(np.float32))
        plan = dapple_tf.Plan.from_stages([(0, 2, devices[:2]), (3, 4, devices[2:])], num_micro_batches=4)
        handle = dapple_tf.build_pipeline(model_fn, x, y, tf.compat.v1.train.GradientDescentOptimizer(0.01), plan)
        with tf.compat.v1.Session(config=tf.compat.v1.ConfigProto(device_count={"CPU": 3})) as sess:
            sess.run(handle.initializer)
            sess.run(handle.train_op)
            meta = tf.compat.v1.RunMetadata()
            sess.run(handle.train_op, run_metadata=meta,
                     options=tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
    timeline = {}  # op name -> (device, start, end), microseconds
    for dev in meta.step_stats.dev_stats:
        for node in dev.node_stats:
            timeline[node.node_name] = (dev.device, node.all_start_micros,
                                        node.all_start_micros + node.all_end_rel_micros)
    for index, device in enumerate(devices[:2]):
        backward = [ops for (dev, task, _), ops in handle.task_op_names.items() if dev == device and task.kind == "B"]
        assert len(backward) == 4  # one backward task per micro-batch on each replica of stage 0
        last_backward_end = max(timeline[op][2] for ops in backward for op in ops if op in timeline)
        reduces = [start for name, (dev, start, _) in timeline.items()
                   if dev.endswith(f"CPU:{index}") and name.startswith("CollectiveReduce")]
        assert len(reduces) == 1  # one packed collective per (device set, dtype)
        assert reduces[0] >= last_backward_end, (device, reduces[0], last_backward_end)

"""Peak memory of one pipelined training step: DAPPLE's early backward against GPipe's order.

Builds a 2-stage pipeline of an MLP with wide hidden layers on 2 virtual CPU devices and runs
one step per (schedule, M) with TF's BFC CPU allocator, reading the allocator's peak
(tf.config.experimental.get_memory_info) minus its use at the start of the step: the step's
activations and gradients. The micro-batch size is fixed, so GPipe's peak grows with M and
DAPPLE's stays flat. On CPU every virtual device shares one allocator, so the figure is the
sum over both stages.

    python -m scripts.bench_pipeline_memory                 # the table
    python -m scripts.bench_pipeline_memory --json=out.json # also machine-readable
"""

import json
import os
import sys

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags  # noqa: E402

from scripts.cli import run_main  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("hidden", 512, "Width of the hidden layers.")
flags.DEFINE_integer("micro_batch_size", 256, "Samples per micro-batch (fixed while M varies).")
flags.DEFINE_list("micro_batches", ["4", "8", "16"], "Values of M to measure.")
flags.DEFINE_integer("layers", 6, "Hidden layers (split evenly over the 2 stages).")
flags.DEFINE_string("json", None, "Also write the measurements here.")

INPUT_WIDTH = 16


def model_fn_for(hidden, layers):
    import tensorflow as tf

    import dapple_tf

    def model_fn(features, labels):
        h = features
        for i in range(layers):
            with dapple_tf.layer(f"hidden{i}"):
                w = tf.compat.v1.get_variable(
                    f"w{i}", [h.shape[1], hidden], initializer=tf.compat.v1.glorot_uniform_initializer()
                )
                h = tf.tanh(tf.tanh(tf.matmul(h, w)) * 1.01)
        with dapple_tf.layer("loss"):
            w = tf.compat.v1.get_variable("w_out", [hidden, 1])
            return tf.reduce_mean(tf.square(tf.matmul(h, w)[:, 0] - labels))

    return model_fn


def measure(schedule, num_micro_batches, hidden, micro_batch_size, layers):
    """Peak bytes above the step's starting use, for one step of the 2-stage pipeline."""
    import numpy as np
    import tensorflow as tf

    import dapple_tf

    n = micro_batch_size * num_micro_batches
    rng = np.random.RandomState(0)
    with tf.Graph().as_default():
        x = tf.constant(rng.randn(n, INPUT_WIDTH).astype(np.float32))
        y = tf.constant(rng.randn(n).astype(np.float32))
        half = layers // 2
        plan = dapple_tf.Plan.from_stages(
            [(0, half - 1, ["/device:CPU:0"]), (half, layers, ["/device:CPU:1"])], num_micro_batches=num_micro_batches
        )
        handle = dapple_tf.build_pipeline(
            model_fn_for(hidden, layers), x, y, tf.compat.v1.train.GradientDescentOptimizer(0.01), plan, schedule
        )
        config = tf.compat.v1.ConfigProto(device_count={"CPU": 2})
        with tf.compat.v1.Session(config=config) as sess:
            sess.run(handle.initializer)
            sess.run(handle.train_op)  # warm-up: allocator pools, constant folding
            start = tf.config.experimental.get_memory_info("CPU:0")["current"]
            tf.config.experimental.reset_memory_stats("CPU:0")
            sess.run(handle.train_op)
            peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return peak - start


def main(argv):
    del argv
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    ms = [int(m) for m in FLAGS.micro_batches]
    rows = []
    for m in ms:
        row = {"M": m}
        for schedule in ("dapple", "gpipe"):
            row[schedule] = measure(schedule, m, FLAGS.hidden, FLAGS.micro_batch_size, FLAGS.layers)
        rows.append(row)
    act = FLAGS.micro_batch_size * FLAGS.hidden * 4
    print(
        f"2 stages, {FLAGS.layers} hidden layers of {FLAGS.hidden}, micro-batch {FLAGS.micro_batch_size} "
        f"(one activation = {act / 2**20:.2f} MiB); step peak above its start, MiB (TF BFC CPU allocator)"
    )
    print(f"{'M':>4} {'dapple':>10} {'gpipe':>10} {'gpipe/dapple':>13}")
    for row in rows:
        print(f"{row['M']:>4} {row['dapple'] / 2**20:>10.1f} {row['gpipe'] / 2**20:>10.1f} {row['gpipe'] / row['dapple']:>13.2f}")
    first, last = rows[0], rows[-1]
    print(
        f"M {first['M']} -> {last['M']}: dapple x{last['dapple'] / first['dapple']:.2f}, "
        f"gpipe x{last['gpipe'] / first['gpipe']:.2f}"
    )
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def run():
    run_main(main)


if __name__ == "__main__":
    sys.exit(run())

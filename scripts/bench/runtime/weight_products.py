"""One dense layer's three products at the whole batch vs in M micro-batch slices, on one pinned core: the
micro-batching overhead that schedule dapple-batched-w removes from the weight gradient.

Rows printed (median ms of `--runs` session runs, each running the product over all M slices):
- forward x W, input gradient dy W^T: per slice (the pipeline needs them per micro-batch);
- weight gradient x^T dy with the running sum over slices (schedules dapple, gpipe, zero bubble);
- weight gradient as one product of the stacked slices (dapple-batched-w, dapple_tf/rewrite/stages/weight_batching.py).

    python -m scripts.bench.runtime.weight_products [--width=1024] [--batch=1024] [--micro_batches=8] [--core=1]
"""

import os
import statistics
import sys

from absl import flags

from scripts.bench import harness
from scripts.cli import run_main

FLAGS = flags.FLAGS
flags.DEFINE_integer("width", 1024, "Inputs and outputs of the layer.")
flags.DEFINE_integer("batch", 1024, "Rows of the whole batch.")
flags.DEFINE_integer("micro_batches", 8, "Slices the batch is cut into (M).")
flags.DEFINE_integer("core", 1, "Core to pin this process to (-1: no pinning).")
flags.DEFINE_integer("runs", 20, "Timed runs per row (after 3 warm-up runs).")


def _median_ms(fetch, runs: int) -> float:
    import tensorflow as tf

    with tf.compat.v1.Session(graph=fetch.graph, config=tf.compat.v1.ConfigProto(
            intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for _ in range(3):
            sess.run(fetch)
        times = [harness.timed(lambda: sess.run(fetch))[1] for _ in range(runs)]
    return 1e3 * statistics.median(times)


def _product(kind: str, slices: int, stacked: bool = False):
    """A scalar that needs `kind`'s products over the batch cut into `slices` (variables: nothing folds)."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    rows, width = FLAGS.batch // slices, FLAGS.width
    with tf.Graph().as_default():
        weight = tf.Variable(rng.standard_normal((width, width)).astype(np.float32))
        xs = [tf.Variable(rng.standard_normal((rows, width)).astype(np.float32)) for _ in range(slices)]
        dys = [tf.Variable(rng.standard_normal((rows, width)).astype(np.float32)) for _ in range(slices)]
        if kind == "forward":
            out = tf.add_n([tf.reduce_sum(tf.matmul(x, weight)) for x in xs])
        elif kind == "input_gradient":
            out = tf.add_n([tf.reduce_sum(tf.matmul(dy, weight, transpose_b=True)) for dy in dys])
        elif stacked:
            out = tf.reduce_sum(tf.matmul(tf.concat([x.read_value() for x in xs], 0),
                                          tf.concat([dy.read_value() for dy in dys], 0), transpose_a=True))
        else:
            total = None
            for x, dy in zip(xs, dys):
                grad = tf.matmul(x, dy, transpose_a=True)
                total = grad if total is None else total + grad
            out = tf.reduce_sum(total)
        return out


def main(argv):
    del argv
    if FLAGS.core >= 0:
        os.sched_setaffinity(0, {FLAGS.core})
    m = FLAGS.micro_batches
    print(f"dense layer {FLAGS.width} x {FLAGS.width}, batch {FLAGS.batch}, M={m} slices of {FLAGS.batch // m} rows, "
          f"one core, median of {FLAGS.runs} runs")
    print(f"{'product':<40} {'whole batch ms':>15} {'M slices ms':>12} {'ratio':>6}")
    rows = [("forward x W", "forward", False), ("input gradient dy W^T", "input_gradient", False),
            ("weight gradient, running sum", "weight_gradient", False),
            ("weight gradient, stacked (batched-w)", "weight_gradient", True)]
    for label, kind, stacked in rows:
        whole = _median_ms(_product(kind, 1), FLAGS.runs)
        sliced = _median_ms(_product(kind, m, stacked), FLAGS.runs)
        print(f"{label:<40} {whole:>15.2f} {sliced:>12.2f} {sliced / whole:>6.2f}", flush=True)
    return 0


def run():
    run_main(main)


if __name__ == "__main__":
    sys.exit(run())

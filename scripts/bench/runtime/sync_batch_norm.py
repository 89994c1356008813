"""Sync batch norm vs per-slice batch norm: build time and step time of the same pipelined conv net.

A conv net of --blocks (3x3 conv, fused batch norm in training mode, relu) blocks and a dense head,
2 stages x 2 replicas on 4 virtual CPU devices (first half of the blocks, then the rest and the head),
M=--micro_batches; step times of the two modes measured in alternating rounds (shared machines drift). Sync adds two all-reduces per batch norm and
clone forward (and two backward) and normalizes with plain ops instead of the fused kernel.

    python -m scripts.bench.runtime.sync_batch_norm
    python -m scripts.bench.runtime.sync_batch_norm --channels=32 --image_size=32 --global_batch_size=64
"""

from absl import flags

from scripts.bench import harness
from scripts.cli import reject_arguments, run_main

FLAGS = flags.FLAGS
flags.DEFINE_integer("blocks", 4, "Conv + batch norm blocks.")
flags.DEFINE_integer("channels", 16, "Channels of every conv.")
flags.DEFINE_integer("image_size", 16, "Height and width of the synthetic images.")
flags.DEFINE_integer("global_batch_size", 32, "Samples per step.")
flags.DEFINE_integer("micro_batches", 2, "Micro-batches per step (M).")
flags.DEFINE_integer("steps", 5, "Timed steps per round (after 1 warm-up step); the median is kept.")
flags.DEFINE_integer("rounds", 5, "Rounds, alternating the modes.")


def _model_fn(features, labels):
    import tensorflow as tf

    import dapple_tf

    h = features
    for b in range(FLAGS.blocks):
        with dapple_tf.layer(f"block{b}"):
            kernel = tf.compat.v1.get_variable(f"w{b}", [3, 3, h.shape[-1], FLAGS.channels])
            h = tf.nn.conv2d(h, kernel, 1, "SAME")
            gamma = tf.compat.v1.get_variable(f"gamma{b}", initializer=tf.ones([FLAGS.channels]))
            beta = tf.compat.v1.get_variable(f"beta{b}", initializer=tf.zeros([FLAGS.channels]))
            h, _, _ = tf.compat.v1.nn.fused_batch_norm(h, gamma, beta, is_training=True)
            h = tf.nn.relu(h)
    with dapple_tf.layer("head"):
        flat = tf.reshape(h, [-1, h.shape[1] * h.shape[2] * h.shape[3]])
        w = tf.compat.v1.get_variable("w_head", [flat.shape[-1], 10])
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=flat @ w))


def build(batch_norm):
    """(session, train_op, build seconds) of the pipelined net for one batch_norm mode."""
    import warnings

    import numpy as np
    import tensorflow as tf

    import dapple_tf

    rng = np.random.RandomState(0)
    size, n = FLAGS.image_size, FLAGS.global_batch_size
    x = rng.randn(n, size, size, 3).astype(np.float32)
    y = rng.randint(0, 10, n).astype(np.int32)
    half = FLAGS.blocks // 2
    plan = harness.cpu_plan([(0, half - 1, [0, 1]), (half, FLAGS.blocks, [2, 3])], FLAGS.micro_batches)
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", dapple_tf.BatchNormWarning)
            handle, build_s = harness.timed(lambda: dapple_tf.build_pipeline(
                _model_fn, tf.constant(x), tf.constant(y), harness.optimizer(), plan,
                dapple_tf.PipelineOptions(batch_norm=batch_norm)))
    sess = tf.compat.v1.Session(graph=graph, config=harness.cpu_config(4))
    sess.run(handle.initializer)
    return sess, handle.train_op, build_s


def main(argv):
    reject_arguments(argv)
    harness.split_cpu(4)
    print(f"{FLAGS.blocks} conv+BN blocks x {FLAGS.channels} channels, {FLAGS.image_size}x{FLAGS.image_size} images, "
          f"global batch {FLAGS.global_batch_size}, M={FLAGS.micro_batches}, 2 stages x 2 replicas; "
          f"{FLAGS.rounds} alternating rounds of {FLAGS.steps} steps, median of the rounds' medians")
    modes = ("per_slice", "sync")
    built = {mode: build(mode) for mode in modes}
    medians, fastest = harness.alternating_median_ms({mode: built[mode][:2] for mode in modes}, FLAGS.rounds,
                                                     FLAGS.steps)
    print(f"{'batch_norm':12s} {'build s':>8s} {'step ms':>9s} {'min ms':>8s} {'step vs per_slice':>18s}")
    for mode in modes:
        print(f"{mode:12s} {built[mode][2]:8.2f} {medians[mode]:9.1f} {fastest[mode]:8.1f} "
              f"{medians[mode] / medians['per_slice']:18.2f}", flush=True)
        built[mode][0].close()
    return 0


def run():
    run_main(main)


if __name__ == "__main__":
    run()

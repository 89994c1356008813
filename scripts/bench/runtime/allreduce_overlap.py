"""Gradient AllReduce in buckets during the last backward vs one bucket after it: step time of the same
pipelined MLP (dapple_tf/rewrite/update/gradients.py, PipelineOptions(allreduce_bucket_bytes=...)).

An MLP of --layers dense layers of --width, one stage replicated on --replicas virtual CPU devices
(data parallelism through the pipeline runtime), M=--micro_batches. Buckets of one variable each
(--bucket_bytes=0, the default here: every layer's gradients reduce as soon as the last backward
produces them) against one bucket holding every gradient (no overlap), in alternating rounds.
On CPU devices the collective copies memory on the same cores the backward uses, so the gain is
bounded by spare cores (inter-op threads: --inter_op_threads, 0 = TF's default).

    python -m scripts.bench.runtime.allreduce_overlap
"""

from absl import flags

from scripts.bench import harness
from scripts.cli import reject_arguments, run_main

FLAGS = flags.FLAGS
flags.DEFINE_integer("layers", 6, "Dense layers.")
flags.DEFINE_integer("width", 1024, "Units per layer.")
flags.DEFINE_integer("replicas", 2, "Devices of the one (replicated) stage.")
flags.DEFINE_integer("global_batch_size", 128, "Samples per step.")
flags.DEFINE_integer("micro_batches", 2, "Micro-batches per step (M).")
flags.DEFINE_integer("bucket_bytes", 0, "Bucket size of the overlapped variant (0: one variable per bucket).")
flags.DEFINE_integer("inter_op_threads", 0, "Session inter-op threads (0: TF's default, one per core).")
flags.DEFINE_integer("steps", 5, "Timed steps per round (after 1 warm-up step); the median is kept.")
flags.DEFINE_integer("rounds", 5, "Rounds, alternating the variants.")


def _model_fn(features, labels):
    import tensorflow as tf

    import dapple_tf

    h = features
    for i in range(FLAGS.layers):
        with dapple_tf.layer(f"dense{i}"):
            h = tf.tanh(h @ tf.compat.v1.get_variable(f"w{i}", [h.shape[-1], FLAGS.width]))
    with dapple_tf.layer("head"):
        return tf.reduce_mean(tf.square(h @ tf.compat.v1.get_variable("w_head", [FLAGS.width, 1]) - labels))


def build(bucket_bytes):
    """(session, train_op) of the pipelined MLP with gradient buckets of `bucket_bytes`."""
    import numpy as np
    import tensorflow as tf

    import dapple_tf

    rng = np.random.RandomState(0)
    x = rng.randn(FLAGS.global_batch_size, FLAGS.width).astype(np.float32)
    y = rng.randn(FLAGS.global_batch_size, 1).astype(np.float32)
    plan = harness.cpu_plan([(0, FLAGS.layers, range(FLAGS.replicas))], FLAGS.micro_batches)
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(0)
        handle = dapple_tf.build_pipeline(_model_fn, tf.constant(x), tf.constant(y),
                                          harness.optimizer(), plan,
                                          dapple_tf.PipelineOptions(allreduce_bucket_bytes=bucket_bytes))
    config = harness.cpu_config(FLAGS.replicas, inter_op_parallelism_threads=FLAGS.inter_op_threads)
    sess = tf.compat.v1.Session(graph=graph, config=config)
    sess.run(handle.initializer)
    return sess, handle.train_op


def main(argv):
    reject_arguments(argv)
    harness.split_cpu(FLAGS.replicas)
    params_mb = (FLAGS.layers * FLAGS.width * FLAGS.width + FLAGS.width) * 4 / 2**20
    print(f"MLP {FLAGS.layers} x {FLAGS.width} ({params_mb:.0f} MiB of weights), 1 stage x {FLAGS.replicas} "
          f"replicas, global batch {FLAGS.global_batch_size}, M={FLAGS.micro_batches}; {FLAGS.rounds} alternating "
          f"rounds of {FLAGS.steps} steps, median of the rounds' medians")
    base_name = "one bucket (no overlap)"
    variants = {base_name: 1 << 50, f"buckets of {FLAGS.bucket_bytes} B (overlap)": FLAGS.bucket_bytes}
    built = {name: build(size) for name, size in variants.items()}
    medians, fastest = harness.alternating_median_ms(built, FLAGS.rounds, FLAGS.steps)
    print(f"{'variant':34s} {'step ms':>9s} {'min ms':>8s} {'vs one bucket':>14s}")
    for name in variants:
        print(f"{name:34s} {medians[name]:9.1f} {fastest[name]:8.1f} {medians[name] / medians[base_name]:14.2f}",
              flush=True)
        built[name][0].close()
    return 0


def run():
    run_main(main)


if __name__ == "__main__":
    run()

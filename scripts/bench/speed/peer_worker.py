"""One process of a data-parallel peer in the speedup benchmark (scripts/bench/speed/speedup_peers.py runs them).

What a user would write instead of dapple_tf for data parallelism on N pinned workers, on the benchmark's
reference model and global batch (each process its 1/N of it, the same synthetic batch every step):
- `mwms`: tf.distribute.MultiWorkerMirroredStrategy (ring collectives, TF_CONFIG from the runner), the model's
  variables made once under the strategy's scope (tf.compat.v1.make_template over the model_fn), and a custom
  training loop in a tf.function: per replica the loss over the global batch's share, tape gradients, the
  Keras optimizer's apply_gradients (which sums the gradients across workers);
- `horovod`: TF1 graph mode under horovodrun: the model_fn's loss on the local slice, horovod's
  DistributedOptimizer around the benchmark's optimizer, rank 0's variables broadcast before timing.
Each process pins itself to its own cores (--cores: one group per rank, e.g. "0/1") before TensorFlow starts
its thread pools, which are sized as dapple_launch sizes a pinned worker's. Rank 0 prints `STEP_S <median s>`.
"""

import os
import statistics
import time

from absl import flags

from scripts.cli import reject_arguments, run_main

FLAGS = flags.FLAGS
flags.DEFINE_enum("kind", None, ["mwms", "horovod"], "Which peer.")
flags.DEFINE_integer("rank", None, "This process's rank (mwms; horovod reads HOROVOD_RANK).")
flags.DEFINE_string("cores", None, "Cores per rank, rank groups separated by '/': 0/1 or 0,1/2,3.")
flags.DEFINE_string("model", "mlp", "Reference model.")
flags.DEFINE_string("config", "tiny", "Reference model config.")
flags.DEFINE_string("model_flags", "", "Model overrides key=value,...")
flags.DEFINE_integer("global_batch_size", 1024, "Samples per step, all processes together.")
flags.DEFINE_enum("optimizer", "sgd", ["sgd", "adam"], "Optimizer (the benchmark's learning rates).")
flags.DEFINE_integer("intra_op_threads", 1, "Intra-op threads.")
flags.DEFINE_integer("inter_op_threads", 2, "Inter-op threads.")
flags.DEFINE_integer("steps", 10, "Timed steps after 3 warm-up steps; the median is printed.")

WARMUP = 3


def _rank() -> int:
    if FLAGS.kind == "horovod":
        return int(os.environ.get("HOROVOD_RANK", "0"))
    return FLAGS.rank or 0


def _pin(rank: int) -> None:
    if FLAGS.cores and hasattr(os, "sched_setaffinity"):
        groups = FLAGS.cores.split("/")
        os.sched_setaffinity(0, {int(c) for c in groups[rank % len(groups)].split(",")})


def _spec():
    import models  # pylint: disable=import-outside-toplevel

    return models.get_model(FLAGS.model, FLAGS.config, **models.parse_model_flags(FLAGS.model_flags))


def _median_step(run_step) -> float:
    for _ in range(WARMUP):
        run_step()
    times = []
    for _ in range(FLAGS.steps):
        start = time.perf_counter()
        run_step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def mwms_step_s() -> float:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from scripts.bench import harness  # pylint: disable=import-outside-toplevel

    tf.config.threading.set_intra_op_parallelism_threads(FLAGS.intra_op_threads)
    tf.config.threading.set_inter_op_parallelism_threads(FLAGS.inter_op_threads)
    ring = tf.distribute.experimental.CommunicationImplementation.RING
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(implementation=ring))
    spec = _spec()
    replicas = strategy.num_replicas_in_sync
    features, labels = harness.synthetic_batch(spec, FLAGS.global_batch_size // replicas)
    with strategy.scope():
        model = tf.compat.v1.make_template("model", spec.model_fn)
        strategy.run(tf.function(model), args=(features, labels))  # creates the variables, once
        variables = model.trainable_variables
        keras_optimizer = (tf.keras.optimizers.Adam if FLAGS.optimizer == "adam" else tf.keras.optimizers.SGD)(
            harness.LEARNING_RATES[FLAGS.optimizer])

    @tf.function
    def train_step(x, y):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = model(x, y) / replicas  # a mean over the global batch, summed across workers
            keras_optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss

        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_step, args=(x, y)), axis=None)

    return _median_step(lambda: train_step(features, labels).numpy())


def horovod_step_s() -> float:
    import horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from scripts.bench import harness  # pylint: disable=import-outside-toplevel

    tf.compat.v1.disable_eager_execution()
    hvd.init()
    spec = _spec()
    features, labels = harness.synthetic_batch(spec, FLAGS.global_batch_size // hvd.size())
    loss = spec.model_fn(features, labels)
    train_op = hvd.DistributedOptimizer(harness.optimizer(FLAGS.optimizer)).minimize(loss)
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=FLAGS.intra_op_threads,
                                      inter_op_parallelism_threads=FLAGS.inter_op_threads)
    with tf.compat.v1.Session(config=config) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(hvd.broadcast_global_variables(0))
        return _median_step(lambda: sess.run(train_op))


def main(argv):
    reject_arguments(argv)
    rank = _rank()
    _pin(rank)
    step_s = mwms_step_s() if FLAGS.kind == "mwms" else horovod_step_s()
    if rank == 0:
        print(f"STEP_S {step_s}", flush=True)
    return 0


def run():
    run_main(main)


if __name__ == "__main__":
    run()

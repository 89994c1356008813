"""Steady step of build_pipeline's rewrites side by side: clones and stage functions in one process, steps alternated.

    python -m scripts.bench.runtime.step_ab --micro_batches=16     # BERT-24 (hidden 64), 4 stages, as runtime.build
    python -m scripts.bench.runtime.step_ab --micro_batches=4 --rounds=20

Separate runs on this machine move by 10-30% between minutes; here every rewrite's graph is built and run once in
the same process (each in its own session, run with handle.session_config), then --rounds rounds each run one step
of every rewrite in turn, so a drift slows all alike. Prints each rewrite's build and first step, then its median
step and the ratio to the first rewrite's (--rewrites, default clones first).
"""

import statistics

from absl import flags

from scripts.bench import harness
from scripts.bench.harness import timed
from scripts.cli import reject_arguments, run_main

FLAGS = flags.FLAGS
harness.define_straight_pipeline_flags()
flags.DEFINE_integer("micro_batches", 16, "M.")
flags.DEFINE_enum("optimizer", "adam", ["sgd", "adam"], "Optimizer.")
flags.DEFINE_list("rewrites", ["clones", "functions"], "Rewrites, the first the reference: clones "
                  "(stage_functions=False) and/or functions (stage_functions=True).")
flags.DEFINE_integer("rounds", 10, "Rounds of one step per rewrite.")


def _open(tf, spec, names, rewrite: str, config):
    """(session, train op, build s, first step s) of one rewrite of the straight pipeline."""
    import dapple_tf

    graph = tf.Graph()
    with graph.as_default():
        features, labels = harness.synthetic_batch(spec, FLAGS.global_batch_size)
        plan = harness.straight_plan(names, FLAGS.num_stages, FLAGS.micro_batches)
        handle, build_s = timed(lambda: dapple_tf.build_pipeline(
            spec.model_fn, features, labels, harness.optimizer(FLAGS.optimizer), plan,
            dapple_tf.PipelineOptions(stage_functions=rewrite == "functions")))
        session = tf.compat.v1.Session(graph=graph, config=handle.session_config(config))
        session.run(handle.initializer)
        _, first_s = timed(lambda: session.run(handle.train_op))
    return session, handle.train_op, build_s, first_s


def main(argv):
    reject_arguments(argv)
    unknown = set(FLAGS.rewrites) - {"functions", "clones"}
    if unknown or not FLAGS.rewrites:
        raise ValueError(f"--rewrites takes functions and/or clones, got {FLAGS.rewrites}")
    if FLAGS.micro_batches < 1 or FLAGS.rounds < 1:
        raise ValueError("--micro_batches and --rounds must be >= 1")
    config = harness.virtual_cpus(FLAGS.num_stages)
    import tensorflow as tf

    import models

    spec = models.get_model(FLAGS.model, FLAGS.config, **models.parse_model_flags(FLAGS.model_flags))
    names = harness.layer_names(spec, FLAGS.global_batch_size)
    print(f"{FLAGS.model} ({FLAGS.model_flags}), global batch {FLAGS.global_batch_size}, {FLAGS.optimizer}, "
          f"{FLAGS.num_stages} stages, M={FLAGS.micro_batches}; steps alternated over {FLAGS.rounds} rounds", flush=True)
    opened, building = {}, harness.Progress(len(FLAGS.rewrites), "rewrites built")
    for rewrite in FLAGS.rewrites:
        session, op, build_s, first_s = _open(tf, spec, names, rewrite, config)
        opened[rewrite] = (session, op, [])
        building.advance(f"{rewrite:10s} build {build_s:6.1f} s  first step {first_s:6.1f} s")
    rounds = harness.Progress(FLAGS.rounds, "rounds", every_s=10)
    for _ in range(FLAGS.rounds):
        for session, op, times in opened.values():
            times.append(timed(lambda: session.run(op))[1])  # pylint: disable=cell-var-from-loop
        rounds.advance()
    reference = FLAGS.rewrites[0]
    base = statistics.median(opened[reference][2])
    for rewrite, (session, _, times) in opened.items():
        step = statistics.median(times)
        print(f"{rewrite:10s} step {step:.6f} s  {step / base:.4f}x {reference}", flush=True)
        session.close()
    return 0


def run():
    run_main(main)


if __name__ == "__main__":
    run()

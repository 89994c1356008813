"""Steady step of build_pipeline's rewrites side by side: clones and stage functions in one process, steps alternated.

    python -m scripts.bench.step_ab --micro_batches=16          # BERT-24 (hidden 64), 4 stages, as scripts.bench.build
    python -m scripts.bench.step_ab --micro_batches=4 --rounds=20

Separate runs on this machine move by 10-30% between minutes; here every rewrite's graph is built and run once in
the same process (each in its own session, run with handle.session_config), then --rounds rounds each run one step
of every rewrite in turn, so a drift slows all alike. Prints each rewrite's build and first step, then its median
step and the ratio to the first rewrite's (--rewrites, default clones first).
"""

import statistics

from absl import flags

from scripts.bench import build as build_bench, harness
from scripts.bench.harness import timed
from scripts.cli import reject_arguments, run_main

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 10, "Rounds of one step per rewrite.")


def _open(tf, spec, names, micro_batches: int, rewrite: str, config):
    """(session, train op, build s, first step s) of one rewrite of the straight pipeline."""
    import dapple_tf

    graph = tf.Graph()
    with graph.as_default():
        features, labels = harness.synthetic_batch(spec, FLAGS.global_batch_size)
        per = -(-len(names) // FLAGS.num_stages)
        stages = [(names[i], names[min(i + per, len(names)) - 1], [f"/device:CPU:{s}"])
                  for s, i in enumerate(range(0, len(names), per))]
        options = dapple_tf.PipelineOptions(stage_functions=rewrite == "functions")
        handle, build_s = timed(lambda: dapple_tf.build_pipeline(
            spec.model_fn, features, labels, harness.optimizer(FLAGS.optimizer),
            dapple_tf.Plan.from_stages(stages, micro_batches), options))
        session = tf.compat.v1.Session(graph=graph, config=handle.session_config(config))
        session.run(handle.initializer)
        _, first_s = timed(lambda: session.run(handle.train_op))
    return session, handle.train_op, build_s, first_s


def main(argv):
    reject_arguments(argv)
    config = harness.virtual_cpus(FLAGS.num_stages)
    import tensorflow as tf

    import models

    rewrites = FLAGS.rewrites if FLAGS["rewrites"].present else ["clones", "functions"]
    unknown = set(rewrites) - {"functions", "clones"}
    if unknown or len(FLAGS.micro_batches) != 1:
        raise ValueError(f"--rewrites takes functions and/or clones (got {rewrites}), --micro_batches one M "
                         f"(got {FLAGS.micro_batches})")
    m = int(FLAGS.micro_batches[0])
    spec = models.get_model(FLAGS.model, FLAGS.config, **models.parse_model_flags(FLAGS.model_flags))
    names = build_bench._layer_names(tf, spec)  # pylint: disable=protected-access
    print(f"{FLAGS.model} ({FLAGS.model_flags}), global batch {FLAGS.global_batch_size}, {FLAGS.optimizer}, "
          f"{FLAGS.num_stages} stages, M={m}; steps alternated over {FLAGS.rounds} rounds", flush=True)
    opened = {}
    for rewrite in rewrites:
        session, op, build_s, first_s = _open(tf, spec, names, m, rewrite, config)
        opened[rewrite] = (session, op, [])
        print(f"{rewrite:10s} build {build_s:6.1f} s  first step {first_s:6.1f} s", flush=True)
    for _ in range(FLAGS.rounds):
        for session, op, times in opened.values():
            times.append(timed(lambda: session.run(op))[1])  # pylint: disable=cell-var-from-loop
    base = statistics.median(opened[rewrites[0]][2])
    for rewrite, (session, _, times) in opened.items():
        step = statistics.median(times)
        print(f"{rewrite:10s} step {step:.4f} s  {step / base:.3f}x {rewrites[0]}", flush=True)
        session.close()
    return 0


def run():
    run_main(main)


if __name__ == "__main__":
    run()

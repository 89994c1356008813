"""Scale of the rewrite (issue 23): graph size and time to the first step against M, beside plain TF.

    python -m scripts.bench.runtime.build                                  # BERT-24 (hidden 64), 4 stages, M 1,4,16,64
    python -m scripts.bench.runtime.build --micro_batches=1,4 --json=build.json

In one process with --num_stages virtual CPU devices, for plain single-device TF (the same model_fn,
`optimizer.minimize`) and for a straight --num_stages-stage pipeline at every M, it measures the
operations in the graph, the build time (model_fn or build_pipeline), the initializer, the first step
(TF's graph optimization included) and the steady step (median of --steps after the first), and
prints them side by side with the time to the first step (build + initializer + first step) over
plain TF's and the operations each extra micro-batch adds, as a share of the plain graph's.
`--rewrites` says which rewrites, measured in that order: `default` (build_pipeline's defaults run in a plain
tf.compat.v1.Session, as a user who sets nothing gets it; the row's `chose` says whether that built stage functions
or clones), `functions` (stage_functions=True, run with handle.session_config) and `clones` (stage_functions=False).
`--json` writes rows with the keys M (null for plain TF), plan ("single" for plain TF, "straight4-M16-default",
"straight4-M16", "straight4-M16-clones", ...), rewrite, chose, ops, build_s, init_s, first_step_s, step_s.
"""

import statistics

from absl import flags

from scripts.bench import harness
from scripts.bench.harness import timed
from scripts.cli import reject_arguments, run_main

FLAGS = flags.FLAGS
harness.define_straight_pipeline_flags()
flags.DEFINE_list("micro_batches", ["1", "4", "16", "64"], "M values to measure.")
flags.DEFINE_enum("optimizer", "adam", ["sgd", "adam"], "Optimizer.")
flags.DEFINE_integer("steps", 5, "Steady steps timed after the first (median kept).")
flags.DEFINE_string("json", None, "Write the rows to this JSON file.")
flags.DEFINE_list("rewrites", ["default", "functions"], "Rewrites to measure, in this order: default (build_pipeline's "
                  "defaults in a plain Session), functions (stage_functions=True, each stage defined once) and/or clones "
                  "(stage_functions=False, each stage imported per micro-batch).")


def _run(tf, graph, init, train_op, config):
    """(init s, first step s, median steady step s) of a built graph."""
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        _, init_s = timed(lambda: sess.run(init))
        _, first_s = timed(lambda: sess.run(train_op))
        steady = [timed(lambda: sess.run(train_op))[1] for _ in range(max(1, FLAGS.steps))]
    return init_s, first_s, statistics.median(steady)


def measure(tf, spec, micro_batches, config, rewrite="functions"):
    """One row: plain TF when micro_batches is None, else the straight pipeline at that M."""
    import dapple_tf

    graph = tf.Graph()
    with graph.as_default():
        features, labels = harness.synthetic_batch(spec, FLAGS.global_batch_size)

        def build():
            if micro_batches is None:
                op = harness.optimizer(FLAGS.optimizer).minimize(spec.model_fn(features, labels))
                return op, tf.compat.v1.global_variables_initializer(), config, None
            plan = harness.straight_plan(harness.layer_names(spec, FLAGS.global_batch_size), FLAGS.num_stages,
                                         micro_batches)
            options = dapple_tf.PipelineOptions() if rewrite == "default" else dapple_tf.PipelineOptions(
                stage_functions=rewrite == "functions")
            handle = dapple_tf.build_pipeline(spec.model_fn, features, labels, harness.optimizer(FLAGS.optimizer), plan,
                                              options)
            for stage, reason in sorted(handle.function_fallbacks.items()):
                print(f"  stage {stage} is imported per micro-batch: {reason}")
            chose = "functions" if handle.function_call_ops else "clones"
            run_config = config if rewrite == "default" else handle.session_config(config)
            return handle.train_op, handle.initializer, run_config, chose

        (train_op, init, run_config, chose), build_s = timed(build)
        ops = len(graph.get_operations())
    init_s, first_s, step_s = _run(tf, graph, init, train_op, run_config)
    plan = "single" if micro_batches is None else f"straight{FLAGS.num_stages}-M{micro_batches}"
    if micro_batches is not None and rewrite != "functions":
        plan += f"-{rewrite}"
    return {"M": micro_batches, "plan": plan, "rewrite": rewrite if micro_batches is not None else None,
            "chose": chose if micro_batches is not None else None, "ops": ops, "build_s": build_s, "init_s": init_s,
            "first_step_s": first_s, "step_s": step_s}


def _print_row(row, plain, base):
    """One table row; base: the row of the first M measured with the same rewrite and, for the default, the same
    choice of clones or functions (for ops per extra M)."""
    total = row["build_s"] + row["init_s"] + row["first_step_s"]
    ratio = total / (plain["build_s"] + plain["init_s"] + plain["first_step_s"])
    extra = ""
    if base is not None and row["M"] != base["M"]:
        extra = f"{(row['ops'] - base['ops']) / (row['M'] - base['M']) / plain['ops']:.1%}"
    name = f"{row['plan']} ({row['chose']})" if row["rewrite"] == "default" else row["plan"]
    print(f"{name:32s} {row['ops']:8d} {row['build_s']:8.1f} {row['init_s']:7.1f} "
          f"{row['first_step_s']:10.1f} {row['step_s']:7.3f} {ratio:20.1f} {extra:>16s}", flush=True)


def main(argv):
    reject_arguments(argv)
    config = harness.virtual_cpus(FLAGS.num_stages)
    import tensorflow as tf

    import models

    spec = models.get_model(FLAGS.model, FLAGS.config, **models.parse_model_flags(FLAGS.model_flags))
    print(f"{FLAGS.model} ({FLAGS.model_flags}), global batch {FLAGS.global_batch_size}, {FLAGS.optimizer}, "
          f"{FLAGS.num_stages} virtual CPU devices")
    print(f"{'plan (single: plain TF)':32s} {'ops':>8s} {'build s':>8s} {'init s':>7s} {'1st step s':>10s} {'step s':>7s} "
          f"{'to 1st step / plain':>20s} {'ops per extra M':>16s}")
    unknown = set(FLAGS.rewrites) - {"default", "functions", "clones"}
    if unknown:
        raise ValueError(f"--rewrites takes default, functions and/or clones, got {sorted(unknown)}")
    micro_batches = [int(m) for m in FLAGS.micro_batches]
    progress = harness.Progress(1 + len(FLAGS.rewrites) * len(micro_batches), "rows (larger M take longer)")
    plain = measure(tf, spec, None, config)
    rows = [plain]
    _print_row(plain, plain, None)
    progress.advance()
    for rewrite in FLAGS.rewrites:
        bases = {}  # what the rewrite built (the default picks clones or functions by size) -> its first row
        for m in micro_batches:
            rows.append(measure(tf, spec, m, config, rewrite))
            _print_row(rows[-1], plain, bases.get(rows[-1]["chose"]))
            bases.setdefault(rows[-1]["chose"], rows[-1])
            progress.advance()
    harness.write_rows(FLAGS.json, rows)
    return 0


def run():
    run_main(main)


if __name__ == "__main__":
    run()

"""Issue 36's MobileNetV2 case: Keras 2 MobileNetV2 (alpha 0.35, no weights, 32x32x3, 10 classes; 155 layers by
`layers_by_scope(depth=1)`), plan 1:2 (layers 0-76 on one device, 77-154 replicated on two), M=1,
batch_norm="sync", batch 8, one SGD step at learning rate 0.1, against one device from the same initial weights.

Per draw (seed s: tf.keras.utils.set_random_seed, so the initial weights are the seed's): the largest weight difference of the pipelined step from one device's, and the model's
conditioning: the largest difference of one device's step from inputs scaled by 1 + 2^-22 (a round-off-sized
change) from its step on the inputs as they are. A draw fails when the pipelined difference exceeds
max(--tolerance, 2 x that conditioning); `--repeat` builds and runs the pipeline again and requires the same bits.

    python -m scripts.bench.fuzz.mobilenet_sync_bn --seeds=50 --load=1     # docs/performance.md, "Equivalence under stress"

TF 2.15 (Keras 2) only: Keras 3's MobileNetV2 builds other layers.
"""

import hashlib
import json
import time

from absl import flags

from scripts.bench.fuzz import fuzz_processes
from scripts.bench.harness import Progress, write_rows
from scripts.cli import run_main

flags.DEFINE_integer("seeds", 50, "Draws (seeds first_seed, first_seed + 1, ...).")
flags.DEFINE_integer("first_seed", 0, "Seed of the first draw.")
flags.DEFINE_integer("repeat", 1, "Pipelined runs per draw (their weights must agree bit for bit).")
flags.DEFINE_integer("load", 0, "Processes spinning a CPU core each meanwhile.")
flags.DEFINE_float("tolerance", 1e-3, "Largest weight difference that passes for a well-conditioned draw.")
flags.DEFINE_string("json", None, "Also write the rows here.")
FLAGS = flags.FLAGS

LAYERS, BATCH, LEARNING_RATE = 155, 8, 0.1
PERTURBATION = 2.0 ** -22


def _model_fn(features, labels):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    import dapple_tf  # pylint: disable=import-outside-toplevel

    keras = tf.keras
    with dapple_tf.collect_updates():
        keras.backend.set_learning_phase(1)
        net = keras.applications.MobileNetV2(alpha=0.35, weights=None, input_tensor=features, classes=10,
                                             classifier_activation=None)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=net.output))


def _step(seed, x, y, initial, build):
    """(initial weights, weights after one step, loss); `build(features, labels, optimizer)` -> (train_op, loss,
    variables, init_op, after_load_op or None, session config)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    with tf.Graph().as_default():
        tf.keras.utils.set_random_seed(seed)  # Keras 2 seeds unseeded initializers from Python's random module
        optimizer = tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE)
        train_op, loss, variables, init_op, after_load, config = build(tf.constant(x), tf.constant(y), optimizer)
        with tf.compat.v1.Session(config=config) as sess:
            sess.run(init_op)
            if initial is not None:
                for v in variables:
                    v.load(initial[v.op.name], sess)
                if after_load is not None:
                    sess.run(after_load)
            start = dict(zip([v.op.name for v in variables], sess.run(variables)))
            loss_value, _ = sess.run([loss, train_op])
            return start, dict(zip([v.op.name for v in variables], sess.run(variables))), float(loss_value)


def _single(features, labels, optimizer):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from dapple_tf.rewrite.pipeline import NO_DEADLINE  # pylint: disable=import-outside-toplevel

    loss = _model_fn(features, labels)
    variables = tf.compat.v1.trainable_variables()
    train_op = optimizer.apply_gradients(zip(tf.compat.v1.gradients(loss, variables), variables))
    config = tf.compat.v1.ConfigProto(device_count={"CPU": 4})
    config.graph_options.rewrite_options.meta_optimizer_timeout_ms = NO_DEADLINE  # as handle.session_config
    return train_op, loss, variables, tf.compat.v1.global_variables_initializer(), None, config


def _pipelined(features, labels, optimizer):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    import dapple_tf  # pylint: disable=import-outside-toplevel

    cut = LAYERS // 2
    plan = dapple_tf.Plan.from_stages([(0, cut - 1, ["/cpu:0"]), (cut, LAYERS - 1, ["/cpu:1", "/cpu:2"])],
                                      num_micro_batches=1)
    handle = dapple_tf.build_pipeline(_model_fn, features, labels, optimizer, plan,
                                      dapple_tf.PipelineOptions(batch_norm="sync"),
                                      layers=dapple_tf.layers_by_scope(depth=1))
    variables = [v for _, v in handle.grads_and_vars]
    config = handle.session_config(tf.compat.v1.ConfigProto(device_count={"CPU": 4}))
    return handle.train_op, handle.loss, variables, handle.initializer, handle.local_init_op, config


def _largest_difference(a, b):
    import numpy as np  # pylint: disable=import-outside-toplevel

    name = max(a, key=lambda k: float(np.abs(a[k] - b[k]).max()))
    return float(np.abs(a[name] - b[name]).max()), name


def _digest(weights) -> str:
    import numpy as np  # pylint: disable=import-outside-toplevel

    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(np.ascontiguousarray(weights[name]).tobytes())
    return h.hexdigest()[:16]


def draw(seed: int, repeat: int) -> dict:
    import numpy as np  # pylint: disable=import-outside-toplevel

    started = time.perf_counter()
    rng = np.random.RandomState(0)
    x = rng.rand(BATCH, 32, 32, 3).astype(np.float32)
    y = rng.randint(0, 10, BATCH).astype(np.int32)
    initial, want, want_loss = _step(seed, x, y, None, _single)
    _, moved, _ = _step(seed, (x * np.float32(1 + PERTURBATION)).astype(np.float32), y, initial, _single)
    runs = [_step(seed, x, y, initial, _pipelined) for _ in range(repeat)]
    difference, variable = _largest_difference(want, runs[0][1])
    conditioning, _ = _largest_difference(want, moved)
    return {"seed": seed, "difference": difference, "variable": variable, "conditioning": conditioning,
            "loss_difference": abs(runs[0][2] - want_loss), "digests": [_digest(r[1]) for r in runs],
            "seconds": time.perf_counter() - started}


def main(argv):
    del argv
    from scripts.cli import split_cpu  # pylint: disable=import-outside-toplevel

    split_cpu(4)
    rows, failures = [], 0
    progress = Progress(FLAGS.seeds, "draws")
    with fuzz_processes.Load(FLAGS.load):
        for seed in range(FLAGS.first_seed, FLAGS.first_seed + FLAGS.seeds):
            row = draw(seed, FLAGS.repeat)
            bound = max(FLAGS.tolerance, 2 * row["conditioning"])
            row["failed"] = row["difference"] > bound or len(set(row["digests"])) > 1
            failures += row["failed"]
            rows.append(row)
            progress.advance(f"seed {seed:3d}  {'FAIL' if row['failed'] else 'ok':4}  pipelined vs one device "
                             f"{row['difference']:.1e} ({row['variable']})  one device from inputs x (1 + 2^-22) "
                             f"{row['conditioning']:.1e}  loss {row['loss_difference']:.1e}  {row['seconds']:.0f} s")
    write_rows(FLAGS.json, rows)
    print(json.dumps({"draws": len(rows), "failed": failures,
                      "largest_difference": max(r["difference"] for r in rows),
                      "largest_conditioning": max(r["conditioning"] for r in rows)}))
    return 1 if failures else 0


def run():
    run_main(main)


if __name__ == "__main__":
    run()

"""What observing a script's training calls costs the template trace (dapple_tf/model/training_calls.py).

    python -m scripts.bench.runtime.trace_observer                          # BERT-24 at the paper's width
    python -m scripts.bench.runtime.trace_observer --model_flags=num_layers=2,hidden=16,heads=2,ffn=32 --rounds=2

build_pipeline calls model_fn once on placeholders with an op creation callback active. This builds the model's
graph (the forward alone, and the forward with `optimizer.minimize`, as a script's model_fn has it) with and
without the observer, in alternating rounds in one process, and prints each one's median seconds and the ratio.
"""

import contextlib
import statistics
import time

from absl import flags

from scripts.bench import harness
from scripts.cli import reject_arguments, run_main

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "bert", "Reference model.")
flags.DEFINE_string("config", "paper", "Reference model config.")
flags.DEFINE_string("model_flags", "num_layers=24", "Model overrides, k=v,...")
flags.DEFINE_integer("rounds", 4, "Rounds; each builds every variant once.")


def _trace_s(tf, spec, observe: bool, minimize: bool) -> float:
    from dapple_tf.model import training_calls

    with tf.Graph().as_default() as graph:
        features, labels = spec.placeholders(None)
        start = time.perf_counter()
        with training_calls.observe(graph) if observe else contextlib.nullcontext():
            loss = spec.model_fn(features, labels)
            if minimize:
                tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
        return time.perf_counter() - start


def main(argv):
    reject_arguments(argv)
    if FLAGS.rounds < 1:
        raise ValueError("--rounds must be >= 1")
    import tensorflow as tf

    import models

    tf.compat.v1.disable_eager_execution()
    spec = models.get_model(FLAGS.model, FLAGS.config, **models.parse_model_flags(FLAGS.model_flags))
    print(f"{FLAGS.model} {FLAGS.config} ({FLAGS.model_flags}), {FLAGS.rounds} rounds, medians")
    print(f"{'model_fn builds':<22} {'plain s':>8} {'observed s':>11} {'ratio':>6}")
    progress = harness.Progress(2 * FLAGS.rounds, "rounds (forward, then with minimize)", every_s=10)
    for minimize, label in ((False, "the forward"), (True, "forward + minimize")):
        samples = {False: [], True: []}
        for _ in range(FLAGS.rounds):
            for observe in (False, True):
                samples[observe].append(_trace_s(tf, spec, observe, minimize))
            progress.advance()
        plain, observed = statistics.median(samples[False]), statistics.median(samples[True])
        print(f"{label:<22} {plain:>8.2f} {observed:>11.2f} {observed / plain:>5.2f}x")


if __name__ == "__main__":
    run_main(main)

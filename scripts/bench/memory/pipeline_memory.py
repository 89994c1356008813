"""Peak memory and throughput of pipelined training: DAPPLE vs GPipe, with and without
re-computation (RC), as in the DAPPLE paper's Table 5.

Builds a 2-stage pipeline of an MLP with wide hidden layers on 2 virtual CPU devices and runs,
per (schedule, RC, M), a few steps with TF's BFC CPU allocator, reading the allocator's peak
(tf.config.experimental.get_memory_info) minus its use at the start of each step: the step's
activations and gradients (median over the steps: the two devices' overlap varies). The
micro-batch size is fixed (as in Table 5), so GPipe's peak grows with M and DAPPLE's stays flat
(from M=4: at M=2 its peak comes before any gradient is accumulated). On CPU every virtual device
shares one allocator, so the figure is the sum over both stages, not a per-device peak. The same
steps (fetching the loss and train_op, as a training loop does) give samples/s and process CPU
seconds per step (medians; on a shared machine both vary), and one traced step counts the MatMuls
that ran: the work RC adds (one forward per micro-batch), independent of the machine's load.

    python -m scripts.bench.memory.pipeline_memory                 # the grid and the paper's ratios
    python -m scripts.bench.memory.pipeline_memory --json=out.json # also machine-readable
"""

import re
import statistics
import sys
import time

from absl import flags

from scripts.bench import harness
from scripts.cli import run_main

harness.use_bfc_allocator()

FLAGS = flags.FLAGS
_MATMUL_LABEL = re.compile(r" = (_Mkl)?MatMul\(")  # step stats' timeline_label "[memory] name = Type(inputs)"
flags.DEFINE_integer("hidden", 512, "Width of the hidden layers.")
flags.DEFINE_integer("micro_batch_size", 256, "Samples per micro-batch (fixed while M varies).")
flags.DEFINE_list("micro_batches", ["2", "4", "8", "16"], "Values of M to measure.")
flags.DEFINE_list("recompute", ["off", "on"], "Re-computation settings to measure (off, on).")
flags.DEFINE_integer("layers", 6, "Hidden layers (split evenly over the 2 stages).")
flags.DEFINE_integer("layer_depth", 4, "tanh per hidden layer: activations each layer keeps for its backward.")
flags.DEFINE_integer("timed_steps", 5, "Steps measured per configuration (medians).")
flags.DEFINE_string("json", None, "Also write the measurements here.")

INPUT_WIDTH = 16
SCHEDULES = ("gpipe", "dapple")
MiB = 2**20

# Table 5 (BERT-48, 2 stages, micro-batch 2, config B): (schedule, RC, M) -> (samples/s, average peak GB).
PAPER = {
    ("gpipe", False, 2): (5.10, 12.1), ("gpipe", True, 2): (4.00, 9.9), ("gpipe", True, 5): (5.53, 13.2),
    ("dapple", False, 2): (5.10, 10.6), ("dapple", False, 8): (7.60, 10.6), ("dapple", False, 16): (8.18, 10.6),
    ("dapple", True, 2): (4.24, 8.5), ("dapple", True, 8): (6.23, 8.5), ("dapple", True, 16): (6.77, 8.5),
}


def model_fn_for(hidden, layers, depth):
    import tensorflow as tf

    import dapple_tf

    def model_fn(features, labels):
        h = features
        for i in range(layers):
            with dapple_tf.layer(f"hidden{i}"):
                w = tf.compat.v1.get_variable(
                    f"w{i}", [h.shape[1], hidden], initializer=tf.compat.v1.glorot_uniform_initializer()
                )
                h = tf.tanh(tf.matmul(h, w))
                for _ in range(depth - 1):  # more tensors backward keeps (tanh outputs), as in a real layer
                    h = tf.tanh(h * 1.01)
        with dapple_tf.layer("loss"):
            w = tf.compat.v1.get_variable("w_out", [hidden, 1])
            return tf.reduce_mean(tf.square(tf.matmul(h, w)[:, 0] - labels))

    return model_fn


def measure(schedule, num_micro_batches, recompute, hidden, micro_batch_size, layers, depth, timed_steps=3):
    """One configuration: peak bytes above the step's start, samples/s, CPU seconds and MatMuls per step."""
    import numpy as np
    import tensorflow as tf

    import dapple_tf

    n = micro_batch_size * num_micro_batches
    rng = np.random.RandomState(0)
    with tf.Graph().as_default():
        x = tf.constant(rng.randn(n, INPUT_WIDTH).astype(np.float32))
        y = tf.constant(rng.randn(n).astype(np.float32))
        half = layers // 2
        plan = harness.cpu_plan([(0, half - 1, [0]), (half, layers, [1])], num_micro_batches)
        handle = dapple_tf.build_pipeline(model_fn_for(hidden, layers, depth), x, y, harness.optimizer(), plan,
                                          dapple_tf.PipelineOptions(schedule=schedule, recompute=recompute,
                                                                    traced_functions=True))
        with tf.compat.v1.Session(config=handle.session_config(harness.cpu_config(2))) as sess:
            sess.run(handle.initializer)
            step = [handle.loss, handle.train_op]  # a training loop's fetches: the loss too
            sess.run(step)  # warm-up: allocator pools, constant folding
            walls, cpus, peaks = [], [], []
            for _ in range(timed_steps):
                start = tf.config.experimental.get_memory_info("CPU:0")["current"]
                tf.config.experimental.reset_memory_stats("CPU:0")
                wall, cpu = time.perf_counter(), time.process_time()
                sess.run(step)
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
                peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - start)
            metadata = tf.compat.v1.RunMetadata()
            options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
            sess.run(step, options=options, run_metadata=metadata)
            # by the kernel each node ran (its timeline label): stage functions' bodies are not in the graph
            matmuls = sum(
                bool(_MATMUL_LABEL.search(node.timeline_label))
                for dev in metadata.step_stats.dev_stats for node in dev.node_stats
            )
    return {
        "schedule": schedule, "recompute": recompute, "M": num_micro_batches, "peak_bytes": statistics.median(peaks),
        "samples_per_s": n / statistics.median(walls), "cpu_s_per_step": statistics.median(cpus),
        "matmuls_per_step": matmuls,
    }


def lookup(rows, schedule, recompute, m):
    return next((r for r in rows if (r["schedule"], r["recompute"], r["M"]) == (schedule, recompute, m)), None)


def paper_ratios(rows):
    """(what, ours, paper) for the ratios Table 5's text discusses, where both sides were measured."""
    ms = sorted({r["M"] for r in rows})
    lo, hi = ms[0], ms[-1]

    def ours(a, b, key):
        ra, rb = lookup(rows, *a), lookup(rows, *b)
        return ra[key] / rb[key] if ra and rb else None

    def paper(a, b, index):
        pa, pb = PAPER.get(a), PAPER.get(b)
        return pa[index] / pb[index] if pa and pb else None

    checks = []
    for s in SCHEDULES:
        checks.append((f"{s}: peak, RC / no RC, M={lo}", (s, True, lo), (s, False, lo), "peak_bytes", 1))
        checks.append((f"{s}: samples/s, RC / no RC, M={lo}", (s, True, lo), (s, False, lo), "samples_per_s", 0))
        checks.append((f"{s}: CPU s/step, RC / no RC, M={hi}", (s, True, hi), (s, False, hi), "cpu_s_per_step", None))
        checks.append((f"{s}: MatMuls/step, RC / no RC, M={hi}", (s, True, hi), (s, False, hi), "matmuls_per_step",
                       None))
    for rc in (False, True):
        tag = "+ RC " if rc else ""
        checks.append((f"dapple {tag}peak, M={hi} / M={lo}", ("dapple", rc, hi), ("dapple", rc, lo), "peak_bytes", 1))
    checks.append((f"dapple peak M={hi} / gpipe M={lo}", ("dapple", False, hi), ("gpipe", False, lo), "peak_bytes", 1))
    checks.append(
        (f"dapple samples/s M={hi} / gpipe M={lo}", ("dapple", False, hi), ("gpipe", False, lo), "samples_per_s", 0)
    )
    checks.append(
        (f"dapple + RC peak M={hi} / gpipe M={lo}", ("dapple", True, hi), ("gpipe", False, lo), "peak_bytes", 1)
    )
    result = []
    for what, a, b, key, index in checks:
        value = ours(a, b, key)
        if value is not None:
            result.append((what, value, None if index is None else paper(a, b, index)))
    return result


def main(argv):
    del argv
    harness.split_cpu(2)
    ms = [int(m) for m in FLAGS.micro_batches]
    settings = [{"off": False, "on": True}[r] for r in FLAGS.recompute]
    grid = [(s, rc, m) for s in SCHEDULES for rc in settings for m in ms]
    rows, progress = [], harness.Progress(len(grid), "measured")
    for s, rc, m in grid:
        rows.append(measure(s, m, rc, FLAGS.hidden, FLAGS.micro_batch_size, FLAGS.layers, FLAGS.layer_depth,
                            FLAGS.timed_steps))
        progress.advance(f"  {s}, RC {'on' if rc else 'off'}, M={m}")
    act = FLAGS.micro_batch_size * FLAGS.hidden * 4
    print(
        f"2 stages, {FLAGS.layers} hidden layers of {FLAGS.hidden} ({FLAGS.layer_depth} tanh each), "
        f"micro-batch {FLAGS.micro_batch_size} "
        f"(one activation = {act / MiB:.2f} MiB); step peak above its start, MiB, both stages together "
        "(TF BFC CPU allocator); paper: Table 5, BERT-48, average peak GB per device"
    )
    print(f"{'schedule':<9}{'RC':<4}{'M':>3} {'peak MiB':>9} {'samples/s':>10} {'CPU s/step':>11} {'MatMuls':>8}   "
          f"{'paper samples/s':>15} {'paper GB':>9}")
    for r in rows:
        paper = PAPER.get((r["schedule"], r["recompute"], r["M"]))
        paper_text = f"{paper[0]:>15.2f} {paper[1]:>9.1f}" if paper else f"{'-':>15} {'-':>9}"
        print(f"{r['schedule']:<9}{'on' if r['recompute'] else 'off':<4}{r['M']:>3} {r['peak_bytes'] / MiB:>9.1f} "
              f"{r['samples_per_s']:>10.0f} {r['cpu_s_per_step']:>11.3f} {r['matmuls_per_step']:>8}   {paper_text}")
    print(f"\n{'ratio':<42}{'ours':>7}{'paper':>7}")
    for what, value, paper in paper_ratios(rows):
        print(f"{what:<42}{value:>7.2f}{'-' if paper is None else f'{paper:.2f}':>7}")
    harness.write_rows(FLAGS.json, rows)
    return 0


def run():
    run_main(main)


if __name__ == "__main__":
    sys.exit(run())

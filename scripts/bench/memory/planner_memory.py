"""The planner's memory model against the runtime: estimated vs measured per-device peak.

For each reference model (tiny config): profile it at the micro-batch size (per-layer kept bytes and
one step's allocator peak, profiler/core.py), cut its layers in half into a 2-stage plan on 2 virtual
CPU devices, and compare per device:
- estimated: the planner's stage memory (planner/cost_model.memory_bytes: weights, the gradient
  running sum and one micro-batch's gradients, SGD keeps no optimizer state; K_i x micro-batch x
  kept bytes per sample with the schedule's K_i; the stage's model inputs for the global batch;
  one micro-batch of backward working memory beyond what the micro-batch's later layers have freed,
  memory_model.stage_working_bytes);
- measured: pipelined training steps of dapple_tf (schedule dapple) traced with RunMetadata step
  stats: the peak of the device's allocation records (allocations minus deallocations over time,
  TF's tracking allocator), median over 3 traced steps, plus the bytes of the variables and
  constants (the model inputs) placed on the device.

    python -m scripts.bench.memory.planner_memory [--models=mlp,bert] [--micro_batch_size=8] [--json=out.json]
"""

import sys

from absl import flags

from scripts.bench import harness
from scripts.cli import run_main

harness.use_bfc_allocator()

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mlp", "vgg19", "resnet50", "bert", "gnmt"], "Reference models (tiny configs).")
flags.DEFINE_integer("micro_batch_size", 8, "Samples per micro-batch (also the profile batch size).")
flags.DEFINE_integer("micro_batches", 4, "M of the 2-stage plan.")
flags.DEFINE_string("json", None, "Also write the rows here.")


def measured_peaks(spec, plan, global_batch, steps=3):
    """{device name: peak bytes} of a traced pipelined step (allocation records + variables): the median
    over `steps` traced steps, since the executor's op order moves a step's peak (VGG-19's first device:
    1.45-1.76 MiB between single steps)."""
    import statistics

    import tensorflow as tf

    import dapple_tf
    from dapple_tf.trace import step_stats

    x, y = spec.synthetic_batch(global_batch, seed=1)
    with tf.Graph().as_default():
        features = tf.nest.map_structure(tf.constant, x)
        labels = tf.nest.map_structure(tf.constant, y)
        handle = dapple_tf.build_pipeline(spec.model_fn, features, labels, harness.optimizer(), plan,
                                          dapple_tf.PipelineOptions(schedule="dapple", traced_functions=True))
        variables = tf.compat.v1.global_variables() + tf.compat.v1.local_variables()
        metas = []
        with tf.compat.v1.Session(config=handle.session_config(harness.cpu_config(2))) as sess:
            sess.run(handle.initializer)
            warmup = tf.compat.v1.RunMetadata()  # its partition graphs hold the constants each device keeps
            sess.run(handle.train_op, run_metadata=warmup,
                     options=tf.compat.v1.RunOptions(output_partition_graphs=True))
            for _ in range(steps):
                metas.append(tf.compat.v1.RunMetadata())
                sess.run(handle.train_op, run_metadata=metas[-1],
                         options=tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
        per_step = {}
        for meta in metas:
            for dev in meta.step_stats.dev_stats:
                records = sorted((r.alloc_micros, r.alloc_bytes) for node in dev.node_stats for mem in node.memory
                                 for r in mem.allocation_records)
                live = peak = 0
                for _, nbytes in records:
                    live += nbytes
                    peak = max(peak, live)
                per_step.setdefault("CPU:" + dev.device.rsplit(":", 1)[-1], []).append(peak)
        peaks = {name: statistics.median(values) for name, values in per_step.items()}
        for device, nbytes in step_stats.constant_bytes_per_device(warmup.partition_graphs).items():
            name = "CPU:" + device.rsplit(":", 1)[-1]
            peaks[name] = peaks.get(name, 0) + nbytes
        for v in variables:
            name = "CPU:" + (v.device.rsplit(":", 1)[-1] if v.device else "0")
            peaks[name] = peaks.get(name, 0) + v.shape.num_elements() * v.dtype.size
    return peaks


def measure(name, mbs, m):
    import dapple_tf
    import models
    import profiler
    from planner.planning import cost_model as cm
    from planner.formats.model_profile import ModelProfile

    spec = models.get_model(name, "tiny")
    profile = profiler.profile_spec(spec, mbs, warmup=0, runs=1, step_memory=True)
    model = ModelProfile.from_proto(profile)
    prefix = cm.Prefix(model)
    n = model.num_layers
    cut = n // 2
    plan = harness.cpu_plan([(0, cut - 1, [0]), (cut, n - 1, [1])], m)
    warmup = [min(2 - i, m) for i in range(2)]  # policy A, the runtime's default for from_stages plans
    estimated = [cm.memory_bytes(prefix, a, e, mbs, k, optimizer_multiplier=0.0, num_micro_batches=m)
                 for (a, e), k in zip([(0, cut), (cut, n)], warmup)]
    measured = measured_peaks(spec, plan, mbs * m)
    return {"model": name, "layers": n, "cut": cut, "estimated": estimated,
            "measured": [measured.get("CPU:0", 0), measured.get("CPU:1", 0)], "memory_source": model.memory_source}


def main(argv):
    del argv
    harness.split_cpu(2)
    rows, progress = [], harness.Progress(len(FLAGS.models), "models profiled and measured")
    for name in FLAGS.models:
        rows.append(measure(name, FLAGS.micro_batch_size, FLAGS.micro_batches))
        progress.advance(f"  {name}")
    print(f"2 stages (layers cut in half), micro-batch {FLAGS.micro_batch_size}, M={FLAGS.micro_batches}, "
          "schedule dapple; per-device peak, MiB (estimated by the planner / measured, TF step stats)")
    print(f"{'model':<10} {'dev0 est':>9} {'dev0 meas':>10} {'ratio':>6} {'dev1 est':>9} {'dev1 meas':>10} {'ratio':>6}")
    for r in rows:
        cells = []
        for est, meas in zip(r["estimated"], r["measured"]):
            cells += [f"{est / 2**20:>9.2f}", f"{meas / 2**20:>10.2f}", f"{est / meas if meas else 0:>6.2f}"]
        print(f"{r['model']:<10} " + " ".join(cells))
    harness.write_rows(FLAGS.json, rows)
    return 0


def run():
    run_main(main)


if __name__ == "__main__":
    sys.exit(run())

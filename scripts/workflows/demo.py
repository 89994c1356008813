"""The steps of dapple_demo, the end-to-end demo on this machine's CPU: the digits data, profiling the
reference MLP, planning it (the DAPPLE planner or a forced S-stage plan), building and training the
pipelined graph, the test accuracy and, measured on 2 pinned workers against one, the speedup of the planner's
choice and of 2-stage pipelines, ending with one sentence on which won and why.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Sequence, Tuple

import numpy as np


@dataclasses.dataclass(frozen=True)
class DemoSettings:
    """dapple_demo's flags (the same names and defaults; its --help says what each means)."""

    num_devices: int = 4
    num_stages: int = 0
    steps: int = 300
    global_batch_size: int = 64
    num_micro_batches: int = 4
    learning_rate: float = 0.01
    log_every: int = 50
    schedule: str = "dapple"
    seed: int = 0
    speedup: bool = True


@dataclasses.dataclass
class _Built:
    """The pipelined training graph, its feeds and the test-set predictions of its weights."""

    graph: object
    handle: object
    features: object
    labels: object
    predictions: object


def load_digits(seed):
    """scikit-learn's bundled digits (offline): (x_train, y_train, x_test, y_test), 80/20 split."""
    from sklearn.datasets import load_digits as sk_load_digits

    data = sk_load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(0.8 * len(x))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def forced_plan(profile, num_stages, devices, num_micro_batches):
    """An S-stage dapple_tf.Plan: cuts balancing profiled forward+backward time, devices split evenly."""
    import dapple_tf
    from planner.planning.baselines import balanced_partition

    n = len(profile.layers)
    if not 1 <= num_stages <= min(n, len(devices)):
        raise ValueError(f"--num_stages must be between 1 and {min(n, len(devices))} "
                         f"(layers: {n}, devices: {len(devices)}), got {num_stages}")
    costs = [layer.forward_ms + layer.backward_ms + 1e-6 for layer in profile.layers]
    cuts = sorted(balanced_partition(costs, list(range(1, n)), num_stages))
    for c in range(1, n):  # balanced_partition may use fewer blocks: add cuts until there are S
        if len(cuts) + 1 >= num_stages:
            break
        if c not in cuts:
            cuts = sorted(cuts + [c])
    bounds = [0] + cuts + [n]
    per = len(devices) // num_stages
    stages = [(bounds[i], bounds[i + 1] - 1, devices[i * per:(i + 1) * per]) for i in range(num_stages)]
    return dapple_tf.Plan.from_stages(stages, num_micro_batches=num_micro_batches), stages


def profile_step(spec, s: DemoSettings):
    """1. The MLP profiled layer by layer on /device:CPU:0 at one micro-batch, printed."""
    import profiler

    profile_batch = max(1, s.global_batch_size // max(1, s.num_micro_batches))
    profile = profiler.profile_spec(spec, profile_batch, "/device:CPU:0", model_name="mlp-digits")
    print(f"\n== profile (batch {profile_batch}, /device:CPU:0) ==")
    for layer in profile.layers:
        print(f"  {layer.name:8s} forward {layer.forward_ms:.3f} ms  backward {layer.backward_ms:.3f} ms  "
              f"activations {layer.activation_bytes:.0f} B  parameters {layer.parameter_bytes:.0f} B")
    return profile


def plan_step(profile, devices, s: DemoSettings):
    """2. The forced --num_stages plan, or the DAPPLE planner's for the local cluster, printed."""
    import dapple_tf
    from planner.planning import api as planner_api
    from planner.formats.cluster import local_cluster
    from planner.planning.report import summarize

    print("\n== plan ==")
    if s.num_stages:
        plan, stages = forced_plan(profile, s.num_stages, devices, s.num_micro_batches)
        print(f"forced {s.num_stages}-stage plan (--num_stages), M = {s.num_micro_batches} micro-batches:")
        for i, (first, last, devs) in enumerate(stages):
            print(f"  stage {i}: layers {first}-{last} ({profile.layers[first].name}..{profile.layers[last].name}),"
                  f" devices {', '.join(devs)}")
        return plan
    plan_proto = planner_api.plan(profile, local_cluster(s.num_devices), s.global_batch_size, planner="dapple")
    print(_with_ties_table(summarize(plan_proto), plan_proto))
    return dapple_tf.Plan.from_proto(plan_proto)


def _with_ties_table(report: str, plan_proto) -> str:
    """The planner's report with its one-line list of ties replaced by a short table (demo_verdict.ties_table_of)."""
    from planner.planning import ties
    from scripts.workflows import demo_verdict

    table = demo_verdict.ties_table_of(demo_verdict.proto_ties(plan_proto), plan_proto.profile_spread)
    if not table:
        return report
    return "\n".join(line for line in report.splitlines() if line != ties.text(plan_proto)) + "\n" + table


def build_step(spec, plan, x_test, s: DemoSettings) -> _Built:
    """3. The pipelined training graph of the plan, and the predictions on the test images; its schedule printed."""
    import tensorflow as tf

    import dapple_tf

    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(s.seed)
        features = tf.compat.v1.placeholder(tf.float32, [s.global_batch_size, 64], name="features")
        labels = tf.compat.v1.placeholder(tf.int32, [s.global_batch_size], name="labels")
        optimizer = tf.compat.v1.train.AdamOptimizer(s.learning_rate)
        handle = dapple_tf.build_pipeline(spec.model_fn, features, labels, optimizer, plan,
                                          dapple_tf.PipelineOptions(schedule=s.schedule))
        test_x = tf.constant(x_test)
        with tf.compat.v1.variable_scope("", reuse=True), dapple_tf.LayerRecorder(graph).activate():
            predictions = tf.argmax(spec.predict_fn(test_x), axis=1, output_type=tf.int32)
    print(f"\n== schedule (micro-batch size {handle.micro_batch_size}) ==")
    print(handle.schedule)
    return _Built(graph, handle, features, labels, predictions)


def train_step(built: _Built, x_train, y_train, y_test, s: DemoSettings) -> float:
    """4-5. Trains on random batches of the training split, printing loss and throughput; the test accuracy."""
    import tensorflow as tf

    print(f"\n== training: {s.steps} steps of {s.global_batch_size} samples on {s.num_devices} "
          "virtual CPU devices ==")
    config = tf.compat.v1.ConfigProto(device_count={"CPU": s.num_devices}, allow_soft_placement=False)
    rng = np.random.default_rng(s.seed)
    handle = built.handle
    with tf.compat.v1.Session(graph=built.graph, config=handle.session_config(config)) as sess:
        sess.run(handle.initializer)
        losses, interval_start = [], time.perf_counter()
        for step in range(1, s.steps + 1):
            idx = rng.choice(len(x_train), s.global_batch_size, replace=False)
            feed = {built.features: x_train[idx], built.labels: y_train[idx]}
            _, loss = sess.run([handle.train_op, handle.loss], feed)
            losses.append(loss)
            if step % s.log_every == 0 or step == s.steps:
                elapsed = time.perf_counter() - interval_start
                print(f"step {step:4d}  loss {np.mean(losses):.4f}  "
                      f"{len(losses) * s.global_batch_size / elapsed:8.0f} samples/s", flush=True)
                losses, interval_start = [], time.perf_counter()
        return float(np.mean(sess.run(built.predictions) == y_test))


SPEED_PLANS = ("single", "planner", "straight2-M2", "straight2-M4")
_HIDDEN = ("profile at", "dapple_launch:", "planner: ties:", "wrote ")


def speed_command(rows_path: str) -> List[str]:
    """The speed benchmark as the demo runs it: one worker, the planner's choice for 2 workers and straight 2-stage
    pipelines at M=2 and 4, profiled once, timed side by side in rounds; its rows written to `rows_path`."""
    return [sys.executable, "-m", "scripts.bench.speed.speedup", "--num_workers=2", "--micro_batches=2,4",
            f"--plans={','.join(SPEED_PLANS)}", "--gpipe=false", "--zero_bubble=false", "--interleaved=false",
            "--batched_w=false", "--steps=3", "--rounds=2", "--profile_rounds=3", f"--json={rows_path}"]


def _streamed(command: Sequence[str]) -> Tuple[int, List[str]]:
    """Runs `command`, printing the lines of its output the demo shows as they come; (exit code, its stderr's
    lines). Interrupted, it stops the command the way Ctrl-C would, so that the command stops its own processes."""
    with tempfile.TemporaryFile("w+") as errors:
        process = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=errors, text=True)
        try:
            for line in process.stdout:
                if not line.startswith(_HIDDEN):
                    print(line, end="", flush=True)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
            code = process.wait()
        errors.seek(0)
        return code, errors.read().splitlines()


def speedup_section() -> None:
    """6. The measured speedup over one pinned worker of the planner's choice for 2 workers and of 2-stage pipelines
    (scripts/bench/speed/speedup.py), the planner's ties and one sentence on which won and why; or why it is skipped."""
    from dapple_tf.cluster.servers import usable_cores
    from scripts.workflows import demo_verdict

    cores = len(usable_cores())
    if cores < 2:
        print(f"\n(speedup over one worker skipped: this machine has {cores} core; it needs 2 pinned workers)")
        return
    print("\n== speedup: 2 pinned worker processes (1 core each) vs one: the planner's choice and 2-stage pipelines, "
          "measured and simulated ==", flush=True)
    with tempfile.TemporaryDirectory(prefix="dapple_demo_rows_") as folder:
        rows_path = os.path.join(folder, "rows.json")
        code, errors = _streamed(speed_command(rows_path))
        if code:
            print(f"(the speedup benchmark failed: {errors[-1:]})")
            return
        with open(rows_path) as f:
            rows = json.load(f)
    ties = demo_verdict.ties_table(rows)
    if ties:
        print(ties)
    sentence = demo_verdict.verdict(rows)
    if sentence:
        print(sentence, flush=True)


def run_demo(s: DemoSettings, start: float) -> int:
    """The whole demo (the process's CPU already split into s.num_devices devices; `start`: its time.perf_counter() at
    the start, for the total time); returns the exit code."""
    import models

    x_train, y_train, x_test, y_test = load_digits(s.seed)
    print(f"data: scikit-learn digits, {len(x_train)} training and {len(x_test)} test images of 8x8 = 64 pixels")
    spec = models.get_model("mlp", "tiny")
    devices = [f"/device:CPU:{i}" for i in range(s.num_devices)]
    profile = profile_step(spec, s)
    plan = plan_step(profile, devices, s)
    built = build_step(spec, plan, x_test, s)
    accuracy = train_step(built, x_train, y_train, y_test, s)
    print(f"\ntest accuracy: {accuracy:.4f} ({len(y_test)} images); total time {time.perf_counter() - start:.1f} s")
    if s.speedup:
        speedup_section()
    return 0

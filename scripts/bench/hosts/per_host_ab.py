"""The default for plans over several tasks (issue 46): dapple_train on a local cluster of pinned workers, as one
graph driven by a chief against per host (`dapple_launch --per_host`), the two alternated round by round.

    python -m scripts.bench.hosts.per_host_ab                     # 3 rounds, straight and dp, MLP 784-4x1024-10
    python -m scripts.bench.hosts.per_host_ab --rounds=5 --plans=dp --steps=90

Each run is a whole `dapple_launch --cluster=local:2x1 [--per_host] -- dapple_train --plan=...` (2 workers pinned to
a core each, or as --cores_per_worker says); its steady step is the mean of dapple_train's progress windows after the first (the first holds the
warm-up), its wall time the launch's from start to exit. Plans (the paper config of the reference MLP, global batch
--global_batch_size):
- straight: dense_0-1 on task 0, dense_2-head on task 1, M=4 (--micro_batches);
- dp: the whole model on both tasks, M=1.
Prints each round's steps side by side (its progress and an estimate of what is left on stderr, out of the table) and, per plan, the medians and per host / one graph. With --cpu, also the
CPU each process of the launch used per step between the first and the last progress window (from /proc), by
thread group (the main thread: a client's Python loop; gRPC's threads; TF's others): where a pinned core's time goes.
"""

import os
import re
import statistics
import sys
import tempfile
import time

from absl import flags

from scripts.bench import harness
from scripts.bench.hosts import process_cpu
from scripts.cli import reject_arguments, run_main

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 3, "Rounds; each runs every plan both ways, the order alternating.")
flags.DEFINE_list("plans", ["straight", "dp"], "Plans: straight, dp (module docstring).")
flags.DEFINE_integer("steps", 60, "Steps per run (progress every steps / 3).")
flags.DEFINE_integer("global_batch_size", 128, "Samples per step.")
flags.DEFINE_integer("micro_batches", 4, "M of the straight plan (each micro-batch crosses between the tasks twice).")
flags.DEFINE_integer("cores_per_worker", 1, "dapple_launch's: each worker pinned to this many cores (0: unpinned).")
flags.DEFINE_integer("inter_op_threads", None, "dapple_launch's: each worker's inter-op threads (default: its cores "
                     "+ 1).")
flags.DEFINE_string("json", "", "Also write the rows here.")
flags.DEFINE_boolean("cpu", False, "Also print each process's CPU ms per step by thread group (module docstring).")

LAYERS = ["dense_0", "dense_1", "dense_2", "dense_3", "head"]
PLANS = {"straight": ([(0, 1, [0]), (2, 4, [1])], 4), "dp": ([(0, 4, [0, 1])], 1)}
_WINDOW = re.compile(r"step (\d+)/\d+ .* ([\d.]+) ms/step")


def write_plan(path: str, name: str, batch: int) -> str:
    from planner.formats import plan_pb2, write_message  # pylint: disable=import-outside-toplevel
    from planner.formats.cluster import local_task_cluster  # pylint: disable=import-outside-toplevel

    stages, micro_batches = PLANS[name]
    micro_batches = FLAGS.micro_batches if name == "straight" else micro_batches
    plan = plan_pb2.Plan(model_name="mlp", planner="manual", global_batch_size=batch,
                         num_micro_batches=micro_batches, micro_batch_size=batch // micro_batches,
                         schedule=plan_pb2.DAPPLE)
    plan.cluster.CopyFrom(local_task_cluster(2, 1, memory_bytes=1e9))
    for first, last, ids in stages:
        plan.stages.add(first_layer=first, last_layer=last, layer_names=LAYERS[first:last + 1], device_ids=ids)
    write_message(plan, path)
    return path


def windows_ms(lines) -> list:
    """dapple_train's ms/step of each progress window."""
    windows = [float(m.group(2)) for m in map(_WINDOW.search, lines) if m]
    if len(windows) < 2:
        raise RuntimeError("the run printed fewer than two progress windows:\n" + "".join(lines[-20:]))
    return windows


def run_once(plan_path: str, per_host: bool, steps: int) -> dict:
    train = ["dapple_train", "--model=mlp", "--config=paper", f"--plan={plan_path}", f"--steps={steps}",
             f"--log_every={max(1, steps // 3)}", "--summary_every=0", "--save_checkpoints_steps=0"]
    started = time.perf_counter()
    launcher = [f"--cores_per_worker={FLAGS.cores_per_worker}"] + (["--per_host"] if per_host else [])
    if FLAGS.inter_op_threads is not None:
        launcher.append(f"--inter_op_threads={FLAGS.inter_op_threads}")
    snapshots = []

    def on_line(line):
        found = _WINDOW.search(line)
        if FLAGS.cpu and found:
            snapshots.append((int(found.group(1)), process_cpu.snapshot(plan_path)))

    code, lines = harness.stream_command(harness.launch_command("local:2x1", train, *launcher), on_line)
    if code:
        raise RuntimeError(f"dapple_launch exited with {code}:\n" + "".join(lines[-30:]))
    windows = windows_ms(lines)
    row = {"step_ms": statistics.mean(windows[1:]), "windows_ms": windows, "wall_s": time.perf_counter() - started}
    if FLAGS.cpu and len(snapshots) >= 2:
        row["cpu_ms_per_step"] = process_cpu.per_step(snapshots[0], snapshots[-1])
    return row


def main(argv):
    reject_arguments(argv)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        plans = {name: write_plan(os.path.join(folder, f"{name}.json"), name, FLAGS.global_batch_size)
                 for name in FLAGS.plans}
        print("| round | plan | one graph ms/step | per host ms/step | per host / one graph | wall s one graph | "
              "per host |\n|---|---|---|---|---|---|---|", flush=True)
        progress = harness.Progress(FLAGS.rounds * len(plans), "rounds x plans (A and B each)",
                                    log=lambda text: print(text, file=sys.stderr, flush=True))  # not in the table
        for r in range(FLAGS.rounds):
            for name, path in plans.items():
                order = (False, True) if r % 2 == 0 else (True, False)
                got = {per_host: run_once(path, per_host, FLAGS.steps) for per_host in order}
                row = {"round": r, "plan": name, "one_graph": got[False], "per_host": got[True]}
                rows.append(row)
                print(f"| {r} | {name} | {got[False]['step_ms']:.1f} | {got[True]['step_ms']:.1f} | "
                      f"{got[True]['step_ms'] / got[False]['step_ms']:.2f}x | {got[False]['wall_s']:.1f} | "
                      f"{got[True]['wall_s']:.1f} |", flush=True)
                progress.advance()
    if FLAGS.cpu:
        process_cpu.print_table(rows)
    for name in plans:
        one = statistics.median(row["one_graph"]["step_ms"] for row in rows if row["plan"] == name)
        per = statistics.median(row["per_host"]["step_ms"] for row in rows if row["plan"] == name)
        print(f"{name}: median step one graph {one:.1f} ms, per host {per:.1f} ms: {per / one:.2f}x")
    harness.write_rows(FLAGS.json, rows)


if __name__ == "__main__":
    run_main(main)

"""Ops per process and time to first step: one graph for the whole cluster against one graph per host (issue 46).

    python -m scripts.bench.hosts.per_host_scale                          # N = 2, 4, 8, 16 local worker processes
    python -m scripts.bench.hosts.per_host_scale --tasks=2 --plans=dp --steps=30 --cores_per_worker=1

For each N and plan this starts N worker processes (a server each, --devices_per_task virtual CPU devices), then
- in-graph: this process builds the whole cluster's graph and drives every step from one session (today's runtime);
- per-host: every worker builds only its own part (PipelineOptions(own_task=...)), one worker at a time (each build
  as on a host of its own: on 2 cores N building processes would share them), then all start their sessions at once
  (dapple_tf.cluster.host_session) and step them.
Each row prints the ops of the in-graph client's graph and of the largest per-host graph; the time to the first
step: in-graph from the start of the build to the end of the first step, per host the slowest worker's build plus
its start (session, initialization and first step, all workers at once: on 2 cores it grows with N); per host,
the slowest worker's build and start, and "own hosts": the slowest build plus the most CPU seconds any worker's
start took (about what the first step would take on hosts of their own: every worker waits for the slowest
build, then its start is its own work, but for the first step's waits along the pipeline); the steady step
(median; per host: the slowest worker's). Plans, each with the same work per task at every N:
- dp: a 9-layer MLP (hidden --width), every task a replica, 16 samples each;
- straight: N one-layer stages (the last also holds the loss), one per task, M=4 micro-batches of 16;
- hybrid: N/2 one-layer stages, each replicated on two tasks, M=4 micro-batches of 32.
--json also keeps each worker's figures. Every worker traces the whole model (the straight and hybrid plans' grows
by a layer per stage) and builds its own part of the pipeline.

    python -m scripts.bench.hosts.per_host_scale --tasks=2,16 --crowd     # and N=2 as 8 clusters of 2 at once

--crowd adds, per smaller N, a per-host row "N x K": K = max(N) / N independent clusters of N workers each, built
one worker at a time and started at once, figures over all K * N workers. It is the smaller N with the largest's
crowd: as many processes share the 2 cores at the start, and its slowest build is the slowest of as many. Beside
it, what the larger N adds is what its plan adds, not what the machine's crowding adds.

    python -m scripts.bench.hosts.per_host_scale --paper_plan     # no cluster: one task's graph of a 512 x 8 plan

--paper_plan builds, without running it, the per-host graph of chosen tasks for the plan DAPPLE's planner makes for
BERT-48 (the published profile) on 512 servers of 8 GPUs, global batch 8192 (3 stages of 1024, 1024 and 2048
replicas, M=2; 220 s of planning, so its shape is given here), on the 50-layer BERT of models.bert at tiny widths
(operations do not depend on widths), the profile's stage boundaries (layers 0-14, 15-31, 32-52 of 53) mapped to
layers 0-13, 14-30, 31-49; prints each task's operations and build time beside the one graph's estimate.
"""

import json
import os
import statistics
import subprocess
import sys
import time
from typing import List

from absl import flags

from scripts.bench import harness
from scripts.cli import reject_arguments, run_main

FLAGS = flags.FLAGS
flags.DEFINE_list("tasks", ["2", "4", "8", "16"], "Worker process counts N.")
flags.DEFINE_list("plans", ["dp", "straight", "hybrid"], "Plans: dp, straight, hybrid (module docstring).")
flags.DEFINE_integer("devices_per_task", 1, "Virtual CPU devices per worker (plans use device 0).")
flags.DEFINE_integer("width", 64, "Hidden units per layer.")
flags.DEFINE_integer("steps", 6, "Steps per run, the first included; the steady step is the median of the rest.")
flags.DEFINE_integer("cores_per_worker", 0, "Pin worker i to its own cores (0: no pinning).")
flags.DEFINE_string("json", "", "Also write the rows here.")
flags.DEFINE_boolean("crowd", False, "Also run each smaller N per host as max(N) / N clusters at once (docstring).")
flags.DEFINE_boolean("paper_plan", False, "Build per-host graphs of BERT-48 on 512 x 8 GPUs instead (docstring).")
flags.DEFINE_list("paper_tasks", ["0", "128", "256"], "With --paper_plan: the tasks whose graphs are built.")
flags.DEFINE_integer("as_worker", -1, "Internal: run worker task N of --workers.")
flags.DEFINE_list("workers", [], "Internal: the workers' addresses.")

TIMEOUT_S = 300


def _case(plan: str, n: int, width: int):
    """(model spec, global batch, plan) of a row, the same in every process."""
    import dapple_tf  # pylint: disable=import-outside-toplevel
    import models  # pylint: disable=import-outside-toplevel

    def device(task):
        return f"/job:worker/replica:0/task:{task}/device:CPU:0"

    if plan == "dp":
        spec = models.get_model("mlp", "tiny", hidden=[width] * 8, input_dim=width)
        return spec, 16 * n, dapple_tf.Plan.from_stages([(0, 8, [device(t) for t in range(n)])], 1)
    num_stages = n if plan == "straight" else n // 2
    spec = models.get_model("mlp", "tiny", hidden=[width] * num_stages, input_dim=width)
    bounds = [(s, s) for s in range(num_stages - 1)] + [(num_stages - 1, num_stages)]  # the last stage + the head
    replicas = 1 if plan == "straight" else 2
    stages = [(a, b, [device(s * replicas + r) for r in range(replicas)]) for s, (a, b) in enumerate(bounds)]
    return spec, 64 * replicas, dapple_tf.Plan.from_stages(stages, 4)


def _build(plan: str, n: int, own_task=None):
    """(handle, build CPU seconds) of a row's pipeline in the default graph."""
    import dapple_tf  # pylint: disable=import-outside-toplevel

    start = time.process_time()
    spec, batch, pipeline_plan = _case(plan, n, FLAGS.width)
    features, labels = harness.synthetic_batch(spec, batch)
    handle = dapple_tf.build_pipeline(spec.model_fn, features, labels, harness.optimizer("sgd"), pipeline_plan,
                                      dapple_tf.PipelineOptions(own_task=own_task))
    return handle, time.process_time() - start


def _run(session, handle, start: float, steps: int) -> dict:
    """Steps the session; the first step's end (from `start`) and the steady steps' median, seconds."""
    fetch = handle.train_op
    session.run(fetch)
    first = time.perf_counter() - start
    durations, cpu = [], time.process_time()
    for _ in range(steps - 1):
        began = time.perf_counter()
        session.run(fetch)
        durations.append(time.perf_counter() - began)
    return {"first_step_s": first, "step_s": statistics.median(durations) if durations else None,
            "steps_cpu_s": time.process_time() - cpu}


def worker() -> int:
    """A worker task: its server, then per request line one per-host run of its part: it builds its graph, says so
    ({"built": seconds}), waits for a line "run", starts its session and steps it; one JSON line back."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from dapple_tf.cluster import host_session  # pylint: disable=import-outside-toplevel
    from dapple_tf.cluster.servers import server_config, session_config  # pylint: disable=import-outside-toplevel

    import dapple_tf  # pylint: disable=import-outside-toplevel,unused-import  # imported before the timed builds
    import models  # pylint: disable=import-outside-toplevel,unused-import

    spec = tf.train.ClusterSpec({"worker": list(FLAGS.workers)})
    server = tf.distribute.Server(spec, "worker", FLAGS.as_worker, config=server_config(FLAGS.devices_per_task))
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            with tf.Graph().as_default() as graph:
                start = time.perf_counter()
                handle, build_cpu = _build(request["plan"], request["n"],
                                           f"/job:worker/replica:0/task:{FLAGS.as_worker}")
                built = time.perf_counter() - start
                print(json.dumps({"built": built}), flush=True)
                if sys.stdin.readline().strip() != "run":
                    return 0
                config = handle.session_config(session_config(TIMEOUT_S))
                start, start_cpu = time.perf_counter(), time.process_time()
                with tf.compat.v1.Session(server.target, config=config) as sess:
                    session_cpu = time.process_time() - start_cpu
                    host_session.start(sess, handle, TIMEOUT_S)
                    initialize_cpu = time.process_time() - start_cpu - session_cpu
                    row = _run(sess, handle, start, request["steps"])
                    start_cpu = time.process_time() - start_cpu - row.pop("steps_cpu_s")
            print(json.dumps(dict(row, ops=len(graph.get_operations()), build_s=built, build_cpu_s=build_cpu,
                                  start_cpu_s=start_cpu, start_cpu_parts={
                                      "session": session_cpu, "initialize": initialize_cpu,
                                      "first_step": start_cpu - session_cpu - initialize_cpu})), flush=True)
        except Exception as e:  # pylint: disable=broad-except  # the chief names the task and its error
            message = [l for l in getattr(e, "message", str(e)).strip().splitlines() if l.strip() and "error:" not in l.lower()[:30]]
            print(json.dumps({"error": f"{type(e).__name__}: {message[0] if message else ''}"}), flush=True)
    return 0


def _in_graph(plan: str, n: int, target: str) -> dict:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from dapple_tf.cluster.servers import session_config  # pylint: disable=import-outside-toplevel

    with tf.Graph().as_default() as graph:
        start = time.perf_counter()
        handle, build_cpu = _build(plan, n)
        with tf.compat.v1.Session(target, config=handle.session_config(session_config(TIMEOUT_S))) as sess:
            sess.run(handle.initializer)
            row = _run(sess, handle, start, FLAGS.steps)
    tf.compat.v1.Session.reset(target)  # the variables live in the workers until reset
    return dict(row, ops=len(graph.get_operations()), build_cpu_s=build_cpu)


def _start_workers(n: int):
    from dapple_tf.cluster.servers import free_ports, worker_cores  # pylint: disable=import-outside-toplevel

    addresses = [f"127.0.0.1:{p}" for p in free_ports(n)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    processes = []
    for task in range(n):
        cores = worker_cores(task, FLAGS.cores_per_worker) if FLAGS.cores_per_worker else ()
        command = harness.module_command("scripts.bench.hosts.per_host_scale", f"--as_worker={task}",
                                         f"--workers={','.join(addresses)}",
                                         f"--devices_per_task={FLAGS.devices_per_task}", f"--width={FLAGS.width}")
        processes.append(subprocess.Popen(["taskset", "-c", ",".join(map(str, cores)), *command] if cores else command,
                                          env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    for task, process in enumerate(processes):
        line = process.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"worker {task} did not start (pid {process.pid}, exit {process.poll()})")
    return addresses, processes


def _stop(processes) -> None:
    for process in processes:
        if process.stdin and not process.stdin.closed:
            process.stdin.close()
    deadline = time.monotonic() + 10
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _row(plan: str, n: int, clusters: int = 1) -> dict:
    """A row: in-graph, then per host. clusters > 1: no in-graph run; per host, that many independent clusters of n
    workers build one worker at a time and start at once (the machine as crowded as by clusters * n workers), the
    figures taken over all their workers."""
    started = []
    try:
        for _ in range(clusters):
            started.append(_start_workers(n))
        one = _in_graph(plan, n, f"grpc://{started[0][0][0]}") if clusters == 1 else None
        hosts = _per_host([p for _, processes in started for p in processes], plan, n)
    finally:
        _stop([p for _, processes in started for p in processes])
    return {"plan": plan, "tasks": n, "clusters": clusters, "in_graph": one, "per_host": {
        "ops": max(h["ops"] for h in hosts), "build_s": max(h["build_s"] for h in hosts),
        "build_cpu_s": max(h["build_cpu_s"] for h in hosts), "start_s": max(h["first_step_s"] for h in hosts),
        "first_step_s": max(h["build_s"] + h["first_step_s"] for h in hosts),
        "start_cpu_s": max(h["start_cpu_s"] for h in hosts),
        "own_hosts_s": max(h["build_s"] for h in hosts) + max(h["start_cpu_s"] for h in hosts),
        "step_s": max(h["step_s"] for h in hosts), "tasks": hosts}}


def _per_host(processes, plan: str, n: int) -> List[dict]:
    """Each worker's figures: builds one at a time (each as on a host of its own), then all start at once. Raises
    RuntimeError naming the workers (cluster, task) that failed."""
    built = []
    for process in processes:
        process.stdin.write(json.dumps({"plan": plan, "n": n, "steps": FLAGS.steps}) + "\n")
        process.stdin.flush()
        built.append(json.loads(process.stdout.readline() or '{"error": "exited"}'))
        if "error" in built[-1]:
            break
    else:
        for process in processes:
            process.stdin.write("run\n")
            process.stdin.flush()
    hosts = [json.loads(process.stdout.readline() or '{"error": "exited"}') if "error" not in b else b
             for process, b in zip(processes, built)]
    name = (lambda i: f"worker {i}") if len(processes) == n else (lambda i: f"cluster {i // n} worker {i % n}")
    failed = [f"{name(i)}: {h['error']}" for i, h in enumerate(hosts) if "error" in h]
    if failed:
        raise RuntimeError(f"{plan} on {n} tasks, per host: " + "; ".join(failed))
    return hosts


HEADER = (f"{'':<14} {'ops (largest graph)':>17} {'to 1st step s':>19} {'per host, s':>29} {'step ms':>17}\n"
          f"{'plan':<9} {'N':>4} {'in-graph':>8} {'per-host':>8} {'in-graph':>9} {'per-host':>9} {'build':>9} "
          f"{'start':>9} {'own hosts':>9} {'in-graph':>8} {'per-host':>8}")


def _print(row: dict) -> None:
    one, hosts = row["in_graph"], row["per_host"]
    tasks = str(row["tasks"]) if row["clusters"] == 1 else f"{row['tasks']}x{row['clusters']}"
    ops, first, step = (f"{one['ops']:>8}", f"{one['first_step_s']:>9.2f}", f"{one['step_s'] * 1e3:>8.1f}") if one \
        else (f"{'-':>8}", f"{'-':>9}", f"{'-':>8}")
    print(f"{row['plan']:<9} {tasks:>4} {ops} {hosts['ops']:>8} {first} {hosts['first_step_s']:>9.2f} "
          f"{hosts['build_s']:>9.2f} {hosts['start_s']:>9.2f} {hosts['own_hosts_s']:>9.2f} {step} "
          f"{hosts['step_s'] * 1e3:>8.1f}", flush=True)


PAPER_STAGES = ((0, 13, 1024), (14, 30, 1024), (31, 49, 2048))  # (first layer, last layer, replicas)


def paper_plan() -> int:
    """Per-host graphs of the planner's BERT-48 plan on 512 x 8 GPUs (module docstring), built, not run."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    import dapple_tf  # pylint: disable=import-outside-toplevel
    import models  # pylint: disable=import-outside-toplevel

    tf.compat.v1.disable_eager_execution()
    spec = models.get_model("bert", "tiny", num_layers=48)
    stages, first_device = [], 0
    for first, last, replicas in PAPER_STAGES:
        devices = [f"/job:worker/replica:0/task:{d // 8}/device:GPU:{d % 8}"
                   for d in range(first_device, first_device + replicas)]
        stages.append((first, last, devices))
        first_device += replicas
    plan = dapple_tf.Plan.from_stages(stages, 2)
    print(f"BERT-48 (50 layers), 512 x 8 GPUs, stages {[r for _, _, r in PAPER_STAGES]}, M=2, global batch 8192")
    for task in map(int, FLAGS.paper_tasks):
        with tf.Graph().as_default() as graph:
            start = time.perf_counter()
            features, labels = harness.synthetic_batch(spec, 8192)
            dapple_tf.build_pipeline(spec.model_fn, features, labels, harness.optimizer("adam"), plan,
                                     dapple_tf.PipelineOptions(own_task=f"/job:worker/replica:0/task:{task}"))
            took = time.perf_counter() - start
        print(f"task {task:>3}: {len(graph.get_operations()):>7} ops, built in {took:.1f} s", flush=True)
    return 0


def main(argv):
    reject_arguments(argv)
    if FLAGS.as_worker >= 0:
        return worker()
    if FLAGS.paper_plan:
        return paper_plan()
    print(HEADER)
    counts = list(map(int, FLAGS.tasks))
    units = [(plan, n, 1) for n in counts for plan in FLAGS.plans if not (plan == "hybrid" and n % 2)]
    if FLAGS.crowd:
        units = [u for plan, n, _ in units for u in [(plan, n, 1)] + (
            [(plan, n, max(counts) // n)] if n < max(counts) and max(counts) % n == 0 else [])]
    rows, progress = [], harness.Progress(len(units), "rows (larger N take longer)")
    for plan, n, clusters in units:
        rows.append(_row(plan, n, clusters))
        _print(rows[-1])
        progress.advance()
    harness.write_rows(FLAGS.json, rows)
    return 0


if __name__ == "__main__":
    run_main(main)

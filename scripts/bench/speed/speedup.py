"""Speedup over one device, measured on separate pinned workers, beside the simulator's prediction.

    python -m scripts.bench.speed.speedup                            # MLP 8 x 1024, batch 1024, 2+ workers, 5-9 plans
    python -m scripts.bench.speed.speedup --full                     # every plan (40 on 2 workers) and the peers
    python -m scripts.bench.speed.speedup --model=bert --global_batch_size=64 --json=rows.json --trace_dir=t

It starts N worker processes through dapple_launch's local cluster (each pinned to its own
`--cores_per_worker` cores, thread pools sized for them, one device each) and runs itself as the
chief. The chief
1. profiles the model on one pinned core set (dapple_profile in a pinned process, at every
   micro-batch slice size the plans use, side by side: each of --profile_rounds rounds measures every layer of
   every size once, so the machine's slow moments fall on all sizes alike), and prints each size's spread over
   the rounds and its per-sample cost over the whole batch's, round by round,
2. measures the link between two workers and the runtime's AllReduce across all of them
   (dapple_tf.cluster.link_probe: latency and bandwidth through gRPC) and describes the cluster to the
   planner with them,
3. measures the plans (scripts/bench/speed/speedup_plans.py): by default a small set sized to --budget_minutes
   (scripts/bench/speed/speedup_sizing.py: single, dp<N>, straight2-M4, straight2-M8, planner, and up to four more on
   a fast machine; the timing rounds from the profile's single step, then from the plans' measured steps); with
   --full every plan: the single worker (baseline), data parallel on N, straight pipelines of 2..N stages for
   every M in DAPPLE and GPipe order and their variants, and the plan the planner chooses from the profiles
   (planner.planning.api.plan_from_profiles: DAPPLE's or a baseline's). Every phase prints its progress and an
   estimate of what is left. For each plan it prints samples/s, speedup over the single worker, the ideal
   speedup, the simulated step time from the profile, measured / simulated, and the peak memory of every worker.
   Every plan is built once in its own graph, its variables in a resource container of its own, and all
   sessions stay open: `--rounds` rounds each run `--steps` steps of every plan in turn (the median of
   the rounds is kept); the peak memory and the trace come from one more step of each plan alone on the
   workers.
4. says, one line per plan, where its speedup goes (scripts/bench/speed/speedup_budget.py): the ideal, the
   slices' per-sample cost over the whole batch's and the workers' shared machine (what is left after
   compute), then transfers and AllReduce down to the simulated speedup, and the measured one beside it.
5. then (with --full, or named in --plans) runs the peers (scripts/bench/speed/speedup_peers.py): TensorFlow's
   MultiWorkerMirroredStrategy and Horovod, data parallel on the same pinned cores, threads, model and batch
   (rows mwms<N>, horovod<N>, and each on one worker), and prints dp<N>'s speedup beside theirs.
`--json` writes the rows; `--trace_dir` writes each plan's measured timeline (Chrome trace) and a
PNG with the measured timeline above the simulated one. Every process it starts is stopped when it
ends (dapple_launch's teardown), also when a worker dies (the launcher names it).
"""

import json
import os
import tempfile
import time

from absl import flags

from scripts.bench import harness
from scripts.bench.speed import speedup_peers, speedup_sizing
from scripts.cli import reject_arguments, run_main

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "mlp", "Reference model (mlp, bert, vgg19, ...).")
flags.DEFINE_string("config", None, "Reference model config (default: the model's bench config below).")
flags.DEFINE_string("model_flags", None, "Model overrides key=value,... (default for mlp: 8 layers of 1024, "
                    "input 1024; bert: 8 layers, hidden 128, seq 64).")
flags.DEFINE_integer("global_batch_size", None, "Samples per step (default: mlp 1024, others 64).")
flags.DEFINE_integer("num_workers", None, "Worker processes (default: this machine's cores / --cores_per_worker, "
                     "at least 2).")
flags.DEFINE_integer("cores_per_worker", 1, "Cores each worker is pinned to.")
flags.DEFINE_integer("intra_op_threads", None, "Workers' intra-op threads (default: dapple_launch's).")
flags.DEFINE_integer("inter_op_threads", None, "Workers' inter-op threads (default: dapple_launch's).")
flags.DEFINE_list("micro_batches", ["1", "2", "4", "8", "16"], "M of the straight pipelines.")
flags.DEFINE_list("plans", None, "Only these plans, e.g. single,dp2,straight2-M8,gpipe2-M8,planner,mwms2,horovod2 "
                  "(default: single, dp<N>, straight2-M4, straight2-M8, planner and, as the budget allows, a few "
                  "more: scripts/bench/speed/speedup_sizing.py; mwms<N> and horovod<N> are the peers: "
                  "scripts/bench/speed/speedup_peers.py).")
flags.DEFINE_boolean("full", False, "Measure every plan (40 on 2 workers: every M, GPipe, zero-bubble, interleaved "
                     "and batched-W variants) and the peers, instead of the default set.")
flags.DEFINE_float("budget_minutes", speedup_sizing.DEFAULT_BUDGET_MINUTES, "Minutes the whole run should take: the "
                   "default set and the timing rounds are sized to it from the measured single step (explicit "
                   "--plans, --rounds, --steps win).", lower_bound=0)
flags.DEFINE_boolean("gpipe", True, "Also measure every pipeline in GPipe order.")
flags.DEFINE_boolean("zero_bubble", True, "Also measure every pipeline in the zero-bubble orders (zb-h1, zb-h2) and "
                     "their baseline, DAPPLE's order with each backward in TF's order (-fused).")
flags.DEFINE_boolean("interleaved", True, "Also measure every pipeline interleaved: each worker holding two stages "
                     "(interleaved<S>-M<m>, where S divides m).")
flags.DEFINE_boolean("batched_w", True, "Also measure single-M<m> and every pipeline with the weight gradients of all "
                     "micro-batches stacked at the end (schedule dapple-batched-w).")
flags.DEFINE_enum("optimizer", "sgd", ["sgd", "adam"], "Optimizer.")
flags.DEFINE_enum("stage_functions", "auto", ["auto", "true", "false"],
                  "build_pipeline's stage_functions: auto (its default), true (each stage built once as functions) "
                  "or false (each stage imported per micro-batch).")
flags.DEFINE_float("allreduce_bucket_mb", None, "Gradient AllReduce bucket size (default: build_pipeline's).")
flags.DEFINE_integer("steps", None, "Timed steps per plan and round (after a warm-up step); the median is kept "
                     f"(default: {speedup_sizing.DEFAULT_STEPS}).", lower_bound=1)
flags.DEFINE_integer("rounds", None, "Time the plans in this many rounds, each running --steps steps of every plan in "
                     "turn (every plan's session stays open), and keep each plan's median: a machine whose speed "
                     "drifts over seconds to minutes then slows every plan alike (default: as many as --budget_minutes "
                     f"holds, {speedup_sizing.MIN_ROUNDS}-{speedup_sizing.MAX_ROUNDS}).", lower_bound=1)
flags.DEFINE_string("json", None, "Write the rows to this JSON file.")
flags.DEFINE_string("trace_dir", None, "Write each plan's measured timeline (Chrome trace) and measured-vs-"
                    "simulated PNG here.")
flags.DEFINE_string("profile_dir", None, "Keep the profiles here (default: a temporary folder, removed at the end).")
flags.DEFINE_integer("profile_rounds", 5, "Interleaved rounds of the profiles (dapple_profile --rounds): every size "
                     "measured in each.", lower_bound=1)
flags.DEFINE_boolean("as_chief", False, "Internal: run as the chief under dapple_launch.")
flags.DEFINE_float("started_at", None, "Internal: the bench's start (time.time()), for the budget.")
flags.DEFINE_integer("peer_runs", 0, "Internal: peer runs after the chief's plans, for the estimate.")

DEFAULTS = {  # model -> (config, model_flags, global batch)
    "mlp": ("tiny", "input_dim=1024,hidden=" + ":".join(["1024"] * 8) + ",num_classes=10", 1024),
    "bert": ("tiny", "num_layers=8,hidden=128,heads=2,ffn=512,seq_len=64,max_positions=64,vocab_size=1000", 64),
}


def model_args():
    config, model_flags, batch = DEFAULTS.get(FLAGS.model, ("tiny", "", 64))
    return (FLAGS.config or config, model_flags if FLAGS.model_flags is None else FLAGS.model_flags,
            FLAGS.global_batch_size or batch)


def num_workers() -> int:
    from dapple_tf.cluster.servers import usable_cores

    return FLAGS.num_workers or max(2, len(usable_cores()) // max(1, FLAGS.cores_per_worker))


def main(argv):
    reject_arguments(argv)
    if FLAGS.as_chief:
        from scripts.bench.speed import speedup_chief

        return speedup_chief.run(FLAGS, model_args())
    started_at = time.time()
    n = num_workers()
    if n < 2:
        raise ValueError(f"--num_workers={n}: a speedup needs at least 2 workers")
    if FLAGS.full and FLAGS.plans:
        raise ValueError("--full measures every plan: give it or --plans, not both")
    own_plans, peer_kinds = speedup_sizing.plan_choice(FLAGS.plans, FLAGS.full, n)
    with tempfile.TemporaryDirectory(prefix="bench_speedup_rows_") as folder:
        rows_path = os.path.abspath(FLAGS.json) if FLAGS.json else os.path.join(folder, "rows.json")
        rows = []
        if own_plans is None or own_plans:
            code = _run_chief(n, own_plans, rows_path, started_at, 2 * len(peer_kinds))
            if code:
                return code
            with open(rows_path) as f:
                rows = json.load(f)
        if peer_kinds:
            single_ms = next((r["measured_ms"] for r in rows if r["plan"] == "single"), None)
            peers = speedup_peers.rows(_peer_settings(rows), peer_kinds, n, single_ms)
            _compare(rows, peers, n)
            rows += peers
        harness.write_rows(FLAGS.json, rows)
    return 0


def _run_chief(n: int, plans, rows_path: str, started_at: float, peer_runs: int) -> int:
    """The benchmark's own plans, run by the chief of a local cluster of n pinned workers; rows to `rows_path`."""
    config, model_flags, batch = model_args()
    passed = [f"--model={FLAGS.model}", f"--config={config}", f"--model_flags={model_flags}",
              f"--global_batch_size={batch}", f"--num_workers={n}", f"--cores_per_worker={FLAGS.cores_per_worker}",
              f"--micro_batches={','.join(FLAGS.micro_batches)}", f"--optimizer={FLAGS.optimizer}",
              f"--full={FLAGS.full}", f"--budget_minutes={FLAGS.budget_minutes}", f"--started_at={started_at}",
              f"--peer_runs={peer_runs}", f"--gpipe={FLAGS.gpipe}", f"--zero_bubble={FLAGS.zero_bubble}",
              f"--interleaved={FLAGS.interleaved}", f"--batched_w={FLAGS.batched_w}",
              f"--profile_rounds={FLAGS.profile_rounds}",
              f"--stage_functions={FLAGS.stage_functions}", "--as_chief", f"--json={rows_path}"]
    passed += [f"--{name}={getattr(FLAGS, name)}" for name in ("steps", "rounds") if getattr(FLAGS, name)]
    if FLAGS.allreduce_bucket_mb is not None:
        passed.append(f"--allreduce_bucket_mb={FLAGS.allreduce_bucket_mb}")
    if plans:
        passed.append(f"--plans={','.join(plans)}")
    for name in ("trace_dir", "profile_dir"):
        if getattr(FLAGS, name):
            passed.append(f"--{name}={os.path.abspath(getattr(FLAGS, name))}")
    threads = [f"--{name}={getattr(FLAGS, name)}" for name in ("intra_op_threads", "inter_op_threads")
               if getattr(FLAGS, name) is not None]
    launch = harness.launch_command(f"local:{n}x1", harness.module_command("scripts.bench.speed.speedup", *passed),
                                    f"--cores_per_worker={FLAGS.cores_per_worker}", *threads, "--grace=30")
    written = f"[chief] wrote {rows_path}"  # said once, by main, for --json; a temporary file otherwise
    code, _ = harness.stream_command(launch, lambda line: None if line.startswith(written) else _shown(line))
    return code


def _peer_settings(rows) -> speedup_peers.PeerSettings:
    """The peers' settings: as many timed steps as each of the chief's plans had (its `rows`; without them, the
    flags' or their defaults)."""
    from dapple_tf.cluster.roles import worker_threads

    config, model_flags, batch = model_args()
    threads = worker_threads(FLAGS.cores_per_worker, FLAGS.intra_op_threads, FLAGS.inter_op_threads)
    steps = (rows[0]["steps"] * len(rows[0]["rounds_ms"]) if rows else
             (FLAGS.steps or speedup_sizing.DEFAULT_STEPS) * (FLAGS.rounds or speedup_sizing.MIN_ROUNDS))
    return speedup_peers.PeerSettings(FLAGS.model, config, model_flags, batch, FLAGS.optimizer, FLAGS.cores_per_worker,
                                      threads.intra_op, threads.inter_op, steps)


def _compare(rows, peers, n: int) -> None:
    """One line: data parallel on n workers, ours beside the peers' (speedups over `single`)."""
    ours = next((r for r in rows if r["plan"] == f"dp{n}"), None)
    theirs = [p for p in peers if p["workers"] == n and p["speedup"]]
    if ours and theirs:
        print(f"dp{n} {ours['speedup']:.2f}x over single, " + ", ".join(
            f"{p['plan']} {p['speedup']:.2f}x (dp{n} / {p['plan']}: {ours['speedup'] / p['speedup']:.2f})"
            for p in theirs), flush=True)


def _shown(line):
    """What the launcher's output shows: the chief's lines (unprefixed), the launcher's own and errors."""
    if line.startswith("[chief] "):
        return line[len("[chief] "):]
    return line if line.startswith("dapple_launch:") or "error" in line.lower() else None


def run():
    run_main(main)


if __name__ == "__main__":
    run()

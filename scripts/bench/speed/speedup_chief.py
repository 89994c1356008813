"""The chief of scripts/bench/speed/speedup.py: profile, link, plans, measurements, rows.

Runs under dapple_launch (TF_CONFIG names the pinned workers). See bench_speedup's docstring; what it measures is
sized by scripts/bench/speed/speedup_sizing.py, and every phase that repeats (profile rounds, plans built, sessions
started, timing rounds) prints its progress with an estimate of what is left (harness.Progress).
"""

import dataclasses
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import zlib
from typing import Dict, List

from scripts.bench import harness
from scripts.bench.speed import speedup_budget, speedup_plans, speedup_sizing

WARMUP_STEPS = 3


def profile_sizes(global_batch_size: int, micro_batches, num_workers: int, names=None) -> List[int]:
    """Every slice size the plans run: the global batch, global batch / M, and (when data-parallel or
    planner plans are measured) the data-parallel slice."""
    sizes = {global_batch_size} | {global_batch_size // int(m) for m in micro_batches
                                   if global_batch_size % int(m) == 0}
    if not names or any(n.startswith(("dp", "planner")) for n in names):
        sizes.add(-(-global_batch_size // num_workers))
    return sorted(sizes)


def _profile(flags_, model_args, cores, sizes, pattern: str) -> None:
    """dapple_profile at every size side by side (interleaved rounds) into `pattern` ({batch_size} in it), in a
    process pinned to `cores`; a progress line after each of its rounds."""
    config, model_flags, _ = model_args
    command = harness.module_command(
        "scripts.dapple_profile", f"--model={flags_.model}", f"--config={config}",
        f"--model_flags={model_flags}", f"--batch_sizes={','.join(str(b) for b in sizes)}",
        f"--rounds={flags_.profile_rounds}", f"--threads={len(cores)}", f"--output={pattern}")
    print(f"profiling at batch {', '.join(map(str, sizes))}, {flags_.profile_rounds} rounds", flush=True)
    progress = harness.Progress(flags_.profile_rounds, "profile rounds")
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: os.sched_setaffinity(0, set(cores)))
    errors = []
    for line in process.stderr:  # dapple_profile's progress: "round r/R: whole step ..." after each round
        errors = (errors + [line])[-40:]
        if line.startswith("round ") and progress.done < progress.total:
            progress.advance()
    if process.wait():
        raise RuntimeError(f"profiling at batch {sizes} failed:\n{''.join(errors)[-2000:]}")


def measure_profiles(flags_, model_args, cores, sizes, folder) -> Dict[int, str]:
    """Profiles the model at every size side by side, in --profile_rounds interleaved rounds, in a process pinned to
    `cores` (a worker's cores, idle meanwhile); prints each size's whole step and spread, and the per-sample cost
    of each slice size over the whole batch's, round by round (profiles_text)."""
    config, model_flags, _ = model_args
    # kept profiles are reused only for the same model, config, flags, cores, rounds and sizes
    key = zlib.crc32(f"{flags_.model}|{config}|{model_flags}|{len(cores)}|{flags_.profile_rounds}|"
                     f"{','.join(map(str, sizes))}".encode()) & 0xFFFFFFFF
    pattern = os.path.join(folder, f"{flags_.model}-{key:08x}-bs{{batch_size}}.pbtxt")
    paths = {size: pattern.replace("{batch_size}", str(size)) for size in sizes}
    if not all(os.path.exists(p) for p in paths.values()):
        _profile(flags_, model_args, cores, sizes, pattern)
    kept = "" if flags_.profile_dir else " (removed at the end; --profile_dir keeps them)"
    print(f"profiles at batch {', '.join(map(str, sizes))}: {pattern}{kept}", flush=True)
    print(profiles_text(paths), flush=True)
    return paths


def profiles_text(paths: Dict[int, str]) -> str:
    """Each profile's whole step and spread over its rounds, and each slice size's per-sample cost over the whole
    batch's: the median of the rounds' ratios (each round measured both) and their range."""
    from planner.formats.profile import load_profile

    profiles = {size: load_profile(path) for size, path in paths.items()}
    batch = max(profiles)
    whole = profiles[batch]
    lines = []
    for size, p in sorted(profiles.items()):
        line = (f"  batch {size}: whole step {p.step_ms:.1f} ms, spread {p.relative_spread:.1%} over "
                f"{p.timing_rounds} rounds")
        ratios = [(s / size) / (w / batch) for s, w in zip(p.step_ms_rounds, whole.step_ms_rounds) if s > 0 and w > 0]
        if size != batch and ratios:  # rounds whose net step was 0 (a model smaller than a run's overhead) left out
            line += (f"; per sample {statistics.median(ratios):.2f}x the whole batch's "
                     f"(rounds {min(ratios):.2f}-{max(ratios):.2f})")
        lines.append(line)
    return "\n".join(lines)


def profile_for(plan: speedup_plans.BenchPlan, profiles: Dict[int, str]) -> str:
    """The profile measured at the size of the plan's largest slice (the nearest one measured)."""
    from planner.planning.api import largest_slice_of, nearest_profile_size

    return profiles[nearest_profile_size(profiles, largest_slice_of(plan.proto))]


def stacked_profile_for(plan: speedup_plans.BenchPlan, profiles: Dict[int, str]):
    """For a batched-w plan, the profile measured at its stacked rows (M x the largest slice; the nearest one
    measured), which costs its W tasks; None for other plans."""
    from planner.formats.schedule import BATCHED_W, schedule_kind
    from planner.planning.api import largest_slice_of, nearest_profile_size

    if schedule_kind(plan.proto.schedule) != BATCHED_W:
        return None
    return profiles[nearest_profile_size(profiles, plan.proto.num_micro_batches * largest_slice_of(plan.proto))]


@dataclasses.dataclass
class OpenPlan:
    """A plan built in its own graph (and a session on the workers while it is timed)."""
    plan: speedup_plans.BenchPlan
    graph: object
    handle: object
    container: str
    session: object = None


def build_plan(spec, plan, global_batch_size, optimizer_name, container, bucket_mb=None,
               stage_functions="auto") -> OpenPlan:
    """Builds `plan` in a graph of its own whose variables live in the workers' resource container `container`,
    so that several plans' sessions can stay open side by side."""
    import tensorflow as tf

    import dapple_tf

    runtime_plan = dapple_tf.Plan.from_proto(plan.proto)
    graph = tf.Graph()
    with graph.as_default(), graph.container(container):
        with tf.device(runtime_plan.stages[0].devices[0]):
            features, labels = harness.synthetic_batch(spec, global_batch_size)
        optimizer = harness.optimizer(optimizer_name)
        bucket = None if bucket_mb is None else bucket_mb * 2**20
        functions = {"auto": None, "true": True, "false": False}[stage_functions]
        handle = dapple_tf.build_pipeline(spec.model_fn, features, labels, optimizer, runtime_plan,
                                          dapple_tf.PipelineOptions(allreduce_bucket_bytes=bucket,
                                                                    stage_functions=functions,
                                                                    input_gradients_first=plan.input_gradients_first))
    return OpenPlan(plan, graph, handle, container)


def _started_session(graph, handle, target, config):
    """(a session of the plan, initialized and warmed up; seconds its last warm-up step took)."""
    import tensorflow as tf

    session = tf.compat.v1.Session(target, graph=graph, config=handle.session_config(config))
    session.run(handle.initializer)
    for _ in range(WARMUP_STEPS):
        _, step_s = harness.timed(lambda: session.run(handle.train_op))
    return session, step_s


def time_in_rounds(opened: List[OpenPlan], target, config, rounds: int, steps: int,
                   deadline: float = None) -> Dict[str, List[float]]:
    """{plan name: median step ms of each round}: every plan's session open at once (each started and warmed up),
    every round runs `steps` steps of each plan in turn, so that a machine whose speed drifts over seconds to
    minutes slows every plan alike; then the sessions are closed and the workers' variables dropped. Progress lines
    after each session started and each round. With a `deadline` (time.time()), no round is started, after
    speedup_sizing.MIN_ROUNDS, that would end past it by the rounds' mean (the machine slowed since the sizing)."""
    from profiler.timing import median_run_ms

    started = harness.Progress(len(opened), "sessions started")
    for o in opened:
        o.session, _ = _started_session(o.graph, o.handle, target, config)
        started.advance()
    times = {o.plan.name: [] for o in opened}
    progress = harness.Progress(rounds, "rounds")
    for r in range(rounds):
        for o in opened:
            times[o.plan.name].append(median_run_ms(o.session, o.handle.train_op, warmup=1, runs=steps))
        progress.advance(f"  round {r + 1} of {rounds}: " + ", ".join(f"{name} {ms[-1]:.1f}"
                                                                     for name, ms in times.items()))
        if speedup_sizing.stop_timing(r + 1, rounds, progress.elapsed_s(), time.time(), deadline):
            print(f"  stopped after round {r + 1} of {rounds}: another would end past the budget (the machine slowed "
                  "since the sizing)", flush=True)
            break
    for o in opened:
        o.session.close()
        o.session = None
    free_workers(target, [o.container for o in opened])
    return times


def traced_step(o: OpenPlan, target, config):
    """(peak bytes per device, RunMetadata, seconds of its last warm-up step) of one traced step of `o` alone on the
    workers: a session, initialized and warmed up, then its variables dropped."""
    import tensorflow as tf

    from dapple_tf.trace.step_stats import peak_bytes_per_device

    session, step_s = _started_session(o.graph, o.handle, target, config)
    metadata = tf.compat.v1.RunMetadata()
    session.run(o.handle.train_op, options=tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
                run_metadata=metadata)
    session.close()
    free_workers(target, [o.container])
    return peak_bytes_per_device(metadata.step_stats), metadata, step_s


def free_workers(target: str, containers=None) -> None:
    """Drops the variables the workers hold in the default resource container and in `containers` (variables
    outlive a session on a cluster; a reset without names clears the default container only), so that the next
    plan's peak memory is its own."""
    import tensorflow as tf

    tf.compat.v1.Session.reset(target)
    if containers:
        tf.compat.v1.Session.reset(target, list(containers))


def model_step(spec, batch_size):
    """One forward + backward of the model on `batch_size` synthetic samples (its gradient ops)."""
    import tensorflow as tf

    features, labels = harness.synthetic_batch(spec, batch_size)
    loss = spec.model_fn(features, labels)
    grads = tf.gradients(loss, tf.compat.v1.trainable_variables(scope=tf.compat.v1.get_variable_scope().name))
    return [tf.convert_to_tensor(g).op for g in grads if g is not None]


def planner_cluster(num_workers: int, link, allreduce_bandwidth: float, slowdown: float = 1.0) -> object:
    """The workers as the planner sees them: one device per server, the measured link and AllReduce between
    servers, communication done by the workers' own cores."""
    from planner.formats.cluster import local_task_cluster

    cluster = local_task_cluster(num_workers, 1)
    cluster.inter_server_bandwidth = link.bandwidth
    cluster.allreduce_bandwidth = allreduce_bandwidth
    cluster.concurrent_compute_slowdown = slowdown
    return cluster


HEADER = (f"{'plan':24s} {'samples/s':>10s} {'ms':>8s} {'speedup':>8s} {'ideal':>6s} {'sim ms':>8s} "
          f"{'meas/sim':>8s}  peak MiB per worker")


def plan_budget(plan, profiles: Dict[int, str], batch: int, slowdown: float, single_sim_ms: float,
                sim_ms: float) -> speedup_budget.SpeedupBudget:
    """The plan's ideal, slice, sharing and simulated factors (scripts/bench/speed/speedup_budget.py)."""
    from planner.simulation.sim_adapter import model_profile

    stacked = stacked_profile_for(plan, profiles)
    return speedup_budget.speedup_budget(
        plan.ideal_speedup, plan.num_devices, model_profile(profile_for(plan, profiles)),
        model_profile(profiles[batch]), slowdown, single_sim_ms, sim_ms,
        stacked_model=None if stacked is None else model_profile(stacked))


def rounds_text(rounds: int) -> str:
    return (f", median of {rounds} rounds (every plan's session open; each round runs every plan in turn)"
            if rounds > 1 else "")


def sized(flags_, plans, num_workers: int, step_s: float, left_s: float) -> speedup_sizing.Sizing:
    """What to measure (scripts/bench/speed/speedup_sizing.py) of `plans` (every plan there is): --plans, every
    plan with --full, else the default set; sized to the budget's `left_s` for a single step of `step_s` seconds."""
    if flags_.plans:
        required, extras = [p.name for p in selected(plans, flags_.plans)], []
    elif flags_.full:
        required, extras = [p.name for p in plans], []
    else:
        required, extras = speedup_sizing.default_plans(num_workers, [p.name for p in plans])
    return speedup_sizing.size_run(step_s, left_s, required, extras, flags_.rounds, flags_.steps,
                                   peer_runs=flags_.peer_runs)


def whole_step_s(profile_path: str) -> float:
    """The profile's whole step (seconds), else the sum of its layers' forward and backward."""
    from planner.formats.profile import load_profile

    profile = load_profile(profile_path)
    return (profile.step_ms or sum(layer.forward_ms + layer.backward_ms for layer in profile.layers)) / 1e3


def row_text(row) -> str:
    peaks = " ".join(f"{p / 2**20:.0f}" for p in row["peak_bytes"])
    return (f"{row['plan']:24s} {row['samples_per_s']:10.0f} {row['measured_ms']:8.1f} {row['speedup']:8.2f} "
            f"{row['ideal_speedup']:6.2f} {row['simulated_ms']:8.1f} {row['measured_over_simulated']:8.2f}  {peaks}")


def selected(plans, names):
    """The plans named (all when `names` is empty); ValueError naming an unknown one."""
    if not names:
        return plans
    known = {p.name for p in plans}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--plans: no plan named {', '.join(unknown)}; the plans are {', '.join(sorted(known))}")
    return [p for p in plans if p.name in names]


def run(flags_, model_args) -> int:
    """Profiles, plans, builds and times every plan; the profiles stay in --profile_dir, or in a temporary folder
    removed at the end."""
    if flags_.profile_dir:
        return _run(flags_, model_args, flags_.profile_dir)
    folder = tempfile.mkdtemp(prefix="bench_speedup_")
    try:
        return _run(flags_, model_args, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _run(flags_, model_args, folder) -> int:
    import tensorflow as tf

    import models
    from dapple_tf.cluster.servers import TFCluster, session_config, wait_for_workers, worker_cores
    from dapple_tf.cluster.link_probe import measure_allreduce, measure_concurrent_slowdown, measure_link

    config_name, model_flags, batch = model_args
    n = flags_.num_workers
    cluster = TFCluster.from_tf_config()
    wait_for_workers(cluster, 120)
    devices = [cluster.device(i, "CPU", 0) for i in range(n)]
    spec = models.get_model(flags_.model, config_name, **models.parse_model_flags(model_flags))
    os.makedirs(folder, exist_ok=True)
    start = time.perf_counter()
    started_at = flags_.started_at or time.time()  # the bench's start (its launcher's), for the budget
    budget_s = flags_.budget_minutes * 60
    sizes = profile_sizes(batch, flags_.micro_batches, n, flags_.plans)
    profiles = measure_profiles(flags_, model_args, worker_cores(0, flags_.cores_per_worker), sizes, folder)
    session = session_config(300)
    link = measure_link(cluster.target, session, devices[0], devices[1])
    allreduce = measure_allreduce(cluster.target, session, devices)
    slowdown = measure_concurrent_slowdown(cluster.target, session, devices, lambda: model_step(spec, batch // n))
    print(f"link worker 0 <-> 1: latency {link.latency_s * 1e6:.0f} us, bandwidth {link.bandwidth / 1e9:.2f} GB/s; "
          f"AllReduce on {n} workers: {allreduce / 1e9:.2f} GB/s (ring formula); all workers computing at once: "
          f"{slowdown:.3f}x slower", flush=True)
    free_workers(cluster.target)
    pcluster = planner_cluster(n, link, allreduce, slowdown)
    base_profile = profiles[batch]
    plans = speedup_plans.bench_plans(base_profile, pcluster, batch, n, [int(m) for m in flags_.micro_batches],
                                      gpipe=flags_.gpipe, zero_bubble=flags_.zero_bubble,
                                      interleaved=flags_.interleaved, batched_w=flags_.batched_w)
    plans.append(speedup_plans.planner_plan(profiles, pcluster, batch))
    _print_ties(plans[-1])
    single_sim = speedup_plans.simulate(plans[0], base_profile).iteration_ms
    step_s = whole_step_s(base_profile)
    sizing = sized(flags_, plans, n, step_s, budget_s - (time.time() - started_at))
    plans = selected(plans, sizing.plans)
    print(f"{flags_.model} ({model_flags}), global batch {batch}, {n} workers x {flags_.cores_per_worker} core(s), "
          f"{flags_.optimizer}; setup {time.perf_counter() - start:.0f} s", flush=True)
    print(f"measuring {sizing.text(step_s, flags_.budget_minutes, 'the profile')}", flush=True)
    opened, traced, rounds, steps = _build_and_time(flags_, spec, plans, batch, sizing, step_s, cluster.target, session,
                                                    started_at + budget_s)
    rows, single_ms, budgets, term_lines = [], None, [], []
    for o in opened:
        plan, handle = o.plan, o.handle
        peaks, metadata = traced[plan.name]
        ms = statistics.median(rounds[plan.name])
        single_ms = single_ms or (ms if plan.name == "single" else None)
        profile = profile_for(plan, profiles)
        simulated = speedup_plans.simulate(plan, profile, stacked_profile=stacked_profile_for(plan, profiles))
        sim = simulated.iteration_ms
        row = {"plan": plan.name, "stages": speedup_plans.describe(plan), "measured_ms": ms, "simulated_ms": sim,
               "samples_per_s": batch / ms * 1e3, "speedup": (single_ms / ms) if single_ms else float("nan"),
               "ideal_speedup": plan.ideal_speedup, "measured_over_simulated": ms / sim,
               "peak_bytes": [peaks.get(d, 0) for d in devices], "profile": os.path.basename(profile),
               "rounds_ms": rounds[plan.name], "steps": steps}
        budget = plan_budget(plan, profiles, batch, slowdown, single_sim, sim)
        row.update(simulated_speedup=budget.simulated, speedup_after_compute=budget.after_compute,
                   slice_slowdown=budget.slices, ties=_ties_rows(plan.proto), profile_spread=plan.proto.profile_spread)
        row["round_speedups"] = ([a / b for a, b in zip(rounds["single"], rounds[plan.name])]
                                 if "single" in rounds else [])
        budgets.append((plan.name, budget, row["speedup"], row["round_speedups"]))
        term_lines.append((plan.name, _terms(row, metadata, handle, simulated)))
        if not rows:
            print(HEADER, flush=True)
        rows.append(row)
        print(row_text(row), flush=True)
        if flags_.trace_dir:
            write_timelines(flags_.trace_dir, plan, metadata, handle, simulated)
    _print_where(budgets, term_lines)
    harness.write_rows(flags_.json, rows)
    del tf
    return 0


def _build_and_time(flags_, spec, plans, batch: int, sizing, step_s: float, target, config, ends_at: float):
    """Builds and traces every plan (progress lines), sizes the timing again from their measured steps (unless --rounds
    was given; to end by `ends_at`, a time.time()) and times them: (the OpenPlans, {name: (peak bytes per device,
    RunMetadata)}, {name: median ms of each round}, the steps per round)."""
    opened, traced, steps_s = [], {}, []
    building = harness.Progress(len(plans), "plans built and traced")
    timing_s = speedup_sizing.estimate_s(len(plans), sizing.rounds, sizing.steps, step_s, built=True)
    for i, plan in enumerate(plans):
        opened.append(build_plan(spec, plan, batch, flags_.optimizer, f"bench_plan_{i}", flags_.allreduce_bucket_mb,
                                 flags_.stage_functions))
        peaks, metadata, plan_step_s = traced_step(opened[-1], target, config)
        traced[plan.name] = peaks, metadata
        steps_s.append(plan_step_s)
        building.advance(f"  built and traced {plan.name}",
                         then=f"then ~{harness.duration_text(timing_s)} to time them")
    measured_s = statistics.mean(steps_s)
    sizing = speedup_sizing.size_run(measured_s, ends_at - time.time(), sizing.plans, (), flags_.rounds, sizing.steps,
                                     built=True, peer_runs=flags_.peer_runs)
    print(f"timing {sizing.text(measured_s, flags_.budget_minutes, 'the mean of the plans measured', plans=False)}"
          f"; each plan's median of {sizing.steps} steps{rounds_text(sizing.rounds)}", flush=True)
    deadline = None if flags_.rounds else ends_at - speedup_sizing.after_timing_s(
        len(plans), sizing.rounds, sizing.steps, measured_s, flags_.peer_runs)
    return opened, traced, time_in_rounds(opened, target, config, sizing.rounds, sizing.steps, deadline), sizing.steps


def _print_ties(plan) -> None:
    from planner.planning import ties

    if ties.text(plan.proto):
        print(f"planner: {ties.text(plan.proto).strip()}", flush=True)


def _ties_rows(proto) -> list:
    """The plan's ties for --json: [description, simulated ms], the plan itself first; [] without ties."""
    from planner.planning import ties

    if not proto.ties:
        return []
    return [[ties.describe(proto), proto.simulated_iteration_ms]] + [[t.description, t.simulated_iteration_ms]
                                                                     for t in proto.ties]


def _print_where(budgets, term_lines) -> None:
    """Per plan: where its speedup goes, then which term its traced step misses."""
    print("Where the speedup goes (scripts/bench/speed/speedup_budget.py):", flush=True)
    width = max(len(b[0]) for b in budgets)
    for name, budget, measured, per_round in budgets:
        print(f"  {name:{width}s}  {budget.text(measured, per_round)}", flush=True)
    print("Where the traced step differs from the simulated one (planner/simulation/terms.py; means per lane):",
          flush=True)
    for name, text in term_lines:
        print(f"  {name:{width}s}  {text}", flush=True)


def _terms(row, metadata, handle, simulated) -> str:
    """The traced step and the simulated one split into compute, transfers, AllReduce and bubble (added to `row`)."""
    from dapple_tf.trace import timeline
    from planner.simulation import terms

    try:
        measured = terms.step_terms(timeline.measured_timeline(metadata, handle))
    except ValueError as e:
        return f"no traced timeline ({e})"
    predicted = terms.step_terms(simulated)
    row.update(terms_measured=measured.as_dict(), terms_simulated=predicted.as_dict(),
               most_off=terms.disagreement(measured, predicted)[0])
    return terms.disagreement_text(measured, predicted)


def write_timelines(folder, plan, metadata, handle, simulated) -> None:
    """The measured timeline as a Chrome trace, and a PNG of it above the simulated one."""
    from dapple_tf.trace import timeline

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{plan.name}.run_metadata.pb"), "wb") as f:
        f.write(metadata.SerializeToString())
    measured = timeline.measured_timeline(metadata, handle)
    timeline.write_measured_trace(measured, os.path.join(folder, f"{plan.name}.trace.json"))
    for i, (a, b) in enumerate(zip(measured.stages, simulated.stages)):
        print(f"  {plan.name} stage {i}: forward {a.forward_ms:.2f} ms (simulated {b.forward_ms:.2f}), backward "
              f"{a.backward_ms:.2f} ms (simulated {b.backward_ms:.2f})", flush=True)
    timeline.draw_measured_vs_simulated(
        measured, simulated, os.path.join(folder, f"{plan.name}.png"),
        [f"{plan.name} measured: {measured.iteration_ms:.1f} ms", f"{plan.name} simulated: {simulated.iteration_ms:.1f} ms"])

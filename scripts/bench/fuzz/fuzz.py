"""Randomized equivalence under stress: random models and plans, each trained 3 steps pipelined and on one
device from the same weights; a case fails when a weight differs by more than --tolerance (relative to
1 + |weight|; for an ill-conditioned case, where one device itself moves by more than that from round-off-sized
changes of the initial weights, by more than twice that movement: fuzz_case.py), when it errs or hangs, or when a repeat of a case
without collectives gives other bits.

    python -m scripts.bench.fuzz.fuzz --seed=1 --cases=20                 # 20 cases of seed 1
    python -m scripts.bench.fuzz.fuzz --seed=7 --cases=1000 --repeat=3 --load=2   # the long run, 2 cores kept busy
    python -m scripts.bench.fuzz.fuzz --case='{"seed": 7, "index": 12, ...}'       # one case, as a failure prints it

Cases come from scripts/bench/fuzz/fuzz_grammar.py (what is drawn) and run in a worker process
(fuzz_worker.py, fuzz_case.py); a failing case is shrunk to the smallest failing case found (fewer options,
devices, stages and layers) and printed with a command that runs it alone. No process outlives the harness
(fuzz_processes.py), also when it is killed.
"""

import json
import os
import time

from absl import flags

from scripts.bench.fuzz import fuzz_grammar, fuzz_processes
from scripts.bench.harness import Progress, write_rows
from scripts.cli import run_main

flags.DEFINE_string("seed", "0", "Seed of the cases: a non-negative integer.")
flags.DEFINE_integer("cases", 10, "Cases to draw (indices 0..cases-1 of the seed).")
flags.DEFINE_integer("first_case", 0, "Index of the first case.")
flags.DEFINE_integer("repeat", 1, "Runs of each case (repeats of a case without collectives must agree bit for bit).")
flags.DEFINE_integer("load", 0, "Processes spinning a CPU core each while the cases run.")
flags.DEFINE_string("case", None, "One case as JSON (what a failure prints) instead of drawing.")
flags.DEFINE_float("tolerance", 2e-4, "Largest weight difference / (1 + |weight|) that passes.")
flags.DEFINE_float("timeout", 600, "Seconds a case may take before it counts as a hang.")
flags.DEFINE_float("cluster_share", 0.1, "Share of drawn cases whose stages run on worker processes (gRPC).")
flags.DEFINE_bool("shrink", True, "Shrink a failing case to the smallest failing case found.")
flags.DEFINE_string("json", None, "Write every run's result here.")
FLAGS = flags.FLAGS
CONDITIONING_FACTOR = 2.0


def _deterministic(case: fuzz_grammar.Case) -> bool:
    """Bit-identical run to run: no replicated stage (no gradient AllReduce, no sync batch norm collectives)."""
    return all(r == 1 for _, _, r in case.stages)


def allowed(result, tolerance: float) -> float:
    """The largest relative weight difference that passes: the tolerance, or for an ill-conditioned case (one
    device moved by more than the tolerance from round-off-sized changes of its initial weights, fuzz_case.py)
    CONDITIONING_FACTOR x that movement."""
    return max(tolerance, CONDITIONING_FACTOR * result.get("conditioning", 0.0))


def failure(case: fuzz_grammar.Case, results, tolerance: float):
    """Why the runs of a case failed, or None."""
    for result in results:
        if "error" in result:
            return result["error"]
        bound = allowed(result, tolerance)
        if result["relative"] > bound:
            return (f"{result['variable']} differs from one device by {result['weights']:.3g} "
                    f"(relative {result['relative']:.3g} > {bound:.3g}); losses by {result['loss']:.3g}")
    if _deterministic(case) and len({r["digest"] for r in results}) > 1:
        return f"repeats gave different weights (digests {sorted({r['digest'] for r in results})})"
    return None


def run_case(worker, case, repeat: int, timeout: float):
    return [worker.run(case.to_json(), timeout, fresh=case.cluster) for _ in range(repeat)]


def shrink(worker, case, repeat: int, tolerance: float, timeout: float, log):
    """The smallest failing case reached by steps of fuzz_grammar.smaller that still fail."""
    improved = True
    while improved:
        improved = False
        for candidate in fuzz_grammar.smaller(case):
            why = failure(candidate, run_case(worker, candidate, repeat, timeout), tolerance)
            if why is not None:
                log(f"  shrunk: {candidate.describe()}: {why}")
                case, improved = candidate, True
                break
    return case


def _line(index_text: str, case, results, why, seconds: float) -> str:
    worst = max((r.get("relative", 0.0) for r in results), default=0.0)
    conditioning = max((r.get("conditioning", 0.0) for r in results), default=0.0)
    status = "FAIL" if why else "ok"
    refused = case.per_host and any(r.get("per_host") is False for r in results)
    return (f"case {index_text:>9}  {status:4}  {case.describe()}{' (refused per host: one graph)' if refused else ''}"
            f"  max rel |dw| {worst:.1e}  "
            f"(one device from perturbed weights: {conditioning:.1e})  {seconds:.1f} s")


def main(argv):
    del argv
    seed = fuzz_grammar.parse_seed(FLAGS.seed)
    if FLAGS.cases < 1 or FLAGS.repeat < 1 or FLAGS.load < 0:
        raise ValueError("--cases and --repeat must be >= 1, --load >= 0")
    if FLAGS.case:
        cases = [fuzz_grammar.Case.from_json(FLAGS.case)]
    else:
        cases = [fuzz_grammar.draw(seed, i, FLAGS.cluster_share)
                 for i in range(FLAGS.first_case, FLAGS.first_case + FLAGS.cases)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
        [os.getcwd()] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    worker = fuzz_processes.Worker(env)
    rows, failures, started = [], [], time.perf_counter()
    print(f"{len(cases)} cases x {FLAGS.repeat} runs, seed {seed}, load {FLAGS.load}, tolerance {FLAGS.tolerance:g}",
          flush=True)
    progress = Progress(len(cases), "cases")
    try:
        with fuzz_processes.Load(FLAGS.load):
            for n, case in enumerate(cases):
                begun = time.perf_counter()
                results = run_case(worker, case, FLAGS.repeat, FLAGS.timeout)
                why = failure(case, results, FLAGS.tolerance)
                progress.advance(_line(f"{n + 1}/{len(cases)}", case, results, why, time.perf_counter() - begun))
                rows.append({"case": json.loads(case.to_json()), "results": results, "failure": why})
                if why is None:
                    continue
                print(f"  {why}", flush=True)
                if any(r.get("harness") for r in results):  # not the rewrite's failure: nothing to shrink
                    print("  stopped: the harness's own part failed; fix it first (traceback in --json)", flush=True)
                    failures.append(case)
                    break
                smallest = shrink(worker, case, FLAGS.repeat, FLAGS.tolerance, FLAGS.timeout,
                                  lambda text: print(text, flush=True)) if FLAGS.shrink else case
                failures.append(smallest)
                print(f"  reproduce: python -m scripts.bench.fuzz.fuzz --repeat={FLAGS.repeat} "
                      f"--case='{smallest.to_json()}'", flush=True)
    finally:
        worker.close()
    write_rows(FLAGS.json, rows)
    if FLAGS.repeat > 1:
        print(repeat_summary(rows), flush=True)
    print(f"{len(cases)} cases x {FLAGS.repeat} runs: {len(failures)} failed, "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    return 1 if failures else 0


def repeat_summary(rows) -> str:
    """How many cases' repeats agreed bit for bit, with and without collectives (replicated stages)."""
    counts = {True: [0, 0], False: [0, 0]}
    for row in rows:
        digests = {r.get("digest") for r in row["results"]}
        if None in digests:
            continue
        plain = _deterministic(fuzz_grammar.Case.from_json(json.dumps(row["case"])))
        counts[plain][0] += len(digests) == 1
        counts[plain][1] += 1
    return (f"bit-identical repeats: {counts[True][0]} of {counts[True][1]} cases without collectives, "
            f"{counts[False][0]} of {counts[False][1]} with (gradient AllReduce, sync batch norm)")


def run():
    run_main(main)


if __name__ == "__main__":
    run()

"""bench_schedules: DAPPLE's 1F1B vs the zero-bubble and interleaved schedules, simulated on the published
V100 profiles.

  python -m scripts.bench.planning.schedules [--profiles=../shared/profiles] [--json=rows.json]

For BERT-48 and GNMT-16 on the paper's configurations A, B, C (Table 1's batch sizes and memory), the
DAPPLE planner's plan is simulated under each schedule (planner/planning/schedule_choice.py) with the same stage
costs, and its interleaved variant (two stages per device group, the model cut again; or why it has none):
iteration time, its ratio to 1F1B, the largest device peak, and the schedule the planner writes
into the plan (the fastest that fits).
"""

from absl import flags

from scripts.bench import harness
from scripts.cli import run_main

FLAGS = flags.FLAGS
flags.DEFINE_string("profiles", None, "Folder with bert-48-pbs-2.txt and gnmt-16-pbs-64.txt (default: the shared "
                    "profiles beside this checkout, ../shared/profiles).")
flags.DEFINE_string("json", None, "Write the rows to this JSON file.")

CASES = [("bert-48-pbs-2", 64, "11.4GB"), ("gnmt-16-pbs-64", 1024, "3.9GB")]
CONFIGS = ("paper_a", "paper_b", "paper_c")


def main(argv):
    del argv
    import warnings

    from planner.planning.api import plan
    from planner.formats.cluster import preset_cluster
    from planner.formats.profile import load_profile
    from planner.formats.schedule import INTERLEAVED, schedule_kind
    from planner.planning.interleave import why_not
    from planner.planning.schedule_choice import VIRTUAL_STAGES
    from planner.simulation.sim_adapter import model_profile

    rows = []
    print("model           config   plan           M  schedule      iteration ms  x 1F1B  peak GiB  chosen")
    progress = harness.Progress(len(CASES) * len(CONFIGS), "models x configurations planned")
    for name, batch, memory in CASES:
        profile = load_profile(harness.profile_path(name, FLAGS.profiles))
        for config in CONFIGS:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                chosen = plan(profile, preset_cluster(config), batch, profile_memory=memory)
            shape = ":".join(str(len(s.device_ids)) for s in chosen.stages)
            base = next(e.simulated_iteration_ms for e in chosen.schedule_estimates if schedule_kind(e.schedule) == "dapple")
            for e in chosen.schedule_estimates:
                kind = schedule_kind(e.schedule)
                row = {"model": name, "config": config, "plan": shape, "M": chosen.num_micro_batches,
                       "schedule": kind, "iteration_ms": e.simulated_iteration_ms,
                       "ratio": e.simulated_iteration_ms / base, "peak_gib": e.peak_memory_bytes / 2**30,
                       "fits": e.fits, "chosen": e.schedule == chosen.schedule}
                rows.append(row)
                print(f"{name:15s} {config:8s} {shape:13s} {row['M']:3d}  {kind:11s} {row['iteration_ms']:12.1f}  "
                      f"{row['ratio']:6.3f}  {row['peak_gib']:8.2f}  {'yes' if row['chosen'] else ''}"
                      + ("" if e.fits else "  (does not fit)"))
            if INTERLEAVED not in [schedule_kind(e.schedule) for e in chosen.schedule_estimates]:
                print(f"{name:15s} {config:8s} {shape:13s} {chosen.num_micro_batches:3d}  {INTERLEAVED:11s}  none: "
                      f"{why_not(chosen, model_profile(profile), VIRTUAL_STAGES)}")
            progress.advance()
    harness.write_rows(FLAGS.json, rows)
    return 0


def run():
    run_main(main)


if __name__ == "__main__":
    run()

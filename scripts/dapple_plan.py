"""dapple_plan: choose a DAPPLE parallelization plan for a profiled model on a cluster.

Example:
  dapple_plan --profile=../shared/profiles/vgg-19-pbs-32.txt --global_batch_size=2048
      --cluster=paper_c --profile_memory=5.6GB --output=plan.json

Warnings (on stderr): memory figures that are only a lower bound (no memory input), and a chosen
plan whose simulated time differs from formula 2's L by more than 5%.
The report's `ties:` line names the plans simulated within the profile's spread of the chosen one (with
--select=simulation, and under either selection when the profile is noisy: a spread above 20%;
planner/planning/ties.py).
--explain prints the plan's pipeline program: what one step runs where, and what each task's graph builds of it.
"""

import warnings

from absl import flags

from scripts.cli import run_main

FLAGS = flags.FLAGS
flags.DEFINE_string("profile", None, "Layer cost profile (.pb/.pbtxt/.json) or PipeDream text profile (.txt).")
flags.DEFINE_integer("global_batch_size", None, "Global batch size of one training iteration.")
flags.DEFINE_string("cluster", "paper_a", "paper_a | paper_b | paper_c | local | local:TASKSxDEVICES (dapple_launch's worker processes) | a cluster file (.pbtxt/.json).")
flags.DEFINE_integer("num_servers", None, "Servers in a paper_* cluster (default: 16 devices in all).")
flags.DEFINE_integer("num_devices", None, "Virtual CPU devices for --cluster=local (default 2).")
flags.DEFINE_string("planner", "dapple", "dapple | dp | dp_overlap | straight | gpipe | pipedream | all")
flags.DEFINE_string("output", None, "Where to write the plan (.pb/.pbtxt/.json).")
flags.DEFINE_float("optimizer_multiplier", 2.0, "Extra copies of the weights the optimizer keeps (Adam: 2).")
flags.DEFINE_enum("backend", "tf", ["tf", "horovod"], "horovod: plan one server (--cluster) at the per-process "
                  "batch for --num_processes horovodrun processes (dapple_train --backend=horovod).")
flags.DEFINE_integer("num_processes", 1, "With --backend=horovod: the horovodrun processes (-np).")
flags.DEFINE_integer("max_stages", None, "Most pipeline stages to consider.")
flags.DEFINE_list("micro_batch_sizes", None, "Micro-batch sizes to consider (default: every divisor of the global batch).")
flags.DEFINE_string("profile_memory", None,
                    "Memory of one training step at the profile batch size, e.g. 11.4GB (the paper's Table 1); "
                    "default: the profile's measured step peak, or a `<profile>.memory` file next to it.")
flags.DEFINE_enum("select", "latency", ["latency", "simulation"],
                  "latency: the paper's objective L (formula 2); simulation: the best simulated of each "
                  "micro-batch size's 8 best plans by L.")
flags.DEFINE_boolean("explain", False, "Also print the chosen plan's pipeline program (each replica's rows, each "
                     "device's tasks, the transfers, the gradient reductions) and how each task's graph builds it "
                     "(planner/formats/program.py).")


def main(argv):
    del argv
    from planner.planning.api import plan_all
    from planner.formats.cluster import load_cluster
    from planner.formats.profile import load_profile
    from planner.planning.report import comparison_table, summarize
    from planner.formats import write_message

    if not FLAGS.profile:
        raise ValueError("--profile is required")
    if FLAGS.global_batch_size is None:
        raise ValueError("--global_batch_size is required")
    profile = load_profile(FLAGS.profile)
    cluster = load_cluster(FLAGS.cluster, num_servers=FLAGS.num_servers, num_devices=FLAGS.num_devices)
    options = {"optimizer_multiplier": FLAGS.optimizer_multiplier, "max_stages": FLAGS.max_stages,
               "select": FLAGS.select, "profile_memory": FLAGS.profile_memory}
    if FLAGS.micro_batch_sizes:
        try:
            options["micro_batch_sizes"] = [int(x) for x in FLAGS.micro_batch_sizes]
        except ValueError:
            raise ValueError(f"--micro_batch_sizes must be integers, got {FLAGS.micro_batch_sizes}") from None
    batch_size = FLAGS.global_batch_size
    if FLAGS.backend == "horovod":
        if FLAGS.num_processes < 1 or batch_size % FLAGS.num_processes:
            raise ValueError(f"--global_batch_size={batch_size} must be a multiple of --num_processes={FLAGS.num_processes}")
        batch_size //= FLAGS.num_processes
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.formatwarning = lambda message, category, *_: f"warning: {message}\n"
        plans = plan_all(profile, cluster, batch_size, planner=FLAGS.planner, **options)
    if FLAGS.backend == "horovod":
        from planner.planning.horovod_plan import per_process_plan

        plans = {k: p if isinstance(p, str) else per_process_plan(p, FLAGS.num_processes) for k, p in plans.items()}
    if FLAGS.planner == "all":
        print(comparison_table(plans))
        print()
    main_name = "dapple" if FLAGS.planner == "all" else FLAGS.planner
    chosen = plans[main_name]
    if isinstance(chosen, str):
        raise ValueError(f"{main_name}: {chosen}")
    print(summarize(chosen))
    if FLAGS.explain:
        print()
        print(_explained(chosen))
    if FLAGS.output:
        write_message(chosen, FLAGS.output)
        print(f"wrote {FLAGS.output}")
    return 0


def _explained(plan) -> str:
    """The plan's pipeline program, lowered for one graph and, over several tasks, for each task's graph."""
    from planner.formats.program import lower, program_of_plan
    from planner.simulation.sim_adapter import plan_schedule

    program = program_of_plan(plan, plan_schedule(plan))
    parts = [str(program), str(lower(program))]
    if len(program.tasks) > 1:
        parts += [str(lower(program, task)) for task in program.tasks]
    return "\n".join(parts)


def run():
    run_main(main)


if __name__ == "__main__":
    run()

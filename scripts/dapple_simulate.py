"""dapple_simulate: simulate a plan's pipeline schedule and draw it (Chrome trace, PNG Gantt chart).

Takes a plan file (--plan) or runs a planner (--planner), simulates one iteration with
planner/simulation/simulator.py under the planner's cost model, prints the summary (iteration time,
throughput, bubble and peak memory per stage, analytic vs simulated time) and optionally writes
a Chrome trace (chrome://tracing, Perfetto) and a PNG Gantt chart with memory over time.

Example:
  dapple_simulate --profile=../shared/profiles/bert-48-pbs-2.txt --cluster=paper_b
      --global_batch_size=64 --planner=dapple --schedule=dapple --png=bert.png --trace=bert.json
"""

from absl import flags

from planner.formats.schedule import SCHEDULE_KINDS
from scripts.cli import run_main

FLAGS = flags.FLAGS
flags.DEFINE_string("profile", None, "Layer cost profile or PipeDream text profile.")
flags.DEFINE_string("cluster", "paper_a", "paper_a | paper_b | paper_c | local | a cluster file.")
flags.DEFINE_integer("num_servers", None, "Servers in a paper_* cluster (default: 16 devices in all).")
flags.DEFINE_integer("global_batch_size", None, "Global batch size.")
flags.DEFINE_string("plan", None, "A plan file to simulate (instead of --planner).")
flags.DEFINE_string("planner", "dapple", "Planner to run when no --plan is given.")
flags.DEFINE_enum("schedule", "dapple", list(SCHEDULE_KINDS), "Schedule to simulate (a plan whose stages share "
                  "devices: interleaved). interleaved on a plan whose stages have devices of their own simulates its "
                  "variant with --virtual_stages stages per device group, the model cut again.")
flags.DEFINE_integer("virtual_stages", 2, "Stages per device group of --schedule=interleaved's variant.")
flags.DEFINE_enum("policy", None, ["A", "B"], "DAPPLE warm-up policy (default: the plan's K_i).")
flags.DEFINE_string("trace", None, "Write a Chrome-trace JSON here.")
flags.DEFINE_string("png", None, "Write a PNG Gantt chart (with memory over time) here.")
flags.DEFINE_bool("overlap_allreduce", True, "Overlap each stage's AllReduce with its last backward.")
flags.DEFINE_bool("duplex_links", False, "Let activations and gradients cross a cut at the same time.")
flags.DEFINE_float("activation_multiplier", 1.0, "Scale the profile's activation bytes (stashed tensors).")
flags.DEFINE_bool("recompute", None, "Re-computation on (or off) for every stage (default: the plan's choice).")


def main(argv):
    del argv
    from planner.formats.cluster import load_cluster
    from planner.formats.profile import load_profile
    from planner.formats import plan_pb2, read_message
    from planner.simulation.sim_adapter import compare_text, simulate_plan

    if not FLAGS.profile:
        raise ValueError("--profile is required")
    profile = load_profile(FLAGS.profile)
    if FLAGS.plan:
        plan = read_message(FLAGS.plan, plan_pb2.Plan)
        cluster = plan.cluster if not FLAGS["cluster"].present else load_cluster(FLAGS.cluster, FLAGS.num_servers)
    else:
        from planner.planning import api

        if not FLAGS.global_batch_size:
            raise ValueError("--global_batch_size is required with --planner")
        cluster = load_cluster(FLAGS.cluster, FLAGS.num_servers)
        plan = api.plan(profile, cluster, FLAGS.global_batch_size, planner=FLAGS.planner)
    plan = _interleaved_if_asked(plan, profile)
    if FLAGS.recompute is not None:
        for stage in plan.stages:
            stage.recompute = FLAGS.recompute
    result = simulate_plan(plan, profile, cluster, schedule=_schedule(plan), policy=FLAGS.policy,
                           overlap_allreduce=FLAGS.overlap_allreduce, duplex_links=FLAGS.duplex_links,
                           activation_multiplier=FLAGS.activation_multiplier)
    print(f"plan: {plan.planner or 'unknown'} planner, {len(plan.stages)} stages "
          f"({':'.join(str(len(s.device_ids)) for s in plan.stages)} devices), "
          f"global batch {plan.global_batch_size} = {plan.num_micro_batches} x {plan.micro_batch_size}")
    print(result.summary())
    if plan.estimated_iteration_ms > 0:
        print(compare_text(plan, result))
    if FLAGS.trace:
        from planner.simulation.trace import write_trace

        boxes = write_trace(result, FLAGS.trace)
        print(f"wrote {FLAGS.trace} ({boxes} boxes)")
    if FLAGS.png:
        from planner.simulation.gantt import draw_gantt

        info = draw_gantt(result, FLAGS.png)
        print(f"wrote {FLAGS.png} ({sum(info.rows)} rows, {info.total_boxes} boxes)")
    return 0


def _interleaved_if_asked(plan, profile):
    from planner.formats.schedule import INTERLEAVED
    from planner.planning.interleave import interleaved_plan, why_not
    from planner.simulation.sim_adapter import model_profile

    if FLAGS.schedule != INTERLEAVED or _shares_devices(plan):
        return plan
    model = model_profile(profile)
    variant = interleaved_plan(plan, model, FLAGS.virtual_stages)
    if variant is None:
        raise ValueError(f"the plan has no interleaved variant: {why_not(plan, model, FLAGS.virtual_stages)}")
    return variant


def _shares_devices(plan) -> bool:
    from planner.formats.schedule import device_groups

    return device_groups([tuple(s.device_ids) for s in plan.stages]) < len(plan.stages)


def _schedule(plan) -> str:
    """--schedule; a plan whose stages share devices runs interleaved unless --schedule names another."""
    return "interleaved" if _shares_devices(plan) and not FLAGS["schedule"].present else FLAGS.schedule


def run():
    run_main(main)


if __name__ == "__main__":
    run()

"""How well the planner's analytic L (formula 2 with the pivot's wait) predicts the event simulator, on
random plans of the shipped V100 profiles, next to the paper's printed formula (without the wait).

Random plans: 2 to 5 stages at random cuts, random replication summing to 16 devices, a random
micro-batch size (a divisor of the global batch no smaller than the largest replication), configs A and
C; each costed by planner.planning.plan_eval.evaluate and simulated by planner.simulation.sim_adapter.simulate_plan.

    python -m scripts.bench.planning.latency_model [--plans=40 --seed=1]
"""

import random
import statistics

from absl import flags

from scripts.bench import harness
from scripts.cli import reject_arguments, run_main

FLAGS = flags.FLAGS
flags.DEFINE_string("profiles", None, "Folder with the shipped PipeDream profiles (default: ../shared/profiles beside this checkout).")
flags.DEFINE_integer("plans", 40, "Random plans per (profile, config).")
flags.DEFINE_integer("seed", 1, "Random seed.")

PROFILES = (("vgg-19-pbs-32", 2048), ("gnmt-16-pbs-64", 1024), ("bert-48-pbs-2", 64))


def random_stages(rng, num_layers: int, devices: int = 16):
    count = rng.randint(2, 5)
    edges = [0] + sorted(rng.sample(range(1, num_layers), count - 1)) + [num_layers]
    replicas = [1] * count
    for _ in range(devices - count):
        replicas[rng.randrange(count)] += 1
    stages, first_device = [], 0
    for i in range(count):
        stages.append((edges[i], edges[i + 1], tuple(range(first_device, first_device + replicas[i]))))
        first_device += replicas[i]
    return stages, max(replicas)


def printed_latency(est) -> float:
    """The estimate's L without the pivot's wait (the paper's printed Ts)."""
    from planner.planning import cost_model as cm

    forward, backward = [], []
    for i in range(len(est.forward)):
        forward.append(est.forward[i])
        backward.append(est.backward[i])
        if i < len(est.comm):
            forward.append(est.comm[i])
            backward.append(est.comm[i])
    wait = cm.pivot_wait_ms(forward, backward, est.pivot, est.num_micro_batches, est.warmup_counts[est.pivot // 2])
    return est.latency - wait


def main(argv):
    reject_arguments(argv)
    from planner.planning import cost_model as cm
    from planner.formats.cluster import preset_cluster
    from planner.formats.model_profile import ModelProfile
    from planner.planning.plan_eval import Options, evaluate, to_plan
    from planner.formats.profile import load_profile
    from planner.simulation.sim_adapter import simulate_plan

    rng = random.Random(FLAGS.seed)
    errors = {"with the pivot's wait": [], "printed formula 2": []}
    for name, gbs in PROFILES:
        model = ModelProfile.from_proto(load_profile(harness.profile_path(name, FLAGS.profiles)))
        prefix = cm.Prefix(model)
        for config in ("paper_a", "paper_c"):
            cluster = preset_cluster(config)
            for _ in range(FLAGS.plans):
                stages, widest = random_stages(rng, model.num_layers)
                mbs = rng.choice([d for d in range(widest, gbs + 1) if gbs % d == 0])
                est = evaluate(model, prefix, cluster, stages, gbs, mbs, Options())
                simulated = simulate_plan(to_plan(est, model, cluster, gbs, "dapple"), model).iteration_ms
                errors["with the pivot's wait"].append(est.latency / simulated - 1)
                errors["printed formula 2"].append(printed_latency(est) / simulated - 1)
    total = len(errors["printed formula 2"])
    print(f"{total} random plans of {', '.join(n for n, _ in PROFILES)} on configs A and C; L / simulated - 1")
    print(f"{'L':24s} {'within 5%':>10s} {'within 10%':>11s} {'median |e|':>11s} {'worst low':>10s} {'worst high':>11s}")
    for label, values in errors.items():
        print(f"{label:24s} {sum(abs(e) <= 0.05 for e in values):10d} {sum(abs(e) <= 0.10 for e in values):11d} "
              f"{statistics.median(abs(e) for e in values):11.1%} {min(values):10.1%} {max(values):11.1%}")
    return 0


def run():
    run_main(main)


if __name__ == "__main__":
    run()

"""bench_planner: wall-clock planning time of the DAPPLE planner (baselines included).

  python -m scripts.bench.planning.planner [--synthetic_layers=256 --synthetic_servers=128]
Targets (issue 4): BERT-48 on paper_a < 0.5 s; GNMT-16 on paper_a < 5 s; a synthetic 256-layer
chain on 128 servers x 8 devices < 60 s. Times plan() as the library default (no simulation);
for the 16-device cases also with simulate=True (the chosen plan simulated as a check, what
dapple_plan does).
"""

import time

from absl import flags

from scripts.bench import harness
from scripts.cli import run_main

FLAGS = flags.FLAGS
flags.DEFINE_string("profiles", None, "Folder with bert-48-pbs-2.txt and gnmt-16-pbs-64.txt (default: "
                    "../shared/profiles beside this checkout).")
flags.DEFINE_integer("synthetic_layers", 256, "Layers of the synthetic chain profile (0: skip).")
flags.DEFINE_integer("synthetic_servers", 128, "paper_a servers for the synthetic case.")


def synthetic_profile(layers: int):
    """A chain of `layers` transformer-like layers with mildly varying costs (deterministic)."""
    from planner.formats import layer_cost_pb2

    p = layer_cost_pb2.LayerCostProfile(model_name=f"synthetic-{layers}", batch_size=8, source="bench_planner")
    for i in range(layers):
        layer = p.layers.add(name=f"l{i}", index=i, description=f"layer_{i}",
                             forward_ms=2.0 + (i * 37 % 11) / 10, backward_ms=4.0 + (i * 53 % 13) / 10,
                             activation_bytes=4e6 + (i % 7) * 1e6, parameter_bytes=2e7 + (i % 5) * 1e7)
        if i:
            layer.inputs.append(f"l{i - 1}")
    return p


def main(argv):
    del argv
    from planner.planning.api import plan
    from planner.formats.cluster import preset_cluster
    from planner.formats.profile import load_profile

    cases = [("bert-48", load_profile(harness.profile_path("bert-48-pbs-2", FLAGS.profiles)), "paper_a", None, 64, 0.5),
             ("gnmt-16", load_profile(harness.profile_path("gnmt-16-pbs-64", FLAGS.profiles)), "paper_a", None, 1024,
              5.0)]
    if FLAGS.synthetic_layers:
        cases.append((f"synthetic-{FLAGS.synthetic_layers}", synthetic_profile(FLAGS.synthetic_layers), "paper_a",
                      FLAGS.synthetic_servers, 4096, 60.0))
    progress = harness.Progress(len(cases), "cases (the synthetic one is the longest)")
    for name, profile, cluster, servers, gbs, target in cases:
        c = preset_cluster(cluster, servers)
        start = time.perf_counter()
        p = plan(profile, c, gbs)
        took = time.perf_counter() - start
        shape = ":".join(str(len(s.device_ids)) for s in p.stages)
        print(f"{name:<14} {cluster} {c.num_servers}x{c.devices_per_server} GBS {gbs}: {took:7.2f} s "
              f"(target < {target} s, {'ok' if took < target else 'SLOW'}); plan {shape}, "
              f"L {p.estimated_iteration_ms:.1f} ms", flush=True)
        if servers is None:
            start = time.perf_counter()
            p = plan(profile, c, gbs, simulate=True)
            took = time.perf_counter() - start
            shape = ":".join(str(len(s.device_ids)) for s in p.stages)
            print(f"{'  +simulate':<14} {cluster} {c.num_servers}x{c.devices_per_server} GBS {gbs}: {took:7.2f} s; "
                  f"plan {shape}, L {p.estimated_iteration_ms:.1f} ms, simulated {p.simulated_iteration_ms:.1f} ms",
                  flush=True)
        progress.advance()
    return 0


if __name__ == "__main__":
    run_main(main)

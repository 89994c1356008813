"""dapple_plan as a subprocess: summaries, the comparison table, plan files and errors."""

import json

from tests.shared_profiles import PROFILES
from tests.programs import run_program

VGG = PROFILES + "vgg-19-pbs-32.txt"


def run(*args):
    return run_program("dapple_plan", *args)


def test_plan_all_writes_json(tmp_path):
    out = str(tmp_path / "plan.json")
    r = run(f"--profile={VGG}", "--global_batch_size=256", "--cluster=paper_b", "--planner=all", f"--output={out}")
    assert r.returncode == 0, r.stderr
    for name in ("dp ", "dp_overlap", "straight", "gpipe", "pipedream", "dapple"):
        assert name in r.stdout
    plan = json.load(open(out))
    assert plan["planner"] == "dapple" and sum(len(s["device_ids"]) for s in plan["stages"]) == 16
    assert plan["global_batch_size"] == plan["micro_batch_size"] * plan["num_micro_batches"]


def test_bad_micro_batch(tmp_path):
    r = run(f"--profile={VGG}", "--global_batch_size=12", "--cluster=local", "--micro_batch_sizes=5")
    assert r.returncode == 1
    assert r.stderr.strip().endswith(
        "error: micro-batch size(s) [5] do not split global batch size 12; valid micro-batch sizes: [1, 2, 3, 4, 6, 12]")


def test_malformed_profile(tmp_path):
    bad = tmp_path / "m-pbs-2.txt"
    bad.write_text("a -- x -- forward_compute_time=1\n")
    r = run(f"--profile={bad}", "--global_batch_size=4")
    assert r.returncode == 1
    assert f"error: {bad}:1: expected 4 comma-separated key=value metrics" in r.stderr


def test_model_too_big(tmp_path):
    r = run(f"--profile={VGG}", "--global_batch_size=32", "--cluster=local", "--num_devices=2")
    # local devices have physical memory / 2 each: VGG fits; shrink memory with a cluster file
    cluster = tmp_path / "tiny.pbtxt"
    cluster.write_text('name: "tiny" num_servers: 1 devices_per_server: 2 device_memory_bytes: 1e8 '
                       'intra_server_bandwidth: 1e9 inter_server_bandwidth: 1e9\n')
    r = run(f"--profile={VGG}", "--global_batch_size=32", f"--cluster={cluster}")
    assert r.returncode == 1
    assert "error: dapple: the model fits no plan in memory: layer node23 (FC1) alone needs 1.46 GiB" in r.stderr


def test_local_cluster_num_devices(tmp_path):
    out = str(tmp_path / "plan.json")
    r = run(f"--profile={VGG}", "--global_batch_size=32", "--cluster=local", "--num_devices=3", f"--output={out}")
    assert r.returncode == 0, r.stderr
    plan = json.load(open(out))
    assert plan["cluster"]["num_servers"] == 1 and plan["cluster"]["devices_per_server"] == 3
    assert sorted(d for s in plan["stages"] for d in s["device_ids"]) == [0, 1, 2]


def test_memory_input_and_warnings():
    bert = PROFILES + "bert-48-pbs-2.txt"
    r = run(f"--profile={bert}", "--global_batch_size=64", "--cluster=paper_b")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("memory figures are a lower bound") == 1
    r = run(f"--profile={bert}", "--global_batch_size=64", "--cluster=paper_b", "--profile_memory=11.4GB")
    assert r.returncode == 0, r.stderr
    assert "lower bound" not in r.stderr and "shape: straight (16 stages)" in r.stdout
    r = run(f"--profile={bert}", "--global_batch_size=64", "--cluster=paper_b", "--profile_memory=11.4GB",
            "--micro_batch_sizes=32")
    # Forced to M=2, L misses some of the pivot's waits; the simulator finds 9% more and names the phase.
    assert "warning: bert-48: the chosen plan's analytic 1423.02 ms, simulated 1553.69 ms (+9.2%): the steady Ts" in r.stderr
    r = run(f"--profile={bert}", "--global_batch_size=64", "--profile_memory=1GB")
    assert r.returncode == 1 and "error: " in r.stderr and "is not more than its weights and gradients" in r.stderr

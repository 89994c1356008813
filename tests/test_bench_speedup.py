"""scripts/bench/speed/speedup.py: its rows (JSON keys, plans, numbers that make sense), its trace files, its progress
lines, and its process handling (nothing left running). Correctness, not timing: a tiny MLP and two steps per plan.
What it measures by default is unit-tested in test_bench_speedup_sizing.py."""

import importlib.util
import json
import os
import re
import subprocess

import pytest

from tests.programs import run_program

pytestmark = [pytest.mark.slow, pytest.mark.primary_only]  # benchmarks are recorded in the primary environment


def _ours(tag):
    """Pids of processes started under this test's tag (in their environment, which the launcher, its workers
    and the benchmark inherit): another test running meanwhile (pytest -n) has its own."""
    found, marker = [], f"{TAG}={tag}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            continue
    return found


TAG = "DAPPLE_TEST_BENCH_SPEEDUP"


def test_bench_writes_rows_traces_and_leaves_nothing_running(tmp_path):
    out, traces = tmp_path / "rows.json", tmp_path / "traces"
    result = run_program(
        "bench.speed.speedup", "--model=mlp", "--model_flags=input_dim=32,hidden=64:64:64:64,num_classes=4",
        "--global_batch_size=32", "--num_workers=2", "--micro_batches=1,4", "--steps=2", "--rounds=2",
        "--profile_rounds=3",
        "--plans=single,dp2,straight2-M4,gpipe2-M4,planner,mwms2,horovod2", f"--json={out}", f"--trace_dir={traces}",
        f"--profile_dir={tmp_path / 'profiles'}", timeout=600, env={TAG: str(tmp_path)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {row["plan"]: row for row in json.loads(out.read_text())}
    peers = {name: rows.pop(name) for name in list(rows) if "peer" in rows[name]}
    assert set(rows) == {"single", "dp2", "straight2-M4", "gpipe2-M4", "planner"}
    horovod = importlib.util.find_spec("horovod") is not None
    assert set(peers) == {"mwms1", "mwms2"} | ({"horovod1", "horovod2"} if horovod else set())
    for name, peer in peers.items():
        assert peer["measured_ms"] > 0 and peer["workers"] == int(name[-1])
        assert peer["speedup"] == pytest.approx(rows["single"]["measured_ms"] / peer["measured_ms"])
        assert peer["speedup_over_own_one"] == pytest.approx(peers[name[:-1] + "1"]["measured_ms"] / peer["measured_ms"])
    assert re.search(r"^dp2 [\d.]+x over single, mwms2 [\d.]+x \(dp2 / mwms2: [\d.]+\)", result.stdout, re.M)
    if not horovod:
        assert "horovod2                 skipped: horovod is not installed" in result.stdout
    for row in rows.values():
        for key in ("measured_ms", "simulated_ms", "speedup", "ideal_speedup"):
            assert row[key] > 0, (key, row)
        assert len(row["peak_bytes"]) == 2
        assert len(row["rounds_ms"]) == 2 and row["measured_ms"] == pytest.approx(sum(row["rounds_ms"]) / 2)
        assert row["steps"] == 2
    assert rows["single"]["speedup"] == 1.0 and rows["single"]["ideal_speedup"] == 1.0
    assert rows["single"]["simulated_speedup"] == pytest.approx(1.0)
    assert rows["dp2"]["speedup_after_compute"] <= 2.0 / rows["dp2"]["slice_slowdown"] + 1e-9
    assert "Where the speedup goes" in result.stdout and "  dp2  " in result.stdout
    assert re.search(r"^  straight2-M4 +step [\d.]+/[\d.]+ ms \([+-][\d.]+\); compute [\d.]+/[\d.]+, transfers "
                     r"[\d.]+/[\d.]+, allreduce [\d.]+/[\d.]+, bubble [\d.]+/[\d.]+ ms measured/simulated; most off: "
                     r"(compute|transfers|allreduce|bubble)", result.stdout, re.M), result.stdout[-3000:]
    assert rows["straight2-M4"]["most_off"] in ("compute", "transfers", "allreduce", "bubble")
    assert set(rows["dp2"]["terms_measured"]) == {"compute", "transfers", "allreduce", "bubble"}
    assert re.search(r"^  batch 32: whole step [\d.]+ ms, spread [\d.]+% over 3 rounds$", result.stdout, re.M)
    for size in (8, 16):  # the slices, measured in the same rounds as the whole batch
        assert re.search(rf"^  batch {size}: whole step [\d.]+ ms, spread [\d.]+% over 3 rounds; per sample "
                         r"[\d.]+x the whole batch's \(rounds [\d.]+-[\d.]+\)$", result.stdout, re.M), result.stdout[:3000]
    assert rows["dp2"]["ideal_speedup"] == 2.0
    assert rows["straight2-M4"]["ideal_speedup"] == pytest.approx(2 * 4 / 5)
    assert rows["single"]["peak_bytes"][1] == 0  # worker 1 runs nothing of the single-worker plan
    assert all(p > 0 for p in rows["dp2"]["peak_bytes"])
    for name in rows:
        assert (traces / f"{name}.png").stat().st_size > 0
        trace = json.loads((traces / f"{name}.trace.json").read_text())
        assert trace["traceEvents"]
    assert "straight2-M4" in result.stdout and "meas/sim" in result.stdout
    # the flags win over the sizing; every phase's progress with an estimate of what is left
    assert re.search(r"^measuring 5 plans \(single, dp2, straight2-M4, gpipe2-M4, planner\), 2 rounds of 2 steps: "
                     r"~[\dhms]+ more by a [\d]+ ms step \(the profile\), [\dhms]+ left of the 6-minute budget",
                     result.stdout, re.M), result.stdout[:4000]
    left = r"[\dhms]+ so far, ~[\dhms]+ left"
    for line in (rf"  \[1/3 profile rounds, {left}\]", r"  \[3/3 profile rounds in [\dhms]+\]",
                 rf"  built and traced single \[1/5 plans built and traced, {left}, then ~[\dhms]+ to time them\]",
                 rf"  \[1/5 sessions started, {left}\]", rf"  round 1 of 2: single [\d.]+, .* \[1/2 rounds, {left}\]",
                 r"  round 2 of 2: .* \[2/2 rounds in [\dhms]+\]",
                 rf"mwms1 +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ \[1/[24] peer runs, {left}\]"):
        assert re.search(f"^{line}$", result.stdout, re.M), (line, result.stdout[:4000])
    assert _ours(str(tmp_path)) == [], subprocess.run(["ps", "-ef"], capture_output=True, text=True).stdout


def test_one_worker_is_refused():
    result = run_program("bench.speed.speedup", "--num_workers=1", timeout=120)
    assert result.returncode == 1
    assert "--num_workers=1: a speedup needs at least 2 workers" in result.stderr

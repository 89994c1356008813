"""scripts/bench/hosts/per_host_ab.py: dapple_train as one graph and per host, alternated, side by side."""

import json

import pytest

from tests.programs import run_program


@pytest.mark.slow  # ~35 s: two launches of a 2-task local cluster
@pytest.mark.primary_only  # benchmarks are recorded in the primary environment
def test_one_round_side_by_side(tmp_path):
    out = tmp_path / "rows.json"
    result = run_program("bench.hosts.per_host_ab", "--rounds=1", "--plans=dp", "--steps=9", "--global_batch_size=32",
                         "--cpu", f"--json={out}", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    one, per = row["one_graph"]["step_ms"], row["per_host"]["step_ms"]
    assert one > 0 and per > 0
    assert f"| 0 | dp | {one:.1f} | {per:.1f} | {per / one:.2f}x |" in result.stdout
    assert f"dp: median step one graph {one:.1f} ms, per host {per:.1f} ms: {per / one:.2f}x" in result.stdout
    for run in (row["one_graph"], row["per_host"]):
        # the steady step leaves out the first progress window (9 steps, a window every 3: the warm-up's)
        assert len(run["windows_ms"]) == 3 and run["step_ms"] == pytest.approx(sum(run["windows_ms"][1:]) / 2)
    # --cpu: the CPU of each process between the first and last progress windows, by thread group: per host, each
    # task's dapple_train computes (TF's threads) and loops (its main thread); in one graph the workers compute
    trains = {name: groups for name, groups in row["per_host"]["cpu_ms_per_step"].items() if "dapple_train" in name}
    assert len(trains) == 2 and all(groups["tf"] > 0 and "main" in groups for groups in trains.values()), trains
    workers = [g for name, g in row["one_graph"]["cpu_ms_per_step"].items() if "--tf_config" in name]
    assert len(workers) == 2 and all(g["tf"] > 0 for g in workers), row["one_graph"]["cpu_ms_per_step"]
    assert "| 0 | dp | per_host | scripts.dapple_train" in result.stdout

"""scripts/bench/hosts/per_host_scale.py: one graph for the cluster against one graph per host, on N local worker
processes; each per-host graph holds fewer operations than the cluster's, and the bench leaves no process behind."""

import json
import re

import pytest

from tests.programs import run_program

pytestmark = [pytest.mark.slow, pytest.mark.primary_only]  # ~25 s: three rows, local clusters of 2, 2 x 2 and 4 workers


def test_rows_side_by_side(tmp_path):
    out = tmp_path / "rows.json"
    result = run_program("bench.hosts.per_host_scale", "--tasks=2,4", "--plans=straight", "--steps=2", "--crowd",
                         f"--json={out}", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    printed = re.findall(r"^straight +(\d+) +(\d+) +(\d+) ", result.stdout, re.M)
    rows = json.loads(out.read_text())
    crowd = rows.pop(1)  # N=2 as two clusters of 2 at once, printed "2x2" without in-graph figures
    assert re.findall(r"^straight +2x2 +- +(\d+) +- ", result.stdout, re.M) == [str(crowd["per_host"]["ops"])]
    assert crowd["tasks"] == 2 and crowd["clusters"] == 2 and crowd["in_graph"] is None
    assert [t["ops"] for t in crowd["per_host"]["tasks"]] == [t["ops"] for t in rows[0]["per_host"]["tasks"]] * 2
    assert [(r["tasks"], r["in_graph"]["ops"], r["per_host"]["ops"]) for r in rows] == \
        [tuple(map(int, p)) for p in printed] and len(rows) == 2
    for row in rows + [crowd]:
        assert row is crowd or row["per_host"]["ops"] < row["in_graph"]["ops"]
        hosts = row["per_host"]
        assert len(hosts["tasks"]) == row["tasks"] * row["clusters"] and hosts["step_s"] > 0
        # per host: the slowest build (one worker at a time) plus the slowest start, and the own-hosts estimate
        assert hosts["build_s"] == max(t["build_s"] for t in hosts["tasks"]) > 0
        assert hosts["first_step_s"] == max(t["build_s"] + t["first_step_s"] for t in hosts["tasks"])
        assert hosts["own_hosts_s"] == hosts["build_s"] + max(t["start_cpu_s"] for t in hosts["tasks"])
    # the cluster's graph grows with its tasks (340 ops each, the figure for data parallelism), a task's
    # graph by the model's one more layer (every task traces the whole model once) and a stage of its own
    in_graph_growth = rows[1]["in_graph"]["ops"] - rows[0]["in_graph"]["ops"]
    per_host_growth = rows[1]["per_host"]["ops"] - rows[0]["per_host"]["ops"]
    assert per_host_growth < in_graph_growth / 3, rows

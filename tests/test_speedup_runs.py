"""scripts/bench/speed/speedup_runs.py: several runs' rows in, each plan's bound and measured / simulated per run and
the counts of issue 47's targets out."""

import json

from scripts.bench.speed import speedup_runs
from tests.programs import run_program


def _row(plan, bound, measured_over_simulated, speedup):
    return {"plan": plan, "speedup_after_compute": bound, "measured_over_simulated": measured_over_simulated,
            "speedup": speedup}


def test_runs_side_by_side(tmp_path):
    runs = [[_row("dp2", 1.92, 1.00, 1.70), _row("straight2-M8", 1.53, 0.98, 1.48), _row("mwms2", 0, 0, 0)],
            [_row("dp2", 2.04, 1.12, 1.80), _row("straight2-M8", 1.55, 1.02, 1.50)]]
    paths = []
    for i, rows in enumerate(runs):
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps([{k: v for k, v in r.items() if v or k == "plan"} for r in rows]))
        paths.append(str(path))
    text = speedup_runs.report(speedup_runs.load(paths))
    lines = text.splitlines()
    assert lines[1].split() == ["dp2", "1.92", "2.04", "6.2%", "1.00", "1.12", "0.89", "0.88"]
    assert lines[2].split() == ["straight2-M8", "1.53", "1.55", "1.3%", "0.98", "1.02", "0.97", "0.97"]
    assert lines[3] == ("measured / simulated within 10% in every run: 1 of 2 plans (50%); within 15%: 2 (100%)")
    assert lines[4] == "bound after compute moved by more than 5% between runs: dp2 (6.2%)"
    result = run_program("bench.speed.speedup_runs", *paths)
    assert result.returncode == 0 and result.stdout.strip() == text

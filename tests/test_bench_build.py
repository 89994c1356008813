"""scripts/bench/runtime/build.py: rows for plain TF and every M of both rewrites, with the keys issue 23 asks for (a
tiny BERT); stage functions add fewer operations per micro-batch than clones."""

import json
import re

import pytest

from tests.programs import run_program

pytestmark = [pytest.mark.slow, pytest.mark.primary_only]  # benchmarks are recorded in the primary environment


def test_bench_build_rows(tmp_path):
    out = tmp_path / "build.json"
    result = run_program("bench.runtime.build", "--model_flags=num_layers=2,hidden=16,heads=2,ffn=32",
                         "--global_batch_size=8", "--num_stages=2", "--micro_batches=1,2", "--steps=1",
                         "--rewrites=default,functions,clones",
                         f"--json={out}", timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [(r["M"], r["plan"], r["rewrite"], r["chose"]) for r in rows] == [
        (None, "single", None, None), (1, "straight2-M1-default", "default", "clones"),
        (2, "straight2-M2-default", "default", "clones"), (1, "straight2-M1", "functions", "functions"),
        (2, "straight2-M2", "functions", "functions"), (1, "straight2-M1-clones", "clones", "clones"),
        (2, "straight2-M2-clones", "clones", "clones")]
    for row in rows:
        assert set(row) >= {"M", "ops", "build_s", "init_s", "first_step_s", "step_s"}
        assert row["ops"] > 0 and row["step_s"] > 0
    functions_per_m, clones_per_m = rows[4]["ops"] - rows[3]["ops"], rows[6]["ops"] - rows[5]["ops"]
    assert 0 < functions_per_m < clones_per_m / 3, (functions_per_m, clones_per_m)
    assert rows[1]["ops"] == rows[5]["ops"] and rows[2]["ops"] == rows[6]["ops"]  # the default imports clones here
    assert "ops per extra M" in result.stdout and "straight2-M2-default (clones)" in result.stdout


def test_step_ab_alternates_the_rewrites_in_one_process():
    result = run_program("bench.runtime.step_ab", "--model_flags=num_layers=2,hidden=16,heads=2,ffn=32",
                         "--global_batch_size=8", "--num_stages=2", "--micro_batches=2", "--rounds=3", timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    steps = re.findall(r"^(clones|functions) +step ([\d.]+) s  ([\d.]+)x clones$", result.stdout, re.M)
    assert [s[0] for s in steps] == ["clones", "functions"] and steps[0][2] == "1.0000", result.stdout
    assert float(steps[1][2]) == pytest.approx(float(steps[1][1]) / float(steps[0][1]), rel=1e-3)
    bad = run_program("bench.runtime.step_ab", "--rewrites=default", timeout=120)
    assert bad.returncode == 1 and "--rewrites takes functions and/or clones, got ['default']" in bad.stderr


def test_trace_observer_prints_both_builds_side_by_side():
    result = run_program("bench.runtime.trace_observer", "--model_flags=num_layers=2,hidden=16,heads=2,ffn=32",
                         "--config=tiny", "--rounds=1", timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = re.findall(r"^(the forward|forward \+ minimize) +([\d.]+) +([\d.]+) +([\d.]+)x$", result.stdout, re.M)
    assert [r[0] for r in rows] == ["the forward", "forward + minimize"]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)

"""dapple_demo end to end: profile -> plan -> pipelined training on digits, > 90% test accuracy."""

import os
import re

import pytest
from tests.programs import run_program

def _demo(*args):
    return run_program("dapple_demo", *args, timeout=600)


def _accuracy(stdout):
    match = re.search(r"test accuracy: ([0-9.]+)", stdout)
    assert match, stdout
    return float(match.group(1))


# The README's demo, with its speed part, in the primary environment (`make demo`'s); TF 2.21 trains the forced plan
@pytest.mark.parametrize("args,stages", [pytest.param([], None, marks=pytest.mark.primary_only),
                                         (["--num_stages=2", "--nospeedup"], 2)])
def test_demo_trains_digits_to_90_percent(args, stages, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the programs' temporary folders, checked below
    result = _demo(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "== profile" in out and "== plan ==" in out and "== schedule" in out
    assert len(re.findall(r"^step +\d+ +loss [0-9.]+ +\d+ samples/s$", out, re.M)) == 6  # 300 steps, every 50
    if stages:
        assert "forced 2-stage plan" in out and "stage 1: layers" in out
        assert f"S={stages} stages" in out
    else:
        assert "dapple plan for mlp-digits on local" in out
    assert _accuracy(out) > 0.90
    if not stages and len(os.sched_getaffinity(0)) >= 2:  # the measured speedup of 2 pinned workers, and simulated
        assert "== speedup: 2 pinned worker processes" in out, out[-2000:]
        for plan, ideal in (("planner", r"[0-9.]+"), ("straight2-M2", r"1\.33"), ("straight2-M4", r"1\.60")):
            row = re.search(rf"^{plan} +\d+ +([0-9.]+) +([0-9.]+) +{ideal} +([0-9.]+) +([0-9.]+)", out, re.M)
            assert row, out[-3000:]
            assert float(row.group(2)) > 0 and float(row.group(4)) > 0  # speedup and measured/simulated (not timed)
        assert len(re.findall(r"^On this machine .+\.$", out, re.M)) == 1, out[-3000:]  # the verdict
        assert "planner: ties:" not in out  # a table instead, if any
        assert not list(tmp_path.glob("bench_speedup_*")), list(tmp_path.iterdir())  # its profiles removed
        assert not list(tmp_path.glob("dapple_demo_rows_*")), list(tmp_path.iterdir())  # its rows removed
    elif stages:
        assert "== speedup" not in out


def test_demo_rejects_more_stages_than_devices():
    result = _demo("--num_devices=2", "--num_stages=3", "--steps=1")
    assert result.returncode == 1
    assert "error: --num_stages" in result.stderr and "Traceback" not in result.stderr

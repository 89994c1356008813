"""scripts/bench/hosts/cross_session.py: a tensor from one task's session to another's, three ways side by side (the
candidates for issue 46's per-host graphs), on a local 2-task cluster; no process left behind."""

import re

import pytest

from tests.programs import run_program

pytestmark = [pytest.mark.slow, pytest.mark.primary_only]  # ~15 s: a local cluster of two workers


def test_three_ways_side_by_side():
    result = run_program("bench.hosts.cross_session", "--sizes_kib=4,16", "--per_step=2", "--steps=2", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = re.findall(r"^\[chief\] +(\d+) (in-graph|collective|queue) +([\d.]+) +([\d.]+) +([\d.]+)x$", result.stdout,
                      re.M)
    assert [(kib, way) for kib, way, *_ in rows] == [(k, w) for k in ("4", "16")
                                                     for w in ("in-graph", "collective", "queue")]
    assert all(float(ms) > 0 for _, _, ms, _, _ in rows)
    assert [float(r[4]) for r in rows if r[1] == "in-graph"] == [1.0, 1.0]

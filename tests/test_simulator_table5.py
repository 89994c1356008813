"""The DAPPLE paper's Table 5 pattern in simulation (scripts/bench/memory/schedule_memory.py)."""


import pytest

from scripts.bench.memory.schedule_memory import GIB, table5_rows
from tests.shared_profiles import requires_profiles
from tests.programs import run_program

pytestmark = requires_profiles


def test_gpipe_memory_grows_dapple_memory_constant():
    rows = {(r["schedule"], r["M"]): r for r in table5_rows(micro_batches=(2, 3, 5, 8, 16))}
    gpipe = [rows[("gpipe", m)]["average_peak_bytes"] for m in (2, 3, 5, 8, 16)]
    assert all(a < b for a, b in zip(gpipe, gpipe[1:]))
    assert not rows[("gpipe", 2)]["oom"]
    for m in (3, 5, 8, 16):  # the paper: GPipe OOM from M = 3
        assert rows[("gpipe", m)]["oom"]
        assert max(rows[("gpipe", m)]["peak_bytes"]) > 16 * GIB
    dapple = [rows[("dapple", m)] for m in (2, 8, 16)]
    assert all(r["K"] == [2, 1] and not r["oom"] for r in dapple)
    assert {tuple(r["peak_bytes"]) for r in dapple} == {tuple(dapple[0]["peak_bytes"])}
    assert dapple[0]["peak_bytes"][0] == rows[("gpipe", 2)]["peak_bytes"][0]  # K_0 = M = 2
    assert dapple[0]["average_peak_bytes"] < rows[("gpipe", 2)]["average_peak_bytes"]
    throughput = [r["throughput"] for r in dapple]
    assert throughput[0] < throughput[1] < throughput[2]
    assert throughput[2] / throughput[0] > 1.3  # the paper: 8.18 / 5.10 = 1.6
    # Average peak memory close to the paper's 12.1 GB (GPipe, M=2) and 10.6 GB (DAPPLE).
    assert rows[("gpipe", 2)]["average_peak_bytes"] / GIB == pytest.approx(12.1, rel=0.1)
    assert dapple[0]["average_peak_bytes"] / GIB == pytest.approx(10.6, rel=0.1)


def test_output_only_activations_never_run_out_of_memory():
    rows = table5_rows(micro_batches=(16,), activation_multiplier=1.0)
    assert [r["oom"] for r in rows] == [False, False]


def test_script_prints_the_table():
    result = run_program("bench.memory.schedule_memory", "--micro_batches=2,3,16", timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].split()[:4] == ["schedule", "M", "K", "samples/s"]
    body = [line.split() for line in lines[2:8]]
    assert [(b[0], b[1]) for b in body] == [("gpipe", "2"), ("gpipe", "3"), ("gpipe", "16"),
                                           ("dapple", "2"), ("dapple", "3"), ("dapple", "16")]
    assert "OOM" in lines[3] and "OOM" not in lines[7]

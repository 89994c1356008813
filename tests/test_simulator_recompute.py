"""Re-computation in the simulator, its plan adapter and the Gantt picture: R boxes in the
backward's slot, one extra forward per micro-batch, boundary inputs kept per micro-batch in flight."""

import pytest

from planner.simulation.gantt import draw_gantt
from planner.formats.schedule import build_schedule
from planner.simulation.simulator import KIND_BACKWARD, KIND_FORWARD, KIND_RECOMPUTE, StageCost, simulate
from scripts.bench.memory.schedule_memory import table5_rows
from tests.shared_profiles import requires_profiles


def two_stages(kind, recompute, m=4):
    costs = [StageCost(1.0, 2.0, static_bytes=100.0, activation_bytes=10.0, recompute=recompute, boundary_bytes=1.0)
             for _ in range(2)]
    return simulate(costs, build_schedule(2, m, kind))


@pytest.mark.parametrize("kind,peaks,rc_peaks", [("gpipe", [140, 140], [113, 113]), ("dapple", [120, 110], [111, 110])])
def test_recompute_time_and_memory_by_hand(kind, peaks, rc_peaks):
    plain, rc = two_stages(kind, False), two_stages(kind, True)
    # (M + S - 1)(F + B) = 15 ms; with RC each of stage 0's 4 backwards waits for its R (1 ms): + 4 ms.
    assert (plain.iteration_ms, rc.iteration_ms) == (15.0, 19.0)
    assert [plain.stage_peak_memory(s) for s in range(2)] == peaks
    # GPipe: 4 boundary inputs + the 9 bytes more one micro-batch holds while recomputed;
    # DAPPLE stage 0 (K=2): the other micro-batch's boundary input + one full micro-batch.
    assert [rc.stage_peak_memory(s) for s in range(2)] == rc_peaks


@pytest.mark.parametrize("kind", ["gpipe", "dapple"])
def test_recompute_runs_right_before_its_backward(kind):
    rc = two_stages(kind, True)
    for s in range(2):
        lane = [e for e in rc.stage_events(s) if e.kind in (KIND_FORWARD, KIND_RECOMPUTE, KIND_BACKWARD)]
        assert sum(e.kind == KIND_RECOMPUTE for e in lane) == 4
        for e, after in zip(lane, lane[1:]):
            if e.kind == KIND_RECOMPUTE:
                assert (after.kind, after.micro_batch) == (KIND_BACKWARD, e.micro_batch)
                assert e.duration_ms == 1.0 and e.label == f"R{e.micro_batch}"
        assert rc.busy_ms(s) == two_stages(kind, False).busy_ms(s) + 4.0


def test_gantt_draws_recompute_boxes(tmp_path):
    info = draw_gantt([two_stages("gpipe", True), two_stages("dapple", False)], str(tmp_path / "rc.png"))
    assert info.boxes[KIND_RECOMPUTE] == 2 * 4
    assert info.boxes[KIND_FORWARD] == info.boxes[KIND_BACKWARD] == 2 * 2 * 4
    assert info.labels == 2 * 2 * 4 * 2 + 2 * 4


@requires_profiles
def test_simulated_table5_with_recompute():
    """BERT-48 on config B (scripts/bench/memory/schedule_memory.py): the paper's RC ratios."""
    rows = {(r["schedule"], r["M"]): r for r in table5_rows(micro_batches=(2, 16), recompute=(False, True))}
    for kind in ("gpipe", "dapple"):
        plain, rc = rows[(kind, 2)], rows[(kind + "+RC", 2)]
        assert rc["average_peak_bytes"] < 0.85 * plain["average_peak_bytes"]  # paper: 0.82, 0.80
        assert 0.7 < rc["throughput"] / plain["throughput"] < 0.9  # paper: 0.78, 0.83
        assert rc["result"].stage_events(0, (KIND_RECOMPUTE,))
    assert rows[("dapple+RC", 16)]["peak_bytes"] == rows[("dapple+RC", 2)]["peak_bytes"]
    ratio = rows[("dapple+RC", 16)]["average_peak_bytes"] / rows[("gpipe", 2)]["average_peak_bytes"]
    assert ratio == pytest.approx(0.70, abs=0.05)  # the paper's 0.70

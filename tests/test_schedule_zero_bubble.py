"""Zero-bubble schedules (planner/formats/zero_bubble.py): orders with W tasks, memory bound, and what the simulator
gives for them on unit costs (the zero-bubble paper's assumption F = B = W)."""

import pytest

from planner.formats.schedule import BACKWARD, FORWARD, WEIGHT, Schedule, ScheduleError, Task, build_schedule
from planner.simulation.simulator import StageCost, simulate


def test_zb_h1_two_stages_str():
    s = build_schedule(2, 4, "zb-h1")
    assert str(s).splitlines() == [
        "zb-h1 schedule, S=2 stages, M=4 micro-batches, K=[2, 1]",
        "stage 0: F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3",
        "stage 1: F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3",
    ]
    assert s.splits_backward and not build_schedule(2, 4, "dapple").splits_backward


@pytest.mark.parametrize("kind", ["zb-h1", "zb-h2"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m_factor", [1, 2, 4])
def test_every_task_once_no_deadlock_and_memory_bound(kind, stages, m_factor):
    m = stages * m_factor
    s = build_schedule(stages, m, kind)  # validates: F, B, W once each, in that order, and no deadlock
    done = set()
    for task in s.execution_order():
        assert all(d in done for d in task.dependencies(stages))
        done.add(task)
    assert len(done) == 3 * m * stages
    dapple = build_schedule(stages, m, "dapple")
    # activations live from F to W; zb-h1 never holds more than 1F1B's first stage, zb-h2 at most 2S - 1
    bound = max(dapple.peak_in_flight(i) for i in range(stages)) if kind == "zb-h1" else min(2 * stages - 1, m)
    assert max(s.peak_in_flight(i) for i in range(stages)) == bound


def test_max_in_flight_caps_zero_bubble_memory():
    s = build_schedule(4, 8, "zb-h2", max_in_flight=3)
    assert max(s.peak_in_flight(i) for i in range(4)) == 3


def test_weight_before_its_backward_is_rejected():
    bad = Schedule(kind="zb-h1", num_micro_batches=1, warmup=(1,),
                   stage_tasks=((Task(0, FORWARD, 0), Task(0, WEIGHT, 0), Task(0, BACKWARD, 0)),))
    with pytest.raises(ScheduleError, match="stage 0: W0 runs before B0"):
        bad.validate()
    missing = Schedule(kind="zb-h1", num_micro_batches=2, warmup=(1,), stage_tasks=((
        Task(0, FORWARD, 0), Task(0, BACKWARD, 0), Task(0, WEIGHT, 0), Task(0, FORWARD, 1), Task(0, BACKWARD, 1)),))
    with pytest.raises(ScheduleError, match="stage 0 must run F0..F1 and B0..B1 and W0..W1 exactly once"):
        missing.validate()
    with pytest.raises(ScheduleError, match="zb-h2 sets its own warm-up"):
        build_schedule(2, 4, "zb-h2", warmup=[2, 1])


def test_zb_h1_bounds_its_forwards_by_dapples_warm_up():
    """Given DAPPLE's K_i (a plan's, or policy B), zb-h1 runs as many warm-up forwards and never holds more
    micro-batches than the largest K_i: 1F1B's peak with those K_i."""
    explicit = build_schedule(3, 8, "zb-h1", warmup=[4, 2, 1])
    assert explicit.warmup == (4, 2, 1)
    assert max(explicit.peak_in_flight(i) for i in range(3)) == 4
    policy_b = build_schedule(3, 8, "zb-h1", policy="B")
    assert policy_b.warmup == build_schedule(3, 8, "dapple", policy="B").warmup == (5, 3, 1)


UNIT = StageCost(1.0, 2.0, activation_bytes=1.0, backward_input_ms=1.0)  # F = B = W = 1


@pytest.mark.parametrize("stages, m, zb_h1, zb_h2, one_f_one_b", [
    (2, 4, 13, 13, 15), (2, 8, 25, 25, 27), (3, 6, 21, 20, 24), (4, 8, 29, 27, 33), (4, 16, 53, 51, 57),
])
def test_simulated_unit_cost_iterations(stages, m, zb_h1, zb_h2, one_f_one_b):
    """The zero-bubble paper's bound on unit costs is 3M + S - 1 (ZB-H1); 1F1B without the B/W split takes
    3(M + S - 1). This list scheduling reaches the bound for two stages and stays a few units above it deeper."""
    iteration = {kind: simulate([UNIT] * stages, build_schedule(stages, m, kind)).iteration_ms
                 for kind in ("zb-h1", "zb-h2")}
    whole = simulate([StageCost(1.0, 2.0)] * stages, build_schedule(stages, m, "dapple")).iteration_ms
    assert (iteration["zb-h1"], iteration["zb-h2"], whole) == (zb_h1, zb_h2, one_f_one_b)
    assert 3 * m + stages - 1 <= zb_h2 <= zb_h1 < one_f_one_b


def test_simulated_zero_bubble_memory_and_w_boxes():
    """Activations are freed at the end of W: zb-h1 peaks at 1F1B's first-stage peak on every stage."""
    result = simulate([UNIT] * 4, build_schedule(4, 8, "zb-h1"))
    assert [result.stage_peak_memory(s) for s in range(4)] == [4.0] * 4
    assert [result.peak_in_flight(s) for s in range(4)] == [4] * 4
    weights = [e for e in result.events if e.kind == "weight_gradient"]
    assert len(weights) == 4 * 8 and all(e.duration_ms == 1.0 for e in weights)


def test_first_stage_backward_is_all_weight_gradient_by_default():
    """Without a measured split, the first stage's B is empty (its inputs need no gradient), others' half."""
    result = simulate([StageCost(1.0, 2.0)] * 2, build_schedule(2, 4, "zb-h1"))
    b = {s: [e.duration_ms for e in result.events if e.kind == "backward" and e.stage == s] for s in (0, 1)}
    assert b == {0: [0.0] * 4, 1: [1.0] * 4}


def test_bench_schedules_prints_each_schedule_for_the_paper_configurations():
    from tests.programs import run_program
    from tests.shared_profiles import PROFILES

    result = run_program("bench.planning.schedules", f"--profiles={PROFILES}", timeout=120)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("bert-48-pbs-2   paper_a")]
    assert [(r[4], r[5], r[6]) for r in rows] == [("dapple", "800.0", "1.000"), ("zb-h1", "741.1", "0.926"),
                                                  ("zb-h2", "734.5", "0.918"), ("interleaved", "755.1", "0.944")]
    assert rows[2][-1] == "yes"  # the planner writes zb-h2 into the plan
    # GNMT-16 on config B: 5 device groups, M = 32: no interleaved variant, and the line says why
    assert ("gnmt-16-pbs-64  paper_b  2:3:2:4:5      32  interleaved  none: the interleaved schedule needs M (32) to be "
            "a multiple of the device groups (5)") in result.stdout

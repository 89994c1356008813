"""planner.formats.schedule: orders, warm-up counts, in-flight micro-batches, validation."""

import pytest

from planner.formats.schedule import BACKWARD, FORWARD, Schedule, ScheduleError, Task, build_schedule, warmup_counts


def test_dapple_two_stages_str():
    s = build_schedule(2, 4, "dapple")
    assert str(s).splitlines()[1:] == [
        "stage 0: F0 F1 B0 F2 B1 F3 B2 B3",
        "stage 1: F0 B0 F1 B1 F2 B2 F3 B3",
    ]
    assert s.warmup == (2, 1)


def test_gpipe_order():
    s = build_schedule(3, 3, "gpipe")
    for stage in range(3):
        assert " ".join(map(str, s.stage_tasks[stage])) == "F0 F1 F2 B0 B1 B2"
        assert s.peak_in_flight(stage) == 3


def test_policies():
    assert warmup_counts(4, "A") == (4, 3, 2, 1)
    assert warmup_counts(4, "B") == (7, 5, 3, 1)
    assert warmup_counts(4, "B", max_in_flight=4) == (4, 4, 3, 1)
    with pytest.raises(ScheduleError, match="unknown warm-up policy 'C'"):
        warmup_counts(4, "C")


@pytest.mark.parametrize("stages", [1, 2, 4, 8])
@pytest.mark.parametrize("m_factor", [None, 1, 4])
def test_dapple_in_flight_is_min_k_m(stages, m_factor):
    for m in ([1, 2] if m_factor is None else [stages * m_factor]):
        s = build_schedule(stages, m, "dapple", policy="A")
        for i in range(stages):
            assert s.peak_in_flight(i) == min(stages - i, m)
        g = build_schedule(stages, m, "gpipe")
        assert all(g.peak_in_flight(i) == m for i in range(stages))


def test_in_flight_trace():
    s = build_schedule(2, 4, "dapple")
    assert s.in_flight(0) == (1, 2, 1, 2, 1, 2, 1, 0)


def test_explicit_warmup_that_deadlocks_is_rejected():
    with pytest.raises(ScheduleError, match="deadlocks: stage 0 waits at B0; stage 1 waits at F1"):
        build_schedule(2, 3, "dapple", warmup=[1, 2])


def test_backward_before_forward_is_rejected():
    bad = Schedule(
        kind="dapple",
        num_micro_batches=1,
        warmup=(1,),
        stage_tasks=((Task(0, BACKWARD, 0), Task(0, FORWARD, 0)),),
    )
    with pytest.raises(ScheduleError, match="stage 0: B0 runs before F0"):
        bad.validate()


def test_execution_order_respects_dependencies():
    s = build_schedule(4, 8, "dapple", policy="B")
    done = set()
    for task in s.execution_order():
        assert all(d in done for d in task.dependencies(4))
        done.add(task)
    assert len(done) == 4 * 16


def test_bad_arguments():
    with pytest.raises(ScheduleError, match="unknown schedule 'pipedream'"):
        build_schedule(2, 2, "pipedream")
    with pytest.raises(ScheduleError, match="at least one micro-batch"):
        build_schedule(2, 0)
    with pytest.raises(ScheduleError, match="got 1 warm-up counts for 2 stages"):
        build_schedule(2, 2, warmup=[1])

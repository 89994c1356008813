"""planner.formats.schedule: orders, warm-up counts, in-flight micro-batches, validation."""

import pytest

from planner.formats.schedule import (BACKWARD, FORWARD, Schedule, ScheduleError, Task, build_schedule, device_groups,
                                     warmup_counts)


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


def test_interleaved_orders_per_device_group():
    """Megatron's interleaved 1F1B: 2 device groups, 2 stages each (stage s on group s % 2), M=4."""
    schedule = build_schedule(4, 4, "interleaved", num_lanes=2)
    assert str(schedule).splitlines() == [
        "interleaved schedule, S=4 stages on 2 device groups, M=4 micro-batches, K=[5, 3]",
        "group 0: F0.s0 F1.s0 F0.s2 F1.s2 F2.s0 B0.s2 F3.s0 B1.s2 F2.s2 B0.s0 F3.s2 B1.s0 B2.s2 B3.s2 B2.s0 B3.s0",
        "group 1: F0.s1 F1.s1 F0.s3 B0.s3 F1.s3 B1.s3 F2.s1 B0.s1 F3.s1 B1.s1 F2.s3 B2.s3 F3.s3 B3.s3 B2.s1 B3.s1",
    ]
    assert schedule.num_lanes == 2 and schedule.lane_stages(1) == (1, 3) and schedule.lane_of(2) == 0
    assert [str(t) for t in schedule.stage_tasks[2]] == ["F0", "F1", "B0", "B1", "F2", "F3", "B2", "B3"]
    assert [schedule.lane_peak_in_flight(g) for g in range(2)] == [5, 3]
    assert len(schedule.execution_order()) == 32
    # with its own devices per stage, interleaved is 1F1B (policy A)
    assert build_schedule(3, 4, "interleaved").stage_tasks == build_schedule(3, 4, "dapple").stage_tasks


def test_interleaved_errors():
    with pytest.raises(ScheduleError, match=r"needs M \(3\) to be a multiple of the device groups \(2\)"):
        build_schedule(4, 3, "interleaved", num_lanes=2)
    with pytest.raises(ScheduleError, match=r"needs the stages \(3\) to be a multiple of the device groups \(2\)"):
        build_schedule(3, 4, "interleaved", num_lanes=2)
    with pytest.raises(ScheduleError, match="4 stages on 2 device groups share devices; only the 'interleaved' "
                                            "schedule runs several stages on one device, not 'zb-h1'"):
        build_schedule(4, 4, "zb-h1", num_lanes=2)
    with pytest.raises(ScheduleError, match="'interleaved' sets its own warm-up"):
        build_schedule(4, 4, "interleaved", num_lanes=2, warmup=[1, 1, 1, 1])
    good = build_schedule(4, 2, "interleaved", num_lanes=2)
    swapped = Schedule(good.kind, 2, good.warmup, good.stage_tasks, (good.lanes[0][1:2] + good.lanes[0][:1] +
                                                                     good.lanes[0][2:], good.lanes[1]))
    with pytest.raises(ScheduleError, match="group 0's order does not run stage 0's tasks in the stage's order"):
        swapped.validate()


def test_device_groups_of_stages():
    assert device_groups([["a"], ["b"], ["c"]]) == 3
    assert device_groups([["a", "b"], ["c"], ["a", "b"], ["c"]]) == 2
    with pytest.raises(ScheduleError, match="device 'a' is used by stages 0 and 1; adjacent stages cannot share"):
        device_groups([["a"], ["a"]])
    with pytest.raises(ScheduleError, match=r"stage 3 runs on \['b'\], but stages that share devices must take the "
                                            r"3 device groups round-robin: stage 3 on the devices of stage 0 \(\['a'\]\)"):
        device_groups([["a"], ["b"], ["c"], ["b"]])
    with pytest.raises(ScheduleError, match=r"stages 0 and 2 share devices \['a', 'b'\] but not all of them in the "
                                            r"same order"):
        device_groups([["a", "b"], ["c"], ["b", "a"], ["c"]])
    with pytest.raises(ScheduleError, match=r"stage 0 lists a device twice"):
        device_groups([["a", "a"]])

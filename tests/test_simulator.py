"""planner.simulation.simulator: event simulation of schedules with explicit stage costs (no profile needed)."""

import pytest

from planner.formats.schedule import build_schedule
from planner.simulation.simulator import (
    KIND_ALLREDUCE,
    KIND_BACKWARD,
    KIND_FORWARD,
    KIND_OPTIMIZER,
    KIND_SEND_ACTIVATION,
    KIND_SEND_GRADIENT,
    SimulationError,
    StageCost,
    simulate,
)

CASES = sorted({(s, m) for s in (2, 4, 8) for m in (1, 2, s, 4 * s)})


@pytest.mark.parametrize("stages,m", CASES)
@pytest.mark.parametrize("fwd,bwd", [(1.0, 2.0), (3.0, 1.0)])
def test_free_communication_gpipe_equals_dapple(stages, m, fwd, bwd):
    # Paper 3.2: same partition, micro-batches and mapping -> same bubble time as GPipe.
    costs = [StageCost(fwd, bwd, allreduce_ms=0.5 * (i + 1)) for i in range(stages)]
    gpipe = simulate(costs, build_schedule(stages, m, "gpipe"))
    dapple_a = simulate(costs, build_schedule(stages, m, "dapple", policy="A"))
    dapple_b = simulate(costs, build_schedule(stages, m, "dapple", policy="B"))
    # (M + S - 1) slots of F + B, then the last stage's... first stage's AllReduce ends last.
    expected = (m + stages - 1) * (fwd + bwd) + 0.5
    assert gpipe.iteration_ms == pytest.approx(expected)
    assert dapple_a.iteration_ms == pytest.approx(expected)
    assert dapple_b.iteration_ms == pytest.approx(expected)
    for i in range(stages):
        assert gpipe.stage_bubble_fraction(i) == pytest.approx(dapple_a.stage_bubble_fraction(i))


@pytest.mark.parametrize("stages,m", CASES)
def test_peak_in_flight_over_time(stages, m):
    costs = [StageCost(1.0, 2.0, activation_bytes=10.0, static_bytes=100.0) for _ in range(stages)]
    dapple = simulate(costs, build_schedule(stages, m, "dapple", policy="A"))
    gpipe = simulate(costs, build_schedule(stages, m, "gpipe"))
    for i in range(stages):
        assert dapple.peak_in_flight(i) == min(stages - i, m)
        assert gpipe.peak_in_flight(i) == m
        assert dapple.stage_peak_memory(i) == 100.0 + 10.0 * min(stages - i, m)
        assert gpipe.stage_peak_memory(i) == 100.0 + 10.0 * m


def test_dapple_is_not_slower_with_unbalanced_stages():
    # With unequal stages GPipe waits for all forwards of the slow stage; DAPPLE overlaps them.
    costs = [StageCost(1.0, 2.0), StageCost(2.0, 4.0), StageCost(0.5, 1.0)]
    gpipe = simulate(costs, build_schedule(3, 6, "gpipe"))
    dapple = simulate(costs, build_schedule(3, 6, "dapple"))
    # DAPPLE: stage 1 (the pivot) computes 6 x (2 + 4) ms without a gap from t=1, then B5 on stage 0.
    assert dapple.iteration_ms == pytest.approx(1.0 + 6 * 6.0 + 2.0)
    # GPipe: stage 1's forwards end at 13, stage 2's backwards start at 13.5, stage 1's run 14.5..38.5.
    assert gpipe.iteration_ms == pytest.approx(13.0 + 0.5 + 1.0 + 6 * 4.0 + 2.0)


def test_two_stage_timeline_by_hand():
    costs = [StageCost(1.0, 2.0, forward_transfer_ms=0.5, allreduce_ms=3.0, optimizer_ms=0.25),
             StageCost(1.0, 2.0, allreduce_ms=1.0, optimizer_ms=0.25)]
    r = simulate(costs, build_schedule(2, 2, "dapple"), micro_batch_size=4)
    got = {(e.kind, e.stage, e.micro_batch): (e.start_ms, e.end_ms) for e in r.events}
    assert got[(KIND_FORWARD, 0, 0)] == (0.0, 1.0)
    assert got[(KIND_FORWARD, 0, 1)] == (1.0, 2.0)
    assert got[(KIND_SEND_ACTIVATION, 0, 0)] == (1.0, 1.5)
    assert got[(KIND_FORWARD, 1, 0)] == (1.5, 2.5)
    assert got[(KIND_BACKWARD, 1, 0)] == (2.5, 4.5)
    assert got[(KIND_SEND_ACTIVATION, 0, 1)] == (2.0, 2.5)
    assert got[(KIND_FORWARD, 1, 1)] == (4.5, 5.5)
    assert got[(KIND_SEND_GRADIENT, 1, 0)] == (4.5, 5.0)
    assert got[(KIND_BACKWARD, 0, 0)] == (5.0, 7.0)
    assert got[(KIND_BACKWARD, 1, 1)] == (5.5, 7.5)
    assert got[(KIND_SEND_GRADIENT, 1, 1)] == (7.5, 8.0)
    assert got[(KIND_BACKWARD, 0, 1)] == (8.0, 10.0)
    assert got[(KIND_ALLREDUCE, 0, -1)] == (10.0, 13.0)
    assert got[(KIND_OPTIMIZER, 0, -1)] == (13.0, 13.25)
    assert got[(KIND_ALLREDUCE, 1, -1)] == (7.5, 8.5)
    assert r.iteration_ms == 13.25
    assert r.throughput == pytest.approx(8 / 0.01325)
    assert r.bubble_fraction == {0: pytest.approx(1 - 6.25 / 13.25), 1: pytest.approx(1 - 6.25 / 13.25)}


def test_overlapped_allreduce_starts_with_last_backward():
    costs = [StageCost(1.0, 2.0, allreduce_ms=3.0), StageCost(1.0, 2.0, allreduce_ms=1.0)]
    plain = simulate(costs, build_schedule(2, 2, "dapple"))
    overlapped = simulate(costs, build_schedule(2, 2, "dapple"), overlap_allreduce=True)
    # Stage 0: F0 0-1, F1 1-2, B0 4-6, B1 7-9; stage 1: F0 1-2, B0 2-4, F1 4-5, B1 5-7.
    assert plain.iteration_ms == 9.0 + 3.0
    # Overlapped: stage 0's AllReduce starts with its last backward (7) and ends at 10.
    assert overlapped.iteration_ms == 10.0
    ar0 = [e for e in overlapped.events if e.kind == KIND_ALLREDUCE and e.stage == 0][0]
    assert (ar0.start_ms, ar0.end_ms) == (7.0, 10.0)
    # A short AllReduce still cannot finish before the backward does.
    short = [StageCost(1.0, 2.0, allreduce_ms=0.5), StageCost(1.0, 2.0, allreduce_ms=0.5)]
    assert simulate(short, build_schedule(2, 2, "dapple"), overlap_allreduce=True).iteration_ms == 9.0


def test_shared_link_serialises_both_directions():
    costs = [StageCost(1.0, 1.0, forward_transfer_ms=1.0), StageCost(1.0, 1.0)]
    duplex = simulate(costs, build_schedule(2, 4, "gpipe"))
    shared = simulate(costs, build_schedule(2, 4, "gpipe"), duplex_links=False)
    assert {e.resource for e in duplex.events if e.kind == KIND_SEND_GRADIENT} == {"link1>0"}
    assert {e.resource for e in shared.events if e.kind == KIND_SEND_GRADIENT} == {"link0-1"}
    for r in (duplex, shared):
        link_events = sorted((e.start_ms, e.end_ms, e.resource) for e in r.events
                             if e.kind in (KIND_SEND_ACTIVATION, KIND_SEND_GRADIENT))
        for a, b in zip(link_events, link_events[1:]):
            if a[2] == b[2]:
                assert b[0] >= a[1]  # one transfer at a time per link
    # GPipe, M=4: F0..F3 on stage 1 end at 3,4,5,6? activations arrive at 2,3,4,5 -> F at 2..6,
    # backwards 6..10, gradients 7..11 -> stage 0 backwards end at 12.
    assert duplex.iteration_ms == 12.0
    assert shared.iteration_ms == 12.0


def test_replicated_stages_and_memory_cap():
    costs = [StageCost(1.0, 2.0, devices=(0, 1, 2), static_bytes=5e9, activation_bytes=2e9),
             StageCost(1.0, 2.0, devices=(3,), static_bytes=5e9, activation_bytes=2e9)]
    r = simulate(costs, build_schedule(2, 4, "gpipe"), device_memory_bytes=12e9)
    assert r.devices == (0, 1, 2, 3)
    assert r.peak_memory_bytes == {0: 13e9, 1: 13e9, 2: 13e9, 3: 13e9}
    assert r.out_of_memory
    d = simulate(costs, build_schedule(2, 4, "dapple"), device_memory_bytes=12e9)
    assert d.peak_memory_bytes == {0: 9e9, 1: 9e9, 2: 9e9, 3: 7e9}
    assert not d.out_of_memory
    text = d.summary()
    assert "stage  devices" in text and "    0      0-2" in text and "fits" in text
    assert "OUT OF MEMORY" in r.summary()


def test_memory_timeline_of_dapple_stage():
    costs = [StageCost(1.0, 2.0, static_bytes=1.0, activation_bytes=1.0) for _ in range(2)]
    r = simulate(costs, build_schedule(2, 3, "dapple"))
    # Stage 1: F0 1-2, B0 2-4, F1 4-5, B1 5-7, F2 7-8, B2 8-10.
    assert r.memory_timeline[1] == ((0.0, 1.0), (1.0, 2.0), (4.0, 2.0), (7.0, 2.0), (10.0, 1.0))


def test_errors():
    schedule = build_schedule(2, 2)
    with pytest.raises(SimulationError, match="got costs for 1 stages but the schedule has 2"):
        simulate([StageCost(1, 1)], schedule)
    with pytest.raises(SimulationError, match="stage 1: backward_ms must be >= 0, got -1"):
        simulate([StageCost(1, 1), StageCost(1, -1)], schedule)
    with pytest.raises(SimulationError, match="device 0 is used by stages 0 and 1"):
        simulate([StageCost(1, 1, devices=(0,)), StageCost(1, 1, devices=(0,))], schedule)
    with pytest.raises(SimulationError, match="stage 0 has no devices"):
        simulate([StageCost(1, 1, devices=()), StageCost(1, 1)], schedule)


def test_explicit_allreduce_tail():
    # The planner's per-layer overlap model gives the tail left after the last backward directly.
    costs = [StageCost(1.0, 2.0, allreduce_ms=3.0, allreduce_tail_ms=0.5), StageCost(1.0, 2.0)]
    r = simulate(costs, build_schedule(2, 2, "dapple"), overlap_allreduce=True)
    ar0 = [e for e in r.events if e.kind == KIND_ALLREDUCE and e.stage == 0][0]
    assert (ar0.start_ms, ar0.end_ms) == (7.0, 9.5)  # drawn from the last backward's start (7)
    assert r.iteration_ms == 9.5
    assert simulate(costs, build_schedule(2, 2, "dapple")).iteration_ms == 12.0  # no overlap: all 3 ms


def test_interleaved_divides_the_bubble_by_the_stages_per_device():
    """Two devices, stage s on device s % 2 (F = 1, B = 2 ms each): (M + (S/v - 1) / v)(F + B) per device, 27 ms at
    M = 4, where 1F1B with the same two devices as two stages of twice the layers takes (M + 1) 6 = 30 ms. A
    device's memory is its stages' together."""
    costs = [StageCost(1.0, 2.0, devices=(s % 2,), static_bytes=10.0, activation_bytes=1.0) for s in range(4)]
    schedule = build_schedule(4, 4, "interleaved", num_lanes=2)
    r = simulate(costs, schedule)
    assert r.iteration_ms == 27.0
    assert simulate([StageCost(2.0, 4.0)] * 2, build_schedule(2, 4, "dapple")).iteration_ms == 30.0
    assert r.device_stage == {0: 0, 1: 1} and r.device_stages(1) == (1, 3) and r.stage_devices(3) == [1]
    assert r.bubble_fraction[0] == pytest.approx(1 - 24 / 27)
    assert r.peak_memory_bytes == {0: 20.0 + schedule.lane_peak_in_flight(0), 1: 20.0 + schedule.lane_peak_in_flight(1)}
    assert {e.resource for e in r.events if e.kind == "forward"} == {"group0", "group1"}
    assert {e.resource for e in r.events if e.kind == "send_activation"} == {"link0>1", "link1>0"}
    for group, tasks in enumerate(schedule.lane_tasks):  # each device runs its group's order
        boxes = sorted((e for s in (group, group + 2) for e in r.stage_events(s, ("forward", "backward"))),
                       key=lambda e: e.start_ms)
        assert [(e.stage, e.label) for e in boxes] == [(t.stage, str(t)) for t in tasks]
    with pytest.raises(SimulationError, match=r"stage 2 runs on devices \[1\] but its device group 0 \(stage 0\) on \[0\]"):
        simulate([StageCost(1.0, 2.0, devices=(d,)) for d in (0, 1, 1, 0)], schedule)

"""A step split into compute, exposed AllReduce, exposed transfers and bubble per lane (planner/simulation/terms.py),
for the speed bench's line on where a traced step differs from the simulated one."""

import pytest

from planner.formats.schedule import build_schedule
from planner.simulation import terms
from planner.simulation.simulator import Event, SimulationResult, StageCost, simulate


def test_the_terms_add_up_to_the_step_on_every_lane():
    result = simulate([StageCost(1.0, 2.0, forward_transfer_ms=0.5, backward_transfer_ms=0.5, allreduce_ms=3.0)] * 2,
                      build_schedule(2, 4, "dapple"))
    split = terms.step_terms(result)
    assert split.step_ms == result.iteration_ms == 20.0
    assert split.compute == 12.0  # 4 x (1 + 2) per lane
    assert split.allreduce == 3.0  # nothing computes while it runs
    assert (split.transfers, split.bubble) == (2.0, 3.0)
    assert split.compute + split.transfers + split.allreduce + split.bubble == pytest.approx(split.step_ms)


def _result(events, step_ms):
    schedule = build_schedule(2, 1, "dapple")
    return SimulationResult(schedule=schedule, stages=(StageCost(1.0, 1.0),) * 2, events=tuple(events),
                            iteration_ms=step_ms, micro_batch_size=1, device_stage={0: 0, 1: 1},
                            memory_timeline=((), ()))


def test_overlapped_allreduce_and_transfers_count_only_where_nothing_computes():
    """Lane 0 computes 0-4 and 6-8; its AllReduce runs 3-7 (exposed 4-6), a transfer 5-9 (exposed 8-9 after the
    AllReduce's share); lane 1 computes 0-10. Means over the two lanes."""
    events = [Event("forward", 0, 0, 0.0, 4.0, "stage0"), Event("backward", 0, 0, 6.0, 8.0, "stage0"),
              Event("allreduce", 0, -1, 3.0, 7.0, "allreduce0"), Event("send_activation", 0, 0, 5.0, 9.0, "link0>1"),
              Event("forward", 1, 0, 0.0, 10.0, "stage1")]
    split = terms.step_terms(_result(events, 10.0))
    assert split.compute == pytest.approx((6 + 10) / 2)
    assert split.allreduce == pytest.approx(2 / 2)
    assert split.transfers == pytest.approx(1 / 2)
    assert split.bubble == pytest.approx(1 / 2)  # lane 0's 9-10


def test_disagreement_names_the_term_that_differs_most():
    measured = terms.StepTerms(110.0, 80.0, 5.0, 10.0, 15.0)
    simulated = terms.StepTerms(100.0, 79.0, 2.0, 9.0, 10.0)
    worst, rows = terms.disagreement(measured, simulated)
    assert worst == "bubble" and rows[0] == ("compute", 80.0, 79.0)
    assert terms.disagreement_text(measured, simulated) == (
        "step 110.0/100.0 ms (+10.0); compute 80.0/79.0, transfers 5.0/2.0, allreduce 10.0/9.0, bubble 15.0/10.0 ms "
        "measured/simulated; most off: bubble (+5.0 ms)")

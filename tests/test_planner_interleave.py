"""The interleaved variant of a plan (planner/planning/interleave.py) and the planner's choice of it
(schedule_choice.weigh_schedules): the re-cut, when it has none, and the simulated gain."""

import pytest

from planner.formats import cluster as cluster_lib, plan_pb2
from planner.formats.model_profile import ModelProfile
from planner.formats.schedule import schedule_kind
from planner.planning.interleave import balanced_chunks, interleaved_plan, why_not
from planner.planning.schedule_choice import describe, weigh_schedules
from planner.simulation.sim_adapter import simulate_plan


def uniform_model(n=8):
    return ModelProfile(name="u", names=[f"l{i}" for i in range(n)], descriptions=[""] * n, forward_ms=[1.0] * n,
                        backward_ms=[2.0] * n, activation_bytes=[1.0] * n, parameter_bytes=[1.0] * n,
                        inputs=[[i - 1] if i else [] for i in range(n)],
                        last_use=[i + 1 if i < n - 1 else i for i in range(n)])


def two_stage_plan(m=4, devices=((0,), (1,))):
    plan = plan_pb2.Plan(num_micro_batches=m, micro_batch_size=1, global_batch_size=m)
    plan.cluster.CopyFrom(cluster_lib.local_cluster(sum(len(d) for d in devices), memory_bytes=64e9))
    for first, devs in zip((0, 4), devices):
        stage = plan.stages.add(first_layer=first, last_layer=first + 3, warmup_micro_batches=2 - first // 4)
        stage.device_ids.extend(devs)
    return plan


def test_balanced_chunks_divide_by_each_stages_replication():
    assert balanced_chunks([1] * 8, range(1, 8), [1, 1, 1, 1]) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # stages on a group of 2 devices take twice the layers
    assert balanced_chunks([1] * 8, range(1, 8), [2, 1, 2, 1]) == [(0, 3), (3, 4), (4, 7), (7, 8)]
    assert balanced_chunks([1] * 8, [4], [1, 1]) == [(0, 4), (4, 8)]  # only where a cut may be
    with pytest.raises(ValueError, match="8 layers with 1 possible cuts cannot form 4 stages"):
        balanced_chunks([1] * 8, [4], [1] * 4)


def test_the_variant_keeps_the_device_groups_and_cuts_the_model_again():
    variant = interleaved_plan(two_stage_plan(devices=((0, 1), (2,))), uniform_model(), chunks=2)
    assert [(s.first_layer, s.last_layer, list(s.device_ids)) for s in variant.stages] == [
        (0, 2, [0, 1]), (3, 3, [2]), (4, 6, [0, 1]), (7, 7, [2])]
    assert [s.layer_names[0] for s in variant.stages] == ["l0", "l3", "l4", "l7"]
    assert schedule_kind(variant.schedule) == "interleaved"
    assert simulate_plan(variant, uniform_model()).schedule.lane_tasks[0][0].label == "F0.s0"


def test_why_a_plan_has_no_variant():
    model = uniform_model()
    assert why_not(two_stage_plan(m=3), model, 2) == (
        "the interleaved schedule needs M (3) to be a multiple of the device groups (2)")
    assert interleaved_plan(two_stage_plan(m=3), model) is None
    assert why_not(two_stage_plan(), uniform_model(3), 2) == "3 layers cannot form 4 stages"
    assert why_not(two_stage_plan(), model, 1) == "an interleaved variant needs at least 2 stages per device group, got 1"
    assert why_not(interleaved_plan(two_stage_plan(), model), model, 2) == "the plan's stages already share devices"
    one_stage = two_stage_plan()
    del one_stage.stages[1:]
    assert why_not(one_stage, model, 2) == "a plan of one stage has no bubble to interleave"


def test_the_planner_writes_the_interleaved_variant_when_it_is_fastest():
    """Uniform layers, 2 devices, M=4: 1F1B runs (M + S - 1)(F + B) plus pass overheads, interleaved with two
    stages per device (M + (S - 1) / 2)(F + B): the variant replaces the plan's stages."""
    plan = two_stage_plan()
    weigh_schedules(plan, uniform_model(), kinds=("dapple", "interleaved"))
    estimates = {schedule_kind(e.schedule): e.simulated_iteration_ms for e in plan.schedule_estimates}
    assert estimates["dapple"] == pytest.approx(62.0, abs=0.1)
    assert estimates["interleaved"] == pytest.approx(57.6, abs=0.1)
    assert schedule_kind(plan.schedule) == "interleaved" and plan.simulated_iteration_ms == estimates["interleaved"]
    assert [(s.first_layer, s.last_layer, list(s.device_ids)) for s in plan.stages] == [
        (0, 1, [0]), (2, 3, [1]), (4, 5, [0]), (6, 7, [1])]
    assert "  interleaved     57.60 ms (0.93x dapple), peak 0.00 GiB  <- chosen" in describe(plan)


def test_a_plan_without_a_variant_is_weighed_without_it():
    plan = two_stage_plan(m=3)
    weigh_schedules(plan, uniform_model(), kinds=("dapple", "interleaved"))
    assert [schedule_kind(e.schedule) for e in plan.schedule_estimates] == ["dapple"]
    assert len(plan.stages) == 2

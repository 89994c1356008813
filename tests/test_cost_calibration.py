"""What the cost model learns from measurements: the profiler's whole step (step_ms) and input-gradient
time (backward_input_ms), a cluster's measured AllReduce bandwidth and whether its devices' own cores
communicate, and profiles measured at several batch sizes."""

import pytest

from planner.planning import api, cost_model as cm
from planner.formats.cluster import local_task_cluster
from planner.formats.model_profile import ModelProfile
from planner.formats.profile import format_pipedream, parse_pipedream
from planner.formats import layer_cost_pb2
from planner.simulation.simulator import KIND_BACKWARD, KIND_SEND_GRADIENT, KIND_WEIGHT
from scripts.bench.speed import speedup_plans


def _profile(batch_size=8, step_ms=0.0, backward_input=0.0, forward=1.0, backward=2.0, layers=4):
    profile = layer_cost_pb2.LayerCostProfile(model_name="toy", batch_size=batch_size, step_ms=step_ms)
    for i in range(layers):
        layer = profile.layers.add(name=f"l{i}", index=i, forward_ms=forward, backward_ms=backward,
                                   backward_input_ms=backward_input if i else 0.0, activation_bytes=4096.0,
                                   parameter_bytes=2**20)
        if i:
            layer.inputs.append(f"l{i - 1}")
    return profile


def test_layer_times_are_scaled_to_the_measured_whole_step():
    plain = ModelProfile.from_proto(_profile())
    scaled = ModelProfile.from_proto(_profile(step_ms=15.0))  # layers sum to 12 ms
    assert plain.forward_ms == pytest.approx([1.0 / 8] * 4)
    assert scaled.forward_ms == pytest.approx([1.25 / 8] * 4)
    assert scaled.backward_ms == pytest.approx([2.5 / 8] * 4)


def test_step_ms_survives_pipedream_text():
    text = format_pipedream(_profile(step_ms=15.5))
    assert "# step_ms=15.5" in text
    assert parse_pipedream(text, "p.txt").step_ms == 15.5
    with pytest.raises(ValueError, match=r"p.txt:3: step_ms: not a non-negative number: 'fast'"):
        parse_pipedream(text.replace("15.5", "fast"), "p.txt")


def test_a_later_stage_sends_its_input_gradients_before_its_weight_gradients():
    cluster = local_task_cluster(2, 1)
    split = speedup_plans.make_plan("s", ModelProfile.from_proto(_profile(backward_input=0.5)), cluster, 8,
                                    [(0, 2, [0]), (2, 4, [1])], 2)
    result = speedup_plans.simulate(split, ModelProfile.from_proto(_profile(backward_input=0.5)))
    b = {e.micro_batch: e for e in result.events if e.kind == KIND_BACKWARD and e.stage == 1}
    w = {e.micro_batch: e for e in result.events if e.kind == KIND_WEIGHT and e.stage == 1}
    sends = {e.micro_batch: e for e in result.events if e.kind == KIND_SEND_GRADIENT}
    # per micro-batch of 4 samples: 2 layers x 0.5 ms x 4/8 + the pass overhead; W is the rest of 2 x 2 ms x 4/8
    assert b[0].duration_ms == pytest.approx(0.5 + cm.PASS_OVERHEAD_MS)
    assert w[0].duration_ms == pytest.approx(2.0 - 0.5)
    assert w[0].start_ms == pytest.approx(b[0].end_ms)
    assert sends[0].start_ms == pytest.approx(b[0].end_ms)  # not after W
    assert not [e for e in result.events if e.kind == KIND_WEIGHT and e.stage == 0]  # stage 0: no split
    unsplit = speedup_plans.simulate(split, ModelProfile.from_proto(_profile()))
    assert result.iteration_ms < unsplit.iteration_ms


def test_a_fused_backward_sends_its_input_gradients_when_it_ends():
    """PipelineOptions(input_gradients_first=False): the bench's -fused plans, simulated without the B/W split."""
    cluster, model = local_task_cluster(2, 1), ModelProfile.from_proto(_profile(backward_input=0.5))
    plans = {p.name: p for p in speedup_plans.bench_plans(model, cluster, 8, 2, [2], interleaved=False,
                                                          batched_w=False)}
    fused, split = plans["straight2-M2-fused"], plans["straight2-M2"]
    assert not fused.input_gradients_first and split.input_gradients_first
    assert "backward in TF's order" in speedup_plans.describe(fused)
    result = speedup_plans.simulate(fused, model)
    assert not [e for e in result.events if e.kind == KIND_WEIGHT]
    b = {e.micro_batch: e for e in result.events if e.kind == KIND_BACKWARD and e.stage == 1}
    sends = {e.micro_batch: e for e in result.events if e.kind == KIND_SEND_GRADIENT}
    assert b[0].duration_ms == pytest.approx(2.0 + cm.PASS_OVERHEAD_MS)  # 2 layers x 2 ms x 4/8, B and W
    assert sends[0].start_ms == pytest.approx(b[0].end_ms)
    assert result.iteration_ms > speedup_plans.simulate(split, model).iteration_ms
    zb = plans["straight2-M2-zb-h1"]
    with pytest.raises(ValueError, match="schedule 'zb-h1' splits every backward.*input_gradients_first=False"):
        speedup_plans.simulate(speedup_plans.BenchPlan("zb", zb.proto, input_gradients_first=False), model)


def test_batched_weight_gradients_run_after_each_stages_last_backward():
    """dapple-batched-w: every stage, the first too, runs B (its input gradients: layer 1's on stage 0, layer 0
    has none) per micro-batch and all its W at the end; W lasts what the slice's profile says (the
    stacked product's saving shows when W is costed by a profile measured at the stacked rows)."""
    cluster = local_task_cluster(2, 1)
    model = ModelProfile.from_proto(_profile(backward_input=0.5))
    plan = speedup_plans.make_plan("s", model, cluster, 8, [(0, 2, [0]), (2, 4, [1])], 2, "dapple-batched-w")
    result = speedup_plans.simulate(plan, model)
    for stage, b_ms in [(0, 0.25), (1, 0.5)]:
        b = sorted((e for e in result.events if e.kind == KIND_BACKWARD and e.stage == stage), key=lambda e: e.start_ms)
        w = sorted((e for e in result.events if e.kind == KIND_WEIGHT and e.stage == stage), key=lambda e: e.start_ms)
        assert [e.duration_ms for e in b] == pytest.approx([b_ms + cm.PASS_OVERHEAD_MS] * 2)
        assert [e.duration_ms for e in w] == pytest.approx([2.0 - b_ms] * 2)
        assert w[0].start_ms >= b[-1].end_ms
    # W costed at the stacked rows' profile (16 samples: backward 2 ms, of it 1 ms input gradients per layer, the
    # first layer's all weight gradient): per slice of 4, stage 0 W = 0.5 + 0.25, stage 1 W = 2 x 0.25; B unchanged
    stacked = speedup_plans.simulate(plan, model, stacked_profile=ModelProfile.from_proto(
        _profile(batch_size=16, backward_input=1.0)))
    for stage, b_ms, w_ms in [(0, 0.25, 0.75), (1, 0.5, 0.5)]:
        boxes = {kind: [e.duration_ms for e in stacked.events if e.kind == kind and e.stage == stage]
                 for kind in (KIND_BACKWARD, KIND_WEIGHT)}
        assert boxes == {KIND_BACKWARD: pytest.approx([b_ms + cm.PASS_OVERHEAD_MS] * 2),
                         KIND_WEIGHT: pytest.approx([w_ms] * 2)}
    assert stacked.iteration_ms < result.iteration_ms
    # the plan's stored stage costs (from the slice's profile) do not leak into the stacked W
    from planner.simulation.sim_adapter import simulate_plan
    direct = simulate_plan(plan.proto, model, stacked_profile=ModelProfile.from_proto(
        _profile(batch_size=16, backward_input=1.0)), optimizer_bandwidth=None)
    assert sorted(e.duration_ms for e in direct.events if e.kind == KIND_WEIGHT) == pytest.approx(
        sorted(e.duration_ms for e in stacked.events if e.kind == KIND_WEIGHT))


def test_measured_allreduce_bandwidth_and_cpu_communication():
    cluster = local_task_cluster(2, 1)
    assert cluster.communication_uses_compute
    assert not cm.overlaps_allreduce(cluster)
    per_byte = cm.allreduce_ms_per_byte(cluster, [0, 1])
    assert per_byte == pytest.approx(1e3 / cluster.inter_server_bandwidth)  # 2 (n-1)/n = 1 for n = 2
    cluster.allreduce_bandwidth = cluster.inter_server_bandwidth / 4
    assert cm.allreduce_ms_per_byte(cluster, [0, 1]) == pytest.approx(4 * per_byte)
    model = ModelProfile.from_proto(_profile())
    dp = speedup_plans.make_plan("dp2", model, cluster, 8, [(0, 4, [0, 1])], 1)
    assert dp.proto.stages[0].allreduce_ms == pytest.approx(4 * 2**20 * 4 * per_byte)
    # no overlap where the devices' cores communicate: the whole AllReduce follows the backward
    assert dp.proto.estimated_iteration_ms == pytest.approx(
        dp.proto.stages[0].forward_ms + dp.proto.stages[0].backward_ms + dp.proto.stages[0].allreduce_ms)


@pytest.mark.filterwarnings("ignore::planner.planning.api.MemoryLowerBoundWarning")
def test_each_plan_is_costed_by_the_profile_measured_nearest_to_its_slices():
    """Per sample, slices of 4 cost 4x slices of 8 here: data parallelism on 2 devices (slices of 4) loses to
    keeping whole micro-batches of 8 on a device, although costed with the batch-8 profile alone it wins."""
    cluster = local_task_cluster(2, 1)
    profiles = {4: ModelProfile.from_proto(_profile(batch_size=4, forward=2.0, backward=4.0)),
                8: ModelProfile.from_proto(_profile(batch_size=8, forward=1.0, backward=2.0))}
    chosen = api.plan_from_profiles(profiles, cluster, 8, micro_batch_sizes=[8])
    assert all(len(st.device_ids) == 1 for st in chosen.stages), chosen
    stages = [(st.first_layer, st.last_layer + 1, list(st.device_ids)) for st in chosen.stages]
    again = speedup_plans.make_plan("again", profiles[8], cluster, 8, stages, 1)
    assert chosen.estimated_iteration_ms == pytest.approx(again.proto.estimated_iteration_ms)
    dp_by_slices = speedup_plans.make_plan("dp2", profiles[4], cluster, 8, [(0, 4, [0, 1])], 1)
    dp_by_batch = speedup_plans.make_plan("dp2", profiles[8], cluster, 8, [(0, 4, [0, 1])], 1)
    assert dp_by_batch.proto.estimated_iteration_ms < chosen.estimated_iteration_ms
    assert chosen.estimated_iteration_ms < dp_by_slices.proto.estimated_iteration_ms
    with pytest.raises(api.PlanningError, match="needs at least one profile"):
        api.plan_from_profiles({}, cluster, 8)


@pytest.mark.filterwarnings("ignore::planner.planning.api.MemoryLowerBoundWarning")
def test_plans_from_profiles_selected_by_simulation_are_the_fastest_simulated():
    """select="simulation": no plan the bench measures simulates faster than the one chosen, each costed by the
    profile nearest to its slices (the bench's planner row)."""
    cluster = local_task_cluster(2, 1)
    cluster.allreduce_bandwidth = 2e8  # a slow AllReduce: data parallelism costs, pipelines compete
    profiles = {size: ModelProfile.from_proto(_profile(batch_size=size, backward_input=0.5, step_ms=14.0 * size / 8
                                                       + (2.0 if size < 8 else 0.0)))
                for size in (1, 2, 4, 8)}
    chosen = speedup_plans.planner_plan(profiles, cluster, 8)
    chosen_ms = speedup_plans.simulate(chosen, profiles[api.nearest_profile_size(
        profiles, api.largest_slice_of(chosen.proto))]).iteration_ms
    others = speedup_plans.bench_plans(profiles[8], cluster, 8, 2, [1, 2, 4, 8], zero_bubble=False, batched_w=False,
                                       interleaved=False)
    for plan in others:
        profile = profiles[api.nearest_profile_size(profiles, api.largest_slice_of(plan.proto))]
        assert chosen_ms <= speedup_plans.simulate(plan, profile).iteration_ms + 1e-6, plan.name
    by_latency = api.plan_from_profiles(profiles, cluster, 8)  # formula 2 picks an interleaved plan here
    assert by_latency.estimated_iteration_ms <= chosen.proto.estimated_iteration_ms + 1e-9
    latency_profile = profiles[api.nearest_profile_size(profiles, api.largest_slice_of(by_latency))]
    assert speedup_plans.simulate(speedup_plans.BenchPlan("l", by_latency), latency_profile).iteration_ms > chosen_ms


def test_devices_that_slow_each_other_cost_more_when_several_compute():
    cluster = local_task_cluster(2, 1)
    model = ModelProfile.from_proto(_profile())
    alone = speedup_plans.make_plan("single", model, cluster, 8, [(0, 4, [0])], 1).proto
    pipeline = speedup_plans.make_plan("s2", model, cluster, 8, [(0, 2, [0]), (2, 4, [1])], 2).proto
    cluster.concurrent_compute_slowdown = 1.25
    alone_slowed = speedup_plans.make_plan("single", model, cluster, 8, [(0, 4, [0])], 1).proto
    pipeline_slowed = speedup_plans.make_plan("s2", model, cluster, 8, [(0, 2, [0]), (2, 4, [1])], 2).proto
    assert alone_slowed.stages[0].forward_ms == alone.stages[0].forward_ms  # one device computes: no slowdown
    for before, after in zip(pipeline.stages, pipeline_slowed.stages):
        assert after.forward_ms == pytest.approx(1.25 * before.forward_ms)
        assert after.backward_ms == pytest.approx(1.25 * before.backward_ms)
    simulated = speedup_plans.simulate(speedup_plans.BenchPlan("s2", pipeline_slowed), model)
    assert [st.forward_ms for st in simulated.stages] == pytest.approx([st.forward_ms for st in pipeline_slowed.stages])


def test_batched_w_is_not_weighed_for_a_plan_that_recomputes():
    """The runtime refuses dapple-batched-w with re-computation (dapple_tf/rewrite/template/layout.py), so the planner's
    schedule choice leaves it out for such a plan."""
    from planner.formats.schedule import schedule_kind
    from planner.planning.schedule_choice import weigh_schedules

    model = ModelProfile.from_proto(_profile(backward_input=0.5))
    plan = speedup_plans.make_plan("s", model, local_task_cluster(2, 1), 8, [(0, 2, [0]), (2, 4, [1])], 2).proto
    weigh_schedules(plan, model, kinds=("dapple", "dapple-batched-w"))
    assert [schedule_kind(e.schedule) for e in plan.schedule_estimates] == ["dapple", "dapple-batched-w"]
    plan.stages[0].recompute = True
    weigh_schedules(plan, model, kinds=("dapple", "dapple-batched-w"))
    assert [schedule_kind(e.schedule) for e in plan.schedule_estimates] == ["dapple"]

"""The DAPPLE planner's own plan for the `local` cluster trains exactly like one device."""

import tensorflow as tf

import dapple_tf
from planner.planning import api
from planner.formats import cluster as cluster_lib
from planner.formats.schedule import schedule_kind
from planner.formats import layer_cost_pb2, write_message
from tests import toy_models
from tests.pipeline_harness import assert_close_dicts, train_pipelined, train_single

GLOBAL_BATCH = 16


def toy_profile(heavy_head: bool):
    """Per-layer costs for toy_models.skip_model_fn's layers (dense3 also reads dense0)."""
    profile = layer_cost_pb2.LayerCostProfile(model_name="toy_skip", batch_size=GLOBAL_BATCH)
    inputs = {"dense0": [], "dense1": ["dense0"], "dense2": ["dense1"], "dense3": ["dense2", "dense0"], "head": ["dense3"]}
    for i, name in enumerate(toy_models.LAYERS):
        layer = profile.layers.add(name=name, index=i, forward_ms=10.0, backward_ms=20.0)
        layer.activation_bytes = GLOBAL_BATCH * toy_models.HIDDEN * 4.0
        layer.parameter_bytes = 4e9 if heavy_head and name == "head" else 1e4
        layer.inputs.extend(inputs[name])
    return profile


def planned(heavy_head, tmp_path):
    cluster = cluster_lib.local_cluster(4, memory_bytes=64e9)
    cluster.intra_server_bandwidth = cluster.inter_server_bandwidth = 1e9
    proto = api.plan(toy_profile(heavy_head), cluster, GLOBAL_BATCH, planner="dapple")
    path = str(tmp_path / "plan.json")
    write_message(proto, path)
    return proto, dapple_tf.Plan.from_file(path)


def test_planner_plan_for_local_cluster(tmp_path):
    proto, plan = planned(True, tmp_path)
    assert proto.planner == "dapple"
    assert len(plan.stages) >= 2, proto  # the heavy, unreplicated head makes a pipeline pay off
    x, y = toy_models.batch(GLOBAL_BATCH)
    model_fn = toy_models.skip_model_fn(toy_models.initial_values())
    sgd = lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1)  # noqa: E731
    want_grads, want_weights, _ = train_single(model_fn, x, y, sgd, 3)
    schedule = schedule_kind(proto.schedule)
    assert plan.schedule_kind == schedule and len(proto.schedule_estimates) >= 3  # the planner weighed each
    grads, weights, _, handle, _ = train_pipelined(model_fn, x, y, sgd, plan, schedule, 3)
    assert_close_dicts(want_grads, grads)
    assert_close_dicts(want_weights, weights)
    assert [s.replication for s in handle.stages] == [len(s.device_ids) for s in proto.stages]
    assert handle.schedule == plan.schedule(schedule)
    if schedule in ("dapple", "zb-h1"):  # DAPPLE's K_i, which zb-h1 keeps as its bounds
        assert handle.schedule.warmup == tuple(s.warmup_micro_batches for s in proto.stages)


def test_the_planners_interleaved_variant_trains_like_one_device(tmp_path):
    """The plan file of an interleaved variant (two stages per device, stage s on device s % 2) loads with its
    schedule and trains like one device."""
    from planner.planning.interleave import interleaved_plan
    from planner.simulation.sim_adapter import model_profile

    cluster = cluster_lib.local_cluster(2, memory_bytes=64e9)
    proto = api.plan(toy_profile(False), cluster, GLOBAL_BATCH, planner="straight", schedules=("dapple",))
    proto.num_micro_batches, proto.micro_batch_size = 4, GLOBAL_BATCH // 4
    variant = interleaved_plan(proto, model_profile(toy_profile(False)), chunks=2)
    path = str(tmp_path / "interleaved.json")
    write_message(variant, path)
    plan = dapple_tf.Plan.from_file(path)
    assert plan.schedule_kind == "interleaved" and plan.num_device_groups == 2 and len(plan.stages) == 4
    x, y = toy_models.batch(GLOBAL_BATCH)
    model_fn = toy_models.skip_model_fn(toy_models.initial_values())
    sgd = lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1)  # noqa: E731
    want_grads, want_weights, _ = train_single(model_fn, x, y, sgd, 3)
    grads, weights, _, handle, _ = train_pipelined(model_fn, x, y, sgd, plan, None, 3)
    assert_close_dicts(want_grads, grads)
    assert_close_dicts(want_weights, weights)
    assert handle.schedule.kind == "interleaved" and handle.schedule.num_lanes == 2

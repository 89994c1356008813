"""Schedule "dapple-batched-w" (dapple_tf/rewrite/stages/weight_batching.py): every weight matrix's gradient is one
stacked product over all micro-batches' rows, the per-micro-batch products never run, and training equals one
device's (the equivalence over plan shapes is in test_pipeline_equivalence.py)."""

import numpy as np
import pytest
import tensorflow as tf

import dapple_tf
from planner.formats.schedule import BATCHED_W, FORWARD, WEIGHT, build_schedule, schedule_enum, schedule_kind
from tests import toy_models
from tests.pipeline_harness import SESSION_CONFIG, assert_close_dicts, cpu, train_pipelined, train_single


def test_schedule_defers_every_weight_gradient_to_the_end_of_its_stage():
    s = build_schedule(3, 4, BATCHED_W)
    assert str(s).splitlines() == [
        "dapple-batched-w schedule, S=3 stages, M=4 micro-batches, K=[3, 2, 1]",
        "stage 0: F0 F1 F2 B0 F3 B1 B2 B3 W0 W1 W2 W3",
        "stage 1: F0 F1 B0 F2 B1 F3 B2 B3 W0 W1 W2 W3",
        "stage 2: F0 B0 F1 B1 F2 B2 F3 B3 W0 W1 W2 W3",
    ]
    dapple = build_schedule(3, 4, "dapple")
    for stage in range(3):  # DAPPLE's F/B order, K_i included; activations live until the W: all M of them
        assert [t for t in s.stage_tasks[stage] if t.kind != WEIGHT] == list(dapple.stage_tasks[stage])
        assert s.peak_in_flight(stage) == 4
    assert build_schedule(2, 8, BATCHED_W, warmup=[3, 1]).warmup == (3, 1)
    assert schedule_kind(schedule_enum(BATCHED_W)) == BATCHED_W
    assert [t.kind for t in build_schedule(1, 2, BATCHED_W).stage_tasks[0]] == [FORWARD, "B", FORWARD, "B", WEIGHT, WEIGHT]


def _ran_matmuls(schedule, stages, m, n=16, handles=None, **options):
    """Names of the MatMul operations one traced training step ran (`handles`: a list the handle and the step's
    RunMetadata are added to)."""
    x, y = toy_models.batch(n)
    values = toy_models.initial_values()
    with tf.Graph().as_default() as graph:
        handle = dapple_tf.build_pipeline(toy_models.skip_model_fn(values), tf.constant(x), tf.constant(y),
                                          tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                          dapple_tf.Plan.from_stages(stages, num_micro_batches=m),
                                          dapple_tf.PipelineOptions(schedule=schedule, **options))
        if handles is not None:
            handles.append(handle)
        types = {op.name: op.type for op in graph.get_operations()}
        with tf.compat.v1.Session(config=handle.session_config(SESSION_CONFIG)) as sess:
            sess.run(handle.initializer)
            meta = tf.compat.v1.RunMetadata()
            sess.run(handle.train_op, options=tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
                     run_metadata=meta)
        if handles is not None:
            handles.append(meta)
    return [node.node_name for dev in meta.step_stats.dev_stats for node in dev.node_stats
            if types.get(node.node_name) == "MatMul"]


@pytest.mark.parametrize("stages", [[(0, 1, [cpu(0)]), (2, 4, [cpu(1)])],
                                    [(0, 1, [cpu(0), cpu(1)]), (2, 4, [cpu(2)])]], ids=["straight", "2:1"])
def test_one_stacked_product_per_weight_and_device(stages):
    """The toy model's 6 weight matrices (w0, w1 | w2, w3, skip, wo): M per-micro-batch weight products and
    their running sum become one product per weight and replica; forward and input-gradient products stay."""
    m = 4
    replicas = {"w0": len(stages[0][2]), "w1": len(stages[0][2]), "w2": 1, "w3": 1, "skip": 1, "wo": 1}
    dapple = _ran_matmuls("dapple", stages, m)
    batched = _ran_matmuls(BATCHED_W, stages, m)
    stacked = sorted(name for name in batched if name.startswith("batched_weight_gradient/"))
    assert stacked == sorted(f"batched_weight_gradient/{w}{'_' + str(r) if r else ''}/MatMul"
                             for w, count in replicas.items() for r in range(count))
    per_micro_batch = sum(replicas.values()) * m
    assert len(batched) == len(dapple) - per_micro_batch + len(stacked)


def test_weights_read_twice_keep_their_per_micro_batch_gradients():
    """A weight used by two layers (tied) has a sum of products per micro-batch: not stacked, still exact."""
    values = toy_models.initial_values()
    x, y = toy_models.batch(12)
    model_fn = toy_models.tied_model_fn(values)
    sgd = lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1)  # noqa: E731
    want_grads, want_weights, _ = train_single(model_fn, x, y, sgd, 2)
    plan = dapple_tf.Plan.from_stages([(0, 1, [cpu(0)]), (2, 2, [cpu(1)])], num_micro_batches=3)
    grads, weights, losses, handle, _ = train_pipelined(model_fn, x, y, sgd, plan, BATCHED_W, 2)
    assert handle.schedule.kind == BATCHED_W
    assert_close_dicts(want_grads, grads)
    assert_close_dicts(want_weights, weights)
    assert np.isfinite(losses).all()


def test_stages_are_cloned_where_functions_would_not_stack(monkeypatch):
    """Where the size would pick stage functions, dapple-batched-w clones (function calls compute their own weight
    gradients); asked for functions, it builds them and warns that nothing is stacked."""
    from dapple_tf.rewrite.stages import stage_function

    monkeypatch.setattr(stage_function, "AUTO_CLONED_OPS", 0)  # every model "large"
    monkeypatch.setattr(stage_function, "AUTO_COPIES", 0)
    stages, handles = [(0, 1, [cpu(0)]), (2, 4, [cpu(1)])], []
    _ran_matmuls("dapple", stages, 2, handles=handles)
    assert handles[-2].function_call_ops  # the default picks functions at this size
    stacked = [n for n in _ran_matmuls(BATCHED_W, stages, 2, handles=handles) if n.startswith("batched_weight")]
    assert not handles[-2].function_call_ops and len(stacked) == 6
    with pytest.warns(UserWarning, match="with stage_functions=True: each call computes its weight gradients itself"):
        ran = _ran_matmuls(BATCHED_W, stages, 2, handles=handles, stage_functions=True)
    assert handles[-2].function_call_ops and not [n for n in ran if n.startswith("batched_weight")]


def test_measured_timeline_spreads_the_stacked_w_over_the_micro_batches():
    """The measured timeline draws each stage's stacked product as one W box; its per-micro-batch stage cost (what
    a replay of the measured costs uses) counts M x (B + W) = every B and W box of the stage."""
    from dapple_tf.trace import timeline
    from planner.simulation.simulator import KIND_BACKWARD, KIND_WEIGHT

    m, handles = 4, []
    _ran_matmuls(BATCHED_W, [(0, 1, [cpu(0)]), (2, 4, [cpu(1)])], m, handles=handles)
    handle, meta = handles
    measured = timeline.measured_timeline(meta, handle)
    for stage in (0, 1):
        boxes = [e for e in measured.events if e.stage == stage and e.kind in (KIND_BACKWARD, KIND_WEIGHT)]
        last_w = [e for e in boxes if e.kind == KIND_WEIGHT and e.micro_batch == m - 1]
        assert last_w and max(e.end_ms for e in boxes) == last_w[-1].end_ms  # the stacked W ends the stage's work
        assert m * measured.stages[stage].backward_ms == pytest.approx(sum(e.duration_ms for e in boxes))

"""Stages built once as functions (dapple_tf/rewrite/stages/stage_function.py, issue 23): the graph grows by call sites
per micro-batch, not by the model's ops; build_pipeline's default switches to them for large clones; stages the path
does not cover are imported per clone, with the reason."""

import types

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context

import dapple_tf
from dapple_tf.rewrite.stages import stage_function
from tests import toy_models
from tests.pipeline_harness import assert_close_dicts, cpu, split_options, train_pipelined, train_single

STAGES = [(0, 1, [cpu(0)]), (2, 4, [cpu(1)])]


def build(m, stage_functions, model_fn=None, stages=STAGES, **kwargs):
    """(ops in the graph, stage functions in its library, handle) of the toy model's pipeline at M=m."""
    x, y = toy_models.batch(16)
    with tf.Graph().as_default() as graph:
        options, rest = split_options(stage_functions=stage_functions, **kwargs)
        handle = dapple_tf.build_pipeline(
            model_fn or toy_models.skip_model_fn(toy_models.initial_values()), tf.constant(x), tf.constant(y),
            tf.compat.v1.train.GradientDescentOptimizer(0.1), dapple_tf.Plan.from_stages(stages, m), options, **rest
        )
        library = [f.signature.name for f in graph.as_graph_def().library.function if "dapple_stage" in f.signature.name]
        return len(graph.get_operations()), library, handle


def test_functions_add_call_sites_per_micro_batch_not_the_models_ops():
    clones = {m: build(m, False)[0] for m in (2, 8)}
    functions = {m: build(m, True) for m in (2, 8)}
    per_m_clones = (clones[8] - clones[2]) / 6
    per_m_functions = (functions[8][0] - functions[2][0]) / 6
    assert per_m_functions < 0.5 * per_m_clones, (per_m_functions, per_m_clones)
    # F, B, W and W adding to the running sums for the last stage; no B for the first (nobody needs its input
    # gradients): whatever M is
    for m in (2, 8):
        names = functions[m][1]
        assert sorted(n.split("dapple_")[1].rsplit("_", 1)[0] for n in names) == [
            "stage0_F", "stage0_W", "stage0_Wsum", "stage1_B", "stage1_F", "stage1_W", "stage1_Wsum"], names
        assert functions[m][2].function_fallbacks == {}


def _reference_typed_stops(op):
    return [c for c in op.control_inputs if any(t.dtype._is_ref_dtype for t in c.outputs)]


def test_calls_are_remote_calls_on_their_own_device_with_the_traced_shapes():
    """By default each call is a RemoteCall aimed at its own device (an empty target), carries the traced function's
    output shapes and follows a reference-typed operation on its device (XLA's scan then skips its body); grappler's
    function optimizer leaves such calls alone, so the handle's session config is the caller's, without grappler's
    deadline."""
    _, _, handle = build(4, True)
    assert len(handle.function_call_ops) == 4 * (2 + 3)  # per micro-batch: stage 0 F and W; stage 1 F, B and W
    for op in handle.function_call_ops:
        assert op.type == "RemoteCall", op.type
        assert tf.get_static_value(op.inputs[0]) == b"", op.inputs[0]
        assert all(t.shape.is_fully_defined() for t in op.outputs), op.name
        assert [c.device for c in _reference_typed_stops(op)] == [op.device], (op.name, op.control_inputs)
    base = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=3)
    assert handle.session_config(base) == without_deadline(base)
    assert handle.session_config() == without_deadline(context.context().config)


def without_deadline(config: tf.compat.v1.ConfigProto) -> tf.compat.v1.ConfigProto:
    out = tf.compat.v1.ConfigProto()
    out.CopyFrom(config)
    out.graph_options.rewrite_options.meta_optimizer_timeout_ms = -1
    return out


def test_session_config_lifts_grapplers_deadline_unless_the_caller_set_one():
    """TF's 5-minute default made a loaded machine's result differ in the last bits: grappler stopped part way
    through the graph (docs/performance.md, "Determinism"); a deadline the caller sets is the caller's."""
    _, _, handle = build(2, False)
    base = tf.compat.v1.ConfigProto(device_count={"CPU": 2})
    assert base.graph_options.rewrite_options.meta_optimizer_timeout_ms == 0  # TF's default: 5 minutes
    assert handle.session_config(base).graph_options.rewrite_options.meta_optimizer_timeout_ms == -1
    assert base.graph_options.rewrite_options.meta_optimizer_timeout_ms == 0  # a copy
    base.graph_options.rewrite_options.meta_optimizer_timeout_ms = 60000
    assert handle.session_config(base) == base


def test_calls_on_gpus_and_traced_calls_stay_partitioned_calls():
    """RemoteCall is what was measured, on CPUs; a GPU's calls keep grappler's optimization of their bodies."""
    assert stage_function.call_op_type("/device:CPU:1", traced=False) == "RemoteCall"
    assert stage_function.call_op_type("/job:worker/replica:0/task:1/device:CPU:0", traced=False) == "RemoteCall"
    assert stage_function.call_op_type("/device:GPU:0", traced=False) == "PartitionedCall"
    assert stage_function.call_op_type("/job:worker/task:0/device:GPU:1", traced=False) == "PartitionedCall"
    assert stage_function.call_op_type("/device:CPU:0", traced=True) == "PartitionedCall"


def test_traced_calls_skip_shape_inference_and_the_session_config_turns_the_function_optimizer_off():
    """PipelineOptions(traced_functions=True): PartitionedCall ops (their bodies in a traced step), made without
    shape inference through the body; where the stages' calls are the graph's only function calls, the handle's
    session config turns grappler's function optimizer off for the outer graph, and leaves it on for clones or when
    something else calls a function."""
    off = tf.compat.v1.ConfigProto()
    off.graph_options.rewrite_options.function_optimization = off.graph_options.rewrite_options.OFF
    off.graph_options.rewrite_options.meta_optimizer_timeout_ms = -1
    _, _, handle = build(4, True, traced_functions=True)
    assert len(handle.function_call_ops) == 4 * (2 + 3)
    for op in handle.function_call_ops:
        assert op.type == "PartitionedCall" and op.get_attr("_disable_call_shape_inference")
        assert all(t.shape.is_fully_defined() for t in op.outputs), op.name
        assert [c.device for c in _reference_typed_stops(op)] == [op.device], (op.name, op.control_inputs)
    base = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=3)
    config = handle.session_config(base)
    assert config.intra_op_parallelism_threads == 3 and config.graph_options == off.graph_options
    assert base.graph_options.rewrite_options.function_optimization == 0  # a copy
    default = handle.session_config()  # tf.compat.v1.Session's own default (this process's logical devices), optimizer off
    assert default.device_count["CPU"] == len(tf.config.list_logical_devices("CPU")) >= 2
    # the process's own rewrite options kept (disable_mixed_precision_graph_rewrite, run before in this process,
    # leaves auto_mixed_precision OFF in them)
    expected = without_deadline(context.context().config).graph_options.rewrite_options
    expected.function_optimization = expected.OFF
    assert default.graph_options.rewrite_options == expected
    assert build(4, False)[2].session_config(base) == without_deadline(base)
    assert build(4, False)[2].session_config() == without_deadline(context.context().config)
    with handle.train_op.graph.as_default():
        tf.function(lambda x: x + 1.0, autograph=False)(tf.constant(1.0))  # another function call
    assert handle.session_config(base) == without_deadline(base)


def test_traced_calls_record_their_bodies_in_a_traced_step_and_remote_calls_do_not():
    """What traced_functions is for: a FULL_TRACE step's step stats list the bodies' operations (the toy model's
    MatMuls) for PartitionedCall stages, and only the call operations for RemoteCall stages."""
    x, y = toy_models.batch(16)

    def traced_types(traced):
        with tf.Graph().as_default():
            handle = dapple_tf.build_pipeline(
                toy_models.skip_model_fn(toy_models.initial_values()), tf.constant(x), tf.constant(y),
                tf.compat.v1.train.GradientDescentOptimizer(0.1), dapple_tf.Plan.from_stages(STAGES, 2),
                dapple_tf.PipelineOptions(stage_functions=True, traced_functions=traced))
            with tf.compat.v1.Session(config=handle.session_config(tf.compat.v1.ConfigProto(
                    device_count={"CPU": 2}))) as sess:
                sess.run(handle.initializer)
                metadata = tf.compat.v1.RunMetadata()
                sess.run(handle.train_op, options=tf.compat.v1.RunOptions(trace_level=3), run_metadata=metadata)
        return [n.timeline_label.split(" = ")[-1].split("(")[0] for d in metadata.step_stats.dev_stats
                for n in d.node_stats]

    traced, remote = traced_types(True), traced_types(False)
    assert traced.count("PartitionedCall") == 10 and any("MatMul" in t for t in traced), sorted(set(traced))
    assert remote.count("RemoteCall") == 10 and not any("MatMul" in t for t in remote), sorted(set(remote))


def test_default_uses_functions_when_the_clones_would_be_large():
    """Functions when the forward clones would pass both AUTO_COPIES copies of the stages and AUTO_CLONED_OPS
    operations; the toy model's clones are small at any M here."""
    stage = types.SimpleNamespace(ops=[None] * 1000, stage=types.SimpleNamespace(devices=["a", "b"]))
    assert (stage_function.AUTO_CLONED_OPS, stage_function.AUTO_COPIES) == (10_000, 4)
    assert not stage_function.use_functions(None, [stage], 2)  # 1000 ops x 2 replicas x 2 = 4 copies
    assert stage_function.use_functions(None, [stage], 6)  # 12,000 ops, 12 copies
    small = types.SimpleNamespace(ops=[None] * 100, stage=types.SimpleNamespace(devices=["a"]))
    assert not stage_function.use_functions(None, [small], 100)  # 100 copies, 10,000 operations
    assert stage_function.use_functions(None, [small], 101)
    big = types.SimpleNamespace(ops=[None] * 20_000, stage=types.SimpleNamespace(devices=["a"]))
    assert not stage_function.use_functions(None, [big], 4) and stage_function.use_functions(None, [big], 5)
    assert stage_function.use_functions(True, [stage], 1) and not stage_function.use_functions(False, [stage], 99)
    _, library, _ = build(8, None)  # the toy model's clones are small: imported per micro-batch
    assert library == []


def deep_model_fn(depth):
    """`depth` tanh layers of width 8 (layers "l0", ...), then a softmax head: a model whose size the test picks."""
    def model_fn(features, labels):
        rng = np.random.RandomState(0)
        h = features
        for i in range(depth):
            with dapple_tf.layer(f"l{i}"):
                w = tf.compat.v1.get_variable(f"w{i}", initializer=tf.constant(rng.randn(8, 8).astype(np.float32) / 3))
                h = tf.tanh(tf.matmul(h, w))
        with dapple_tf.layer("head"):
            w = tf.compat.v1.get_variable("head", initializer=tf.constant(rng.randn(8, 2).astype(np.float32)))
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=tf.matmul(h, w)))
    return model_fn


def test_the_defaults_operations_per_micro_batch_do_not_grow_with_the_model(monkeypatch):
    """build_pipeline's defaults once the clones pass AUTO_CLONED_OPS (lowered here for small models) and
    AUTO_COPIES (M=8, M=12): each extra micro-batch adds the same operations (the calls and their feeds) to a model
    of 4 layers and to one of 16, where the clones add a copy of the model (counts)."""
    monkeypatch.setattr(stage_function, "AUTO_CLONED_OPS", 0)
    x = np.random.RandomState(1).randn(24, 8).astype(np.float32)
    y = np.arange(24, dtype=np.int32) % 2

    def ops(depth, m, stage_functions):
        with tf.Graph().as_default() as graph:
            half = depth // 2
            plan = dapple_tf.Plan.from_stages([("l0", f"l{half - 1}", [cpu(0)]), (f"l{half}", "head", [cpu(1)])], m)
            handle = dapple_tf.build_pipeline(deep_model_fn(depth), tf.constant(x), tf.constant(y),
                                              tf.compat.v1.train.GradientDescentOptimizer(0.1), plan,
                                              dapple_tf.PipelineOptions(stage_functions=stage_functions))
            return len(graph.get_operations()), bool(handle.function_call_ops)

    assert ops(4, 2, None)[1] is False  # 4 copies: clones
    per_m, clones_per_m = {}, {}
    for depth in (4, 16):
        (at8, functions8), (at12, functions12) = ops(depth, 8, None), ops(depth, 12, None)
        assert functions8 and functions12
        per_m[depth] = (at12 - at8) / 4
        clones_per_m[depth] = (ops(depth, 12, False)[0] - ops(depth, 8, False)[0]) / 4
    assert per_m[4] == per_m[16] < clones_per_m[4] < clones_per_m[16], (per_m, clones_per_m)
    assert clones_per_m[16] > 3 * per_m[16], (per_m, clones_per_m)


def test_a_replicated_stage_imports_its_last_backward_for_the_allreduce_overlap():
    stages = [(0, 1, [cpu(0), cpu(1)]), (2, 4, [cpu(2)])]
    _, _, handle = build(4, True, stages=stages)
    graph_ops = {}
    for (device, task, replica), names in handle.task_op_names.items():
        graph_ops[(task.stage, task.kind, task.micro_batch, replica)] = names
    last = max(t.micro_batch for t in handle.schedule.stage_tasks[0] if t.kind == "B")
    for m in range(4):
        forward = graph_ops[(0, "F", m, 0)]
        calls = [n for n in forward if n.endswith("RemoteCall")]
        assert bool(calls) == (m != last), (m, calls)


def seeded_dropout_model_fn(features, labels):
    with dapple_tf.layer("dense0"):
        h = tf.nn.dropout(tf.tanh(tf.matmul(features, tf.compat.v1.get_variable(
            "w0", initializer=tf.constant(toy_models.initial_values()["w0"])))), rate=0.5, seed=7)
    with dapple_tf.layer("head"):
        w = tf.compat.v1.get_variable("w1", initializer=tf.constant(
            toy_models.initial_values()["w1"][:, : toy_models.CLASSES]))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=tf.matmul(h, w)))


@pytest.mark.parametrize("case, expected", [
    ("recompute", {0: "re-computation"}),
    ("seeded", {0: "seeded random ops"}),
])
def test_stages_the_functions_do_not_cover_are_imported_and_say_why(case, expected):
    if case == "recompute":
        _, _, handle = build(2, True, recompute=[0])
    else:
        _, _, handle = build(2, True, model_fn=seeded_dropout_model_fn,
                             stages=[("dense0", "dense0", [cpu(0)]), ("head", "head", [cpu(1)])])
    assert sorted(handle.function_fallbacks) == sorted(expected)
    for s, words in expected.items():
        assert words in handle.function_fallbacks[s], handle.function_fallbacks


def tied_embedding_model_fn(features, labels):
    """The embedding table looked up in the first stage and, read there, used as the output projection of the
    last: a variable read whose value leaves the stage (it stays a handle in the stage's functions)."""
    rng = np.random.RandomState(3)
    with dapple_tf.layer("embed"):
        table = tf.compat.v1.get_variable("table", initializer=tf.constant(
            rng.randn(toy_models.VOCAB, toy_models.EMBED).astype(np.float32)))
        with tf.control_dependencies([tf.convert_to_tensor(table)]):  # a control edge on a read of the table
            vectors = tf.nn.embedding_lookup(table, features["ids"])
        projection = tf.convert_to_tensor(table)  # read here, used only by the head
    with dapple_tf.layer("head"):
        pooled = tf.reduce_mean(vectors, axis=1) + features["dense"]
        logits = tf.matmul(pooled, projection, transpose_b=True)[:, :2]
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def test_a_variable_read_for_a_later_stage_trains_like_single_device():
    x, y = toy_models.embedding_batch(8)
    sgd = lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1)  # noqa: E731
    want_grads, want_weights, _ = train_single(tied_embedding_model_fn, x, y, sgd, 2)
    plan = dapple_tf.Plan.from_stages([("embed", "embed", [cpu(0)]), ("head", "head", [cpu(1)])], 2)
    grads, weights, _, handle, _ = train_pipelined(tied_embedding_model_fn, x, y, sgd, plan, "dapple", 2,
                                                   stage_functions=True)
    assert handle.function_fallbacks == {}
    assert_close_dicts(want_grads, grads)
    assert_close_dicts(want_weights, weights)

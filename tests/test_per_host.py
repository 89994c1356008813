"""Per-host graphs (PipelineOptions.own_task, issue 46): every task builds only its part, and trains exactly as the
one graph for the whole cluster does (tests/per_host_probe.py runs both over in-process worker tasks)."""

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

import dapple_tf
from dapple_tf.errors import PerHostError, PlanError
from tests import toy_models
from tests.programs import ROOT

CASES = {
    "straight": {"stages": [[0, 2, [[0, 0]]], [3, 4, [[1, 0]]]], "micro_batches": 2},
    "skip-over-tasks": {"stages": [[0, 0, [[0, 0]]], [1, 2, [[1, 0]]], [3, 4, [[2, 0]]]], "micro_batches": 3,
                        "batch": 12},
    "data-parallel": {"stages": [[0, 4, [[0, 0], [1, 0]]]], "micro_batches": 1},
    "data-parallel-3-uneven": {"stages": [[0, 4, [[0, 0], [1, 0], [2, 1]]]], "micro_batches": 2, "batch": 14},
    # four devices halve and double twice (halving_exchange.py); the two of task 2 are partners in a round
    "data-parallel-4-two-rounds": {"stages": [[0, 4, [[0, 0], [1, 0], [2, 0], [2, 1]]]], "micro_batches": 1,
                                   "batch": 16},
    "functions-zb-h1": {"stages": [[0, 1, [[0, 0]]], [2, 4, [[1, 0]]]], "micro_batches": 4, "schedule": "zb-h1",
                        "stage_functions": True},
    "tied": {"stages": [[0, 0, [[0, 0]]], [1, 2, [[1, 0]]]], "micro_batches": 2, "model": "tied"},
    "hybrid": {"stages": [[0, 1, [[0, 0], [1, 0]]], [2, 4, [[2, 0]]]], "micro_batches": 2},
    "hybrid-3-stages": {"stages": [[0, 0, [[0, 0]]], [1, 2, [[1, 0], [1, 1], [2, 0]]], [3, 4, [[2, 1], [0, 1]]]],
                        "micro_batches": 2, "batch": 24},
    # two copies of a variable of task 0 in task 1 (the fuzz harness's seed 11, case 5)
    "two-copies-in-one-task": {"stages": [[0, 2, [[0, 0]]], [3, 4, [[0, 1], [1, 0], [1, 1]]]], "micro_batches": 1},
    # an embedding (gathered rows' gradients) replicated over two tasks (the fuzz harness's seed 13, case 22)
    "embedding-data-parallel": {"stages": [[0, 2, [[0, 0], [1, 0]]]], "micro_batches": 1, "model": "embedding"},
    "embedding-clip": {"stages": [[0, 0, [[0, 0], [1, 0]]], [1, 2, [[1, 1]]]], "micro_batches": 2,
                       "model": "embedding", "clip": 0.5},
    # the global norm of every task's gradients (clip_global_norm), the scale sent back to every task
    "clip-hybrid-3-stages": {"stages": [[0, 0, [[0, 0]]], [1, 2, [[1, 0], [1, 1], [2, 0]]], [3, 4, [[2, 1], [0, 1]]]],
                             "micro_batches": 2, "batch": 24, "clip": 0.1},
    "clip-data-parallel-3-uneven": {"stages": [[0, 4, [[0, 0], [1, 0], [2, 1]]]], "micro_batches": 2, "batch": 14,
                                    "clip": 0.1},
    # batch-norm updates, summaries and extra outputs of stages on other tasks than the loss's: combined there
    "batch-norm-straight": {"stages": [[0, 2, [[0, 0]]], [3, 4, [[1, 0]]]], "micro_batches": 2,
                            "model": "batch_norm"},
    "batch-norm-hybrid-3-stages": {"stages": [[0, 0, [[0, 0]]], [1, 2, [[1, 0], [1, 1], [2, 0]]],
                                              [3, 4, [[2, 1], [0, 1]]]], "micro_batches": 2, "batch": 24,
                                   "model": "batch_norm"},
    # a script's own training step (tests/script_models.py): TF1 BERT's tf.clip_by_global_norm between its
    # tf.gradients and Adam's apply, replayed on the loss's task from every task's gradients; with gathered rows;
    # a per-gradient transform leaving one variable out; Adam's own minimize (its beta powers on task 0)
    "script-bert-hybrid": {"stages": [[0, 0, [[0, 0], [1, 0]]], [1, 2, [[2, 0]]]], "micro_batches": 2,
                           "model": "script:bert"},
    "script-sparse-clip": {"stages": [[0, 0, [[0, 0], [1, 0]]], [1, 2, [[1, 1]]]], "micro_batches": 2,
                           "model": "script:sparse_clip"},
    "script-scaled": {"stages": [[0, 0, [[0, 0]]], [1, 2, [[1, 0], [2, 0]]]], "micro_batches": 2,
                      "model": "script:scaled"},
    "script-adam-straight": {"stages": [[0, 0, [[0, 0]]], [1, 2, [[1, 0]]]], "micro_batches": 2,
                             "model": "script:adam"},
    # a table gathered on task 0 and multiplied whole on task 1 (tied embeddings): both sum it dense, as one graph
    "tied-embedding": {"stages": [[0, 0, [[0, 0]]], [1, 2, [[1, 0]]]], "micro_batches": 2, "model": "tied_embedding"},
    "tied-embedding-clip": {"stages": [[0, 0, [[0, 0]]], [1, 2, [[1, 0]]]], "micro_batches": 2,
                            "model": "tied_embedding", "clip": 0.5},
    # gradient_fn (each gradient divided by 1 + their global norm) on the loss's task, from every task's gradients
    "gradient-fn-hybrid-3-stages": {"stages": [[0, 0, [[0, 0]]], [1, 2, [[1, 0], [2, 0]]], [3, 4, [[2, 1]]]],
                                    "micro_batches": 2, "gradient_fn": True},
    "gradient-fn-embedding-clip": {"stages": [[0, 0, [[0, 0], [1, 0]]], [1, 2, [[1, 1]]]], "micro_batches": 2,
                                   "model": "embedding", "clip": 0.5, "gradient_fn": True},
    # a batch norm in a stage replicated over two tasks: grappler's arithmetic optimizer rewrites its graphs
    # differently per host (the last bits of the weights after three steps; identical without it), so it is off here
    "batch-norm-replicated-over-tasks": {"stages": [[0, 2, [[0, 0], [1, 0]]], [3, 4, [[2, 0]]]], "micro_batches": 2,
                                         "batch": 24, "model": "batch_norm", "arithmetic": False},
    # sync batch norm per host on CPUs: each statistic's sums over the replicas through queues, added in replica
    # order (host_sync_batch_norm.py), where the one graph all-reduces by a collective; tf.nn.moments and fused norms
    "sync-batch-norm-data-parallel": {"stages": [[0, 4, [[0, 0], [1, 0]]]], "micro_batches": 2, "model": "batch_norm",
                                      "batch_norm": "sync"},
    "sync-batch-norm-hybrid-3-replicas": {"stages": [[0, 2, [[0, 0], [0, 1], [1, 0]]], [3, 4, [[1, 1]]]],
                                          "micro_batches": 2, "batch": 24, "model": "batch_norm", "batch_norm": "sync",
                                          "arithmetic": False},
    "sync-batch-norm-in-one-task": {"stages": [[0, 2, [[1, 0], [1, 1]]], [3, 4, [[0, 0]]]], "micro_batches": 2,
                                    "model": "batch_norm", "batch_norm": "sync", "arithmetic": False},
    "sync-fused-batch-norm-recompute": {"stages": [[0, 2, [[0, 0], [1, 0]]], [3, 4, [[1, 1]]]], "micro_batches": 2,
                                        "batch": 24, "model": "fused_batch_norm", "batch_norm": "sync",
                                        "recompute": True, "arithmetic": False},
    "sync-fused-batch-norm-3-uneven": {"stages": [[0, 4, [[0, 0], [1, 0], [2, 1]]]], "micro_batches": 2, "batch": 14,
                                       "model": "fused_batch_norm", "batch_norm": "sync", "arithmetic": False},
    # time-major activations [len, batch, d] and a [q, k, batch, 1] mask split along their batch axes between tasks
    "time-major-hybrid": {"stages": [[0, 2, [[0, 0], [1, 0]]], [3, 4, [[2, 0]]]], "micro_batches": 2,
                          "model": "time_major"},
}
# with grappler's defaults, these cases' graphs get the same fusions both ways (see test_with_grapplers_defaults)
SAME_FUSIONS = ["straight", "data-parallel", "data-parallel-4-two-rounds", "functions-zb-h1", "tied", "batch-norm-straight", "script-sparse-clip",
                "tied-embedding", "tied-embedding-clip", "gradient-fn-embedding-clip"]


@pytest.fixture(scope="module")
def results():
    """name -> (grappler's defaults, remapping off) -> the probe's comparison."""
    runs = [dict(case, remapping=remapping) for case in CASES.values() for remapping in (True, False)]
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-m", "tests.per_host_probe", json.dumps(runs)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    compared = json.loads(result.stdout.strip().splitlines()[-1])
    return {name: {"defaults": compared[2 * i], "no_remapping": compared[2 * i + 1]} for i, name in enumerate(CASES)}


@pytest.mark.parametrize("name", list(CASES))
def test_per_host_graphs_train_bit_for_bit_like_one_graph(results, name):
    """Every weight and every step's loss to the last bit, with grappler's remapper (which fuses by what each graph
    holds) left out of both runs."""
    result = results[name]["no_remapping"]
    assert "errors" not in result, result
    assert result["variables"], result
    assert result["identical"], result
    assert result["losses"][-1] < result["losses"][0]


@pytest.mark.parametrize("name", list(CASES))
def test_with_grapplers_defaults(results, name):
    """With grappler's defaults, the remapper sometimes fuses one more activation into its matmul in a task's graph
    than in the cluster's (_MklNativeFusedMatMul [BiasAdd, Tanh] instead of [BiasAdd] and a Tanh: the partition
    graphs show it), which moves the last bits: three steps then stay within 2 float32 ulps of the one graph."""
    result = results[name]["defaults"]
    assert "errors" not in result, result
    assert result["variables"], result
    if name in SAME_FUSIONS:
        assert result["identical"], result
    assert result["max_difference"] <= 2.5e-7, result


@pytest.mark.parametrize("name", list(CASES))
def test_every_task_graph_is_smaller_than_the_clusters(results, name):
    """A script's own step, traced over every variable, stays in the scratch graph too (host_graph.py): its loss's
    task held 423 operations against the cluster's 406 while every task kept the whole template."""
    result = results[name]["defaults"]
    assert all(ops < result["in_graph_ops"] for ops in result["per_host_ops"]), result


def test_batch_norm_updates_summaries_and_outputs_are_combined_on_the_loss_task(results):
    """The batch-norm cases above compare them with the one graph's; here: that they are there, on the loss's task
    alone."""
    for name in ("batch-norm-straight", "batch-norm-hybrid-3-stages"):
        result = results[name]["no_remapping"]
        assert result["outputs"] == ["accuracy", "logits"] and result["summaries"] == 3, result
        assert all(steps == [{}, {}, {}] for steps in result["other_outputs"]), result  # the others fetch nothing


def test_clipping_clips_by_the_norm_of_every_tasks_gradients(results):
    """The cases above compare the norm with the one graph's bit for bit; here: that it is there, and clips."""
    for name in ("clip-hybrid-3-stages", "clip-data-parallel-3-uneven"):
        norms = results[name]["no_remapping"]["global_norms"]
        assert len(norms) == 3 and min(norms) > 0.1, (name, norms)


def test_the_loss_task_saves_the_moving_averages_it_updates_on_other_tasks():
    """Task 1 (the loss's) updates the moving averages of stage 0, which sit on task 0: it saves them, between its
    own steps (task 0 could save them before task 1's step of the same number has written them)."""
    from dapple_tf.cluster import host_checkpoint  # pylint: disable=import-outside-toplevel

    plan = _plan((0, 2, [(0, 0)]), (3, 4, [(1, 0)]))
    holdings = {}
    for task in (0, 1):
        with tf.Graph().as_default() as graph:
            x, y = toy_models.batch(8)
            handle = dapple_tf.build_pipeline(
                toy_models.batch_norm_model_fn(toy_models.initial_values()), tf.constant(x), tf.constant(y),
                tf.compat.v1.train.GradientDescentOptimizer(0.1), plan, dapple_tf.PipelineOptions(own_task=_task(task)))
            held, written = host_checkpoint.held_variables(handle.train_op, lambda d, t=task: f"/task:{t}/" in d)
            holdings[task] = {v.op.name: v.op.name in written for v in held}
            summaries = [s.op.name for s in graph.get_collection(tf.compat.v1.GraphKeys.SUMMARIES)]
            assert (sorted(handle.outputs), len(handle.update_ops), len(summaries)) == (
                (["accuracy", "logits"], 2, 3) if task == 1 else ([], 0, 0)), task
    assert holdings[0]["moving_mean"] is False and holdings[1]["moving_mean"] is True
    owners = host_checkpoint.owners(holdings)
    assert (owners["moving_mean"], owners["moving_variance"], owners["w0"], owners["wo"]) == (1, 1, 0, 1)


def _task(i: int) -> str:
    return f"/job:worker/replica:0/task:{i}"


def _build(plan, own_task, **options):
    x, y = toy_models.batch(8)
    return dapple_tf.build_pipeline(toy_models.skip_model_fn(toy_models.initial_values()), tf.constant(x),
                                    tf.constant(y), tf.compat.v1.train.GradientDescentOptimizer(0.1), plan,
                                    dapple_tf.PipelineOptions(own_task=own_task, **options))


def _plan(*stages, micro_batches=2):
    return dapple_tf.Plan.from_stages([(first, last, [f"{_task(t)}/device:CPU:{d}" for t, d in devices])
                                       for first, last, devices in stages], micro_batches)


def test_a_step_runs_nothing_on_other_tasks_but_their_queues():
    plan = _plan((0, 1, [(0, 0), (1, 0)]), (2, 4, [(2, 0)]))
    with tf.Graph().as_default() as graph:
        handle = _build(plan, _task(1))
        ran = dapple_tf.rewrite.graphs.graph_walk.ancestors(handle.train_op)
    elsewhere = {op.type for op in ran if op.device and f"{_task(1)}/" not in op.device}
    # the queues there and the enqueues into them; control-only groups of those enqueues; the stale-copy check's
    # side on task 0: a conditional (If, its output's Identity) on the handles of the variables this task copies,
    # which reads them in the first step after local initialization and sends an empty tensor in the others
    assert elsewhere == {"FIFOQueueV2", "QueueEnqueueV2", "NoOp", "VarHandleOp", "If", "Identity"}, elsewhere
    sends = [op for op in ran if op.type == "QueueEnqueueV2"]
    # to task 2 per micro-batch: h0 and h1 (the skip connection crosses the boundary too); to task 0: the
    # exchange of stage 0's gradients (task 0 owns pieces of them)
    assert {op.device for op in sends} == {f"{_task(0)}/device:CPU:0", f"{_task(2)}/device:CPU:0"}
    assert handle.loss is None  # the loss is summed on the last stage's task
    assert len(graph.get_operations()) < 600


@pytest.mark.parametrize("schedule, options", [("dapple", {}), ("gpipe", {"recompute": True}),
                                               ("dapple", {"input_gradients_first": False}), ("zb-h1", {}),
                                               ("zb-h1", {"stage_functions": True})])
def test_no_task_waits_for_what_it_sends_to_another_task(schedule, options):
    """A task's completion, which the device's next task waits for, leaves out its queues and enqueues on other
    tasks' devices: waiting for them cost a round trip to that task per task (1.18x the one graph's step at M=8).
    Only the step's end waits for them."""
    plan = _plan((0, 1, [(0, 0), (1, 0)]), (2, 4, [(2, 0)]), micro_batches=4)
    for task in range(3):
        with tf.Graph().as_default() as graph:
            _build(plan, _task(task), schedule=schedule, **options)
        own = f"{_task(task)}/"
        waiting = [(op.name, c.name) for op in graph.get_operations() if own in op.device
                   for c in op.control_inputs if c.device and own not in c.device]
        assert waiting == [], (task, waiting[:4])


def test_own_task_must_run_part_of_the_plan():
    plan = _plan((0, 2, [(0, 0)]), (3, 4, [(1, 0)]))
    with tf.Graph().as_default(), pytest.raises(PlanError) as raised:
        _build(plan, _task(2))
    assert str(raised.value) == (
        "own_task /job:worker/replica:0/task:2 runs none of the plan's devices; the plan's tasks: "
        "['/job:worker/replica:0/task:0', '/job:worker/replica:0/task:1']")
    with tf.Graph().as_default(), pytest.raises(PlanError, match="own_task must name a task of a cluster job"):
        _build(plan, "/device:CPU:0")


def test_what_per_host_graphs_do_not_build_yet_is_refused_by_name():
    plan = _plan((0, 2, [(0, 0)]), (3, 4, [(1, 0)]))
    with tf.Graph().as_default(), pytest.raises(PerHostError) as raised:
        _build(plan, _task(0), cross_process_reduce=lambda buffer: buffer)
    assert str(raised.value) == (
        "per-host graphs (PipelineOptions.own_task) do not yet support cross_process_reduce (Horovod): build one "
        "graph for the cluster (own_task=None)")


def test_a_gradient_fn_changing_a_gradients_kind_is_refused_per_host():
    """The other tasks apply what gradient_fn returns in the kind they sent (gathered rows, or dense)."""
    def densified(pairs):
        return [(tf.convert_to_tensor(g), v) for g, v in pairs]

    plan = _plan((0, 0, [(0, 0)]), (1, 2, [(1, 0)]))
    x, y = toy_models.embedding_batch(8)
    with tf.Graph().as_default(), pytest.raises(PerHostError) as raised:
        dapple_tf.build_pipeline(toy_models.embedding_model_fn, tf.nest.map_structure(tf.constant, x), tf.constant(y),
                                 tf.compat.v1.train.GradientDescentOptimizer(0.1), plan,
                                 dapple_tf.PipelineOptions(own_task=_task(1), gradient_fn=densified))
    assert str(raised.value) == (
        "per-host graphs (PipelineOptions.own_task): gradient_fn returned the gradient of table as a dense tensor, "
        "which it got as gathered rows (IndexedSlices): the other tasks apply it as they sent it")


def test_a_merged_trace_holds_each_devices_stats_from_its_own_tasks_session():
    """Task 1's session also runs its enqueues on task 0's device, under its own graph's names, which may be
    those of other operations of task 0's graph: those stats are left out (they stretched task 0's boxes)."""
    import base64  # pylint: disable=import-outside-toplevel
    import types  # pylint: disable=import-outside-toplevel

    from dapple_tf.frontends import host_trace  # pylint: disable=import-outside-toplevel

    def described(stats):
        metadata = tf.compat.v1.RunMetadata()
        for device, node in stats:
            metadata.step_stats.dev_stats.add(device=device).node_stats.add(node_name=node)
        return json.dumps({"metadata": base64.b64encode(metadata.SerializeToString()).decode(), "task_ops": [],
                           "input_gradient_ops": [], "allreduce": []})

    cpu = "/job:worker/replica:0/task:{}/device:CPU:0".format
    texts = {0: described([(cpu(0), "send_1"), (cpu(1), "send")]), 1: described([(cpu(1), "b"), (cpu(0), "send_1")])}
    handle = types.SimpleNamespace(schedule=None, stages=(), micro_batch_size=1, train_op=None)
    merged, _ = host_trace._merged(texts, handle)  # pylint: disable=protected-access
    assert [(d.device, d.node_stats[0].node_name) for d in merged.step_stats.dev_stats] == [(cpu(0), "send_1"),
                                                                                           (cpu(1), "b")]


def test_synchronized_statistics_of_gpus_over_tasks_are_all_reduced_with_the_same_keys_by_every_task():
    """Sync batch norm of GPU replicas in several tasks (NCCL, not runnable here): each task's graph launches its
    replica's member of every statistic's collective with the instance key the other's uses, recomputed ones
    included, counted in a range apart from a graph's own counted keys (which start at its operation count, and
    which its all-reduces within the task take from too)."""
    gpu = "/job:worker/replica:0/task:{}/device:GPU:0".format
    plan = dapple_tf.Plan.from_stages([(0, 2, [gpu(0), gpu(1)]), (3, 4, [gpu(1).replace("GPU:0", "GPU:1")])], 1)
    keys = []
    for task in (0, 1):
        with tf.Graph().as_default() as graph:
            _build_batch_norm(plan, _task(task), batch_norm="sync", recompute=[0])
            keys.append(sorted(_constant(op.inputs[3]) for op in graph.get_operations()
                               if op.type == "CollectiveReduceV2" and "/dapple_sync/" in op.name))
    # forward: the mean's and the variance's sums; recomputed: the same and their gradients' (the forward's
    # gradients are the recomputed clone's)
    assert keys[0] == keys[1] and len(keys[0]) == 6, keys
    assert all(2**29 <= k < 2**30 for k in keys[0]), keys


def test_sync_batch_norm_of_cpu_replicas_per_host_sums_through_queues_not_collectives():
    """Each statistic of each clone: its replica sends its local sum to the other replica and reads the other's, and
    the same for the sum's gradient; TF's collectives ran unreliably across per-host sessions (docs/design.md)."""
    plan = _plan((0, 2, [(0, 0), (1, 0)]), (3, 4, [(1, 1)]), micro_batches=1)
    with tf.Graph().as_default() as graph:
        _build_batch_norm(plan, _task(0), batch_norm="sync")
    ops = graph.get_operations()
    assert not [op for op in ops if op.type == "CollectiveReduceV2"]
    queues = sorted(op.get_attr("shared_name").decode() for op in ops
                    if op.type == "FIFOQueueV2" and "dapple/sync/" in op.get_attr("shared_name").decode())
    # tf.nn.moments' two means (sums 0 and 4), each forward and back, sent to replica 1 and received from it
    assert queues == sorted(f"dapple/sync/0/0/forward/{k}{part}/{pair}" for k in (0, 4) for part in ("", "/gradient")
                            for pair in ("0-1", "1-0")), queues


def _constant(tensor) -> int:
    """The value of an instance key: constants and their sums."""
    op = tensor.op
    if op.type == "Const":
        return int(tf.make_ndarray(op.get_attr("value")))
    assert op.type in ("Add", "AddV2", "Identity"), op.type
    return sum(_constant(t) for t in op.inputs)


def _build_batch_norm(plan, own_task, **options):
    x, y = toy_models.batch(24)
    return dapple_tf.build_pipeline(toy_models.batch_norm_model_fn(toy_models.initial_values()), tf.constant(x),
                                    tf.constant(y), tf.compat.v1.train.GradientDescentOptimizer(0.1), plan,
                                    dapple_tf.PipelineOptions(own_task=own_task, **options))


def test_gpus_of_several_tasks_all_reduce_by_one_collective_with_the_same_keys_in_every_tasks_graph():
    """NCCL across tasks (not runnable here): each task's graph launches its own device's member of one collective
    per bucket, with the group and instance keys the other tasks' graphs derive alike."""
    gpus = [f"{_task(t)}/device:GPU:0" for t in range(2)]
    plan = dapple_tf.Plan.from_stages([(0, 4, gpus)], 1)
    launched = []
    for task in range(2):
        with tf.Graph().as_default() as graph:
            _build(plan, _task(task))
            reduce_ops = [op for op in graph.get_operations() if op.type.startswith("CollectiveReduce")]
        launched.append({(op.device, op.get_attr("group_key"), op.get_attr("instance_key"), op.get_attr("group_size"),
                          op.get_attr("communication_hint")) for op in reduce_ops})
    assert [{device for device, *_ in ops} for ops in launched] == [{gpus[0]}, {gpus[1]}]
    assert {tuple(key) for _, *key in launched[0]} == {tuple(key) for _, *key in launched[1]}
    assert launched[0] and all(size == 2 and hint == b"nccl" for _, _, _, size, hint in launched[0])
    assert all(instance >= 2**30 for _, _, instance, _, _ in launched[0])  # apart from the counted keys


def test_a_task_talks_only_to_the_tasks_its_graph_names():
    """handle.tasks (this task, then the tasks its graph places operations on) become the session's device filters:
    a session of a per-host graph neither waits for nor contacts the cluster's other tasks (TF's session creation
    waits for ever for a worker that does not answer). Every operation counts, not only those a step runs: a
    session places its whole graph, and the template sits on every stage's first device."""
    import models  # pylint: disable=import-outside-toplevel

    spec = models.get_model("mlp", "tiny", hidden=[8, 8, 8], input_dim=8)
    plan = _plan((0, 1, [(1, 0)]), (2, 3, [(3, 0), (3, 1)]))  # tasks 0 and 2 of the cluster run nothing of it
    tasks = {}
    for task in (1, 3):
        with tf.Graph().as_default():
            features, labels = spec.step_input_fn(8)(tf.constant(0, tf.int64))
            handle = dapple_tf.build_pipeline(spec.model_fn, features, labels,
                                              tf.compat.v1.train.GradientDescentOptimizer(0.1), plan,
                                              dapple_tf.PipelineOptions(own_task=_task(task)))
            tasks[task] = handle.tasks
            assert list(handle.session_config(tf.compat.v1.ConfigProto()).device_filters) == list(handle.tasks)
    assert tasks == {1: (_task(1), _task(3)), 3: (_task(3), _task(1))}


def test_a_peer_that_never_starts_is_named_within_the_timeout():
    import time  # pylint: disable=import-outside-toplevel

    from dapple_tf.cluster import host_session  # pylint: disable=import-outside-toplevel
    from dapple_tf.cluster.servers import ClusterError, TFCluster, free_ports  # pylint: disable=C0415

    cluster = TFCluster(tuple(f"127.0.0.1:{p}" for p in free_ports(2)), task_type="worker", task_index=0)
    began = time.monotonic()
    with pytest.raises(ClusterError) as raised:
        host_session.wait_for_peers(cluster, [_task(1)], timeout_s=1.0)
    assert time.monotonic() - began < 5
    assert str(raised.value) == (f"after waiting 1 s, these worker tasks are not up: worker task 1 "
                                 f"({cluster.workers[1]}): unreachable (Connection refused)")


def test_every_task_sums_a_table_as_gathered_rows_whatever_else_reads_it_without_a_gradient():
    """Each task decides from the template whether another task's stage gives gathered rows (tied embeddings:
    not). A histogram of the table and a stop_gradient of its norm read it whole but pass no gradient back: the
    table's gradient stays gathered rows, on the task that holds it as in the one graph."""
    def model_fn(features, labels):
        with dapple_tf.layer("embed"):
            table = tf.compat.v1.get_variable("table", initializer=tf.ones([toy_models.VOCAB, toy_models.EMBED]))
            tf.compat.v1.summary.histogram("table", table)
            vectors = tf.nn.embedding_lookup(table, features["ids"]) * tf.stop_gradient(tf.norm(table))
        with dapple_tf.layer("head"):
            w = tf.compat.v1.get_variable("w", initializer=tf.ones([toy_models.EMBED, 2]))
            logits = tf.matmul(tf.reduce_mean(vectors, axis=1) + features["dense"], w)
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))

    plan = _plan((0, 0, [(0, 0)]), (1, 1, [(1, 0)]))
    x, y = toy_models.embedding_batch(8)
    kinds = {}
    for task in (0, 1):
        with tf.Graph().as_default():
            handle = dapple_tf.build_pipeline(model_fn, tf.nest.map_structure(tf.constant, x), tf.constant(y),
                                              tf.compat.v1.train.GradientDescentOptimizer(0.1), plan,
                                              dapple_tf.PipelineOptions(own_task=_task(task)))
            kinds[task] = {v.op.name: isinstance(g, tf.IndexedSlices) for g, v in handle.grads_and_vars}
    assert kinds == {0: {"table": True}, 1: {"w": False}}

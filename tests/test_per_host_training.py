"""Per-host training through the programs (issue 46): `dapple_launch --per_host` runs dapple_train in every worker
task, each building only its own part. Its checkpoints are the one graph's, bit for bit and name for name (each
resumes the other's), with a meta graph that restores them, a killed task ends the job naming it, a TF_CONFIG that
disagrees with the plan is an error naming both; and the pieces: which task saves which variable, and the job
specs."""

import json
import os
import shutil
import signal
import time

import numpy as np
import pytest
import tensorflow as tf
import yaml
from google.protobuf import text_format

from dapple_tf.cluster import host_checkpoint, job_specs
from dapple_tf.cluster.servers import ClusterError
from planner.formats import layer_cost_pb2, plan_pb2, write_message
from planner.formats.cluster import local_task_cluster
from tests.launch_harness import Launch, pid_of, running_pids
from tests.programs import run_program


def _plan_file(path, tasks, devices, stages, names=("dense_0", "dense_1", "head")):
    """A plan of the tiny MLP (or a model of layers `names`) over local:TASKSxDEVICES; stages: (first, last,
    device ids)."""
    plan = plan_pb2.Plan(model_name="mlp", planner="manual", global_batch_size=24, num_micro_batches=2,
                         micro_batch_size=12, schedule=plan_pb2.DAPPLE)
    plan.cluster.CopyFrom(local_task_cluster(tasks, devices, memory_bytes=1e9))
    for first, last, ids in stages:
        plan.stages.add(first_layer=first, last_layer=last, layer_names=names[first:last + 1], device_ids=ids)
    write_message(plan, str(path))
    return str(path)


def _train(cluster, plan, model_dir, steps, *flags, model=("--model=mlp",)):
    result = run_program("dapple_launch", f"--cluster={cluster}", *flags, "--", "dapple_train", *model,
                         f"--plan={plan}", f"--steps={steps}", f"--model_dir={model_dir}", "--optimizer=adam",
                         "--save_checkpoints_steps=3", "--log_every=3", "--summary_every=3", timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _point_at(model_dir):
    """The checkpoint state of a copied model_dir names the copy's files (it names absolute paths)."""
    state = tf.train.get_checkpoint_state(str(model_dir))
    paths = [str(model_dir / os.path.basename(p)) for p in state.all_model_checkpoint_paths]
    tf.compat.v1.train.update_checkpoint_state(str(model_dir), paths[-1], paths)


def _checkpoint(path):
    reader = tf.train.load_checkpoint(str(path))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def _summaries(model_dir):
    """{tag: [value per written step]} of the event files in model_dir."""
    values = {}
    for name in sorted(os.listdir(model_dir)):
        if name.startswith("events.out"):
            for event in tf.compat.v1.train.summary_iterator(str(model_dir / name)):
                for v in event.summary.value:
                    values.setdefault(v.tag, []).append(v.simple_value)
    return values


def _assert_same(a, b, exact=True, optimizer_state="dense_0/fc_kernel/Adam"):
    assert sorted(a) == sorted(b)
    assert optimizer_state in a and "beta1_power" in a  # the optimizer's state, its per-task copies once
    for name in a:
        if exact:
            assert np.array_equal(a[name], b[name]), name
        else:
            np.testing.assert_allclose(a[name], b[name], rtol=2e-6, atol=1e-7, err_msg=name)


@pytest.mark.slow
def test_per_host_checkpoints_are_the_one_graphs_and_resume_each_other(tmp_path):
    """A straight pipeline over 2 tasks with Adam: 6 steps per host and as one graph give the same checkpoints and
    held-out losses to the last bit, then each run resumes from the other's checkpoint to step 9, again the same.
    The per-host run also traces a step (one timeline of both tasks)."""
    plan = _plan_file(tmp_path / "plan.json", 2, 1, [(0, 1, [0]), (2, 2, [1])])
    per_host, one_graph = tmp_path / "per_host", tmp_path / "one_graph"
    trace = tmp_path / "step.json"
    out = _train("local:2x1", plan, per_host, 6, "--per_host",
                 model=("--model=mlp", "--eval_every=3", f"--trace={trace}", "--trace_step=4"))
    assert "[worker 1] step 6/6  loss" in out and "[worker 0] step" not in out  # the loss's task logs
    assert "[worker 1] step 3: held-out loss" in out and "[worker 0] done: step 6;" in out
    # the traced step: every task's boxes, in the timeline the loss's task writes
    assert "[worker 1] traced step 4 of this run" in out and "[worker 0] traced" not in out
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X" and e["name"][0] in "FB"]
    # a forward and a backward box per micro-batch (M=2) and stage, each with a length (the enqueues task 1's step
    # runs on task 0 are another graph's names: counted as task 0's, they stretched its forward boxes over its
    # backward ones, which shrank to nothing)
    assert sorted((e["pid"], e["name"]) for e in events) == [(p, k + m) for p in (0, 1) for k in "BF" for m in "01"]
    assert all(e["dur"] > 0 for e in events), events
    _train("local:2x1", plan, one_graph, 6, "--noper_host", model=("--model=mlp", "--eval_every=3"))
    _assert_same(_checkpoint(per_host / "model.ckpt-6"), _checkpoint(one_graph / "model.ckpt-6"))
    # held-out loss at steps 3 and 6: every task's variables at that step, read by the loss's task
    assert len(_summaries(per_host)["eval_loss"]) == 2
    assert _summaries(per_host)["eval_loss"] == _summaries(one_graph)["eval_loss"]
    assert tf.train.get_checkpoint_state(str(per_host)).all_model_checkpoint_paths[-2].endswith("model.ckpt-3")
    assert host_checkpoint.PARTS_DIR not in os.listdir(per_host)  # the parts were merged
    assert {"loss", "step_time_ms"} <= set(_summaries(per_host))

    swapped_per_host, swapped_one_graph = tmp_path / "swapped_per_host", tmp_path / "swapped_one_graph"
    shutil.copytree(one_graph, swapped_per_host)
    shutil.copytree(per_host, swapped_one_graph)
    for path in (swapped_per_host, swapped_one_graph):
        _point_at(path)
    out = _train("local:2x1", plan, swapped_per_host, 9, "--per_host")
    assert "[worker 1] resumed from the checkpoint at step 6" in out
    _train("local:2x1", plan, swapped_one_graph, 9, "--noper_host")
    _assert_same(_checkpoint(swapped_per_host / "model.ckpt-9"), _checkpoint(swapped_one_graph / "model.ckpt-9"))


@pytest.mark.slow
def test_per_host_checkpoints_have_a_meta_graph_and_graph_pbtxt(tmp_path):
    """Task 0 writes each merged checkpoint's .meta and graph.pbtxt (host_checkpoint.checkpoint_graph): the meta
    graph imported in a fresh graph restores every variable of the checkpoint to the checkpoint's values, with the
    model's variables trainable and the global step found; graph.pbtxt is a GraphDef holding them."""
    plan = _plan_file(tmp_path / "plan.json", 2, 1, [(0, 1, [0]), (2, 2, [1])])
    model_dir = tmp_path / "per_host"
    _train("local:2x1", plan, model_dir, 3, "--per_host")
    assert sorted(n for n in os.listdir(model_dir) if n.endswith(".meta")) == ["model.ckpt-3.meta"]
    saved = _checkpoint(model_dir / "model.ckpt-3")
    assert "dense_0/fc_kernel/Adam" in saved and "beta1_power" in saved  # written by task 0 and by task 1
    with tf.Graph().as_default():
        saver = tf.compat.v1.train.import_meta_graph(str(model_dir / "model.ckpt-3.meta"))
        variables = tf.compat.v1.global_variables()
        assert sorted(v.op.name for v in variables) == sorted(saved)
        assert {v.op.name for v in tf.compat.v1.trainable_variables()} == {
            f"{layer}/{kind}_{part}" for layer, kind in (("dense_0", "fc"), ("dense_1", "fc"), ("head", "logits"))
            for part in ("kernel", "bias")}
        assert tf.compat.v1.train.get_global_step().op.name == "global_step"
        with tf.compat.v1.Session() as sess:
            saver.restore(sess, tf.train.latest_checkpoint(str(model_dir)))
            for variable, value in zip(variables, sess.run(variables)):
                assert np.array_equal(value, saved[variable.op.name]), variable.op.name
    graph_def = text_format.Parse((model_dir / "graph.pbtxt").read_text(), tf.compat.v1.GraphDef())
    assert set(saved) <= {node.name for node in graph_def.node}
    # TensorBoard's graph tab reads the events: the loss's task's own graph, as its summary writer recorded it
    graphs = [tf.compat.v1.GraphDef.FromString(event.graph_def) for name in os.listdir(model_dir)
              if name.startswith("events.out") for event in tf.compat.v1.train.summary_iterator(str(model_dir / name))
              if event.HasField("graph_def")]
    assert len(graphs) == 1 and any(node.name == "dapple_loss" for node in graphs[0].node)


def test_tasks_holding_a_variable_alike_describe_the_checkpoint_else_an_error_names_both():
    weight = {"writes": True, "dtype": "float32", "shape": [2, 3], "trainable": True, "global_step": False}
    step = {"writes": True, "dtype": "int64", "shape": [], "trainable": False, "global_step": True}
    described = host_checkpoint.checkpoint_variables({0: {"w": weight, "global_step": step},
                                                      1: {"w": dict(weight, writes=False), "global_step": step}})
    assert described == {"w": weight, "global_step": step}
    with pytest.raises(ClusterError) as raised:
        host_checkpoint.checkpoint_variables({0: {"w": weight}, 1: {"w": dict(weight, shape=[3, 2])}})
    assert str(raised.value) == ("worker tasks 0 and 1 hold variable w as float32 [2, 3] and float32 [3, 2]: is "
                                 "every task running the same model and plan?")


@pytest.mark.long  # in CI: the per-host probe's batch-norm-* cases, and the estimator's summaries per host
def test_per_host_batch_norm_updates_and_summaries_are_the_one_graphs(tmp_path):
    """tests/user_model.py's batch norm in stage 0 (task 0), the loss in stage 1 (task 1): task 1 combines the
    statistics of task 0's clones, updates the moving averages on task 0 and saves them; its summary reads the
    batch of every clone. Checkpoint and summaries equal the one graph's to the last bit."""
    plan = _plan_file(tmp_path / "plan.json", 2, 1, [(0, 1, [0]), (2, 2, [1])], names=("encode", "norm", "decode"))
    model = ("--model_fn=tests.user_model:batch_norm_model_fn", "--input_fn=tests.user_model:input_fn")
    per_host, one_graph = tmp_path / "per_host", tmp_path / "one_graph"
    _train("local:2x1", plan, per_host, 6, "--per_host", model=model)
    _train("local:2x1", plan, one_graph, 6, "--noper_host", model=model)
    checkpoint = _checkpoint(per_host / "model.ckpt-6")
    assert not np.array_equal(checkpoint["moving_mean"], np.zeros(16))  # updated
    _assert_same(checkpoint, _checkpoint(one_graph / "model.ckpt-6"), optimizer_state="encode_w/Adam")
    summaries = _summaries(per_host)
    assert len(summaries.get("norm/normalized_mean", ())) == 2, summaries  # steps 3 and 6
    assert summaries["norm/normalized_mean"] == _summaries(one_graph)["norm/normalized_mean"]


@pytest.mark.slow
@pytest.mark.primary_only  # on TF 2.21: the per-host probe's hybrid cases (tests/test_per_host.py), in process
def test_per_host_hybrid_plan_trains_like_the_one_graph(tmp_path):
    """Stage 0 replicated over both tasks (its gradients summed across them), stage 1 on task 0's second device.
    Grappler may fuse an activation differently in a task's smaller graph (tests/test_per_host.py): a few ulps."""
    plan = _plan_file(tmp_path / "plan.json", 2, 2, [(0, 1, [0, 2]), (2, 2, [1])])
    per_host, one_graph = tmp_path / "per_host", tmp_path / "one_graph"
    _train("local:2x2", plan, per_host, 6, "--per_host")
    _train("local:2x2", plan, one_graph, 6, "--noper_host")
    _assert_same(_checkpoint(per_host / "model.ckpt-6"), _checkpoint(one_graph / "model.ckpt-6"), exact=False)
    # resumed per host from the one graph's checkpoint: task 1's copies and their Adam slots are set from task 0's
    resumed = tmp_path / "resumed"
    shutil.copytree(one_graph, resumed)
    _point_at(resumed)
    _train("local:2x2", plan, resumed, 9, "--per_host")
    _train("local:2x2", plan, one_graph, 9, "--noper_host")
    _assert_same(_checkpoint(resumed / "model.ckpt-9"), _checkpoint(one_graph / "model.ckpt-9"), exact=False)


@pytest.mark.long  # in CI: the per-host probe's two-copies-in-one-task and sync-batch-norm-in-one-task
def test_replicas_within_one_task_train_like_the_one_graph(tmp_path):
    """Each stage replicated on its task's two devices: per host their gradients are summed by the exchange (a TF
    collective within task 1's session waits on the cluster's group leader, task 0, and its first step was
    cancelled), in the one graph by a collective; two summands add alike either way."""
    plan = _plan_file(tmp_path / "plan.json", 2, 2, [(0, 1, [0, 1]), (2, 2, [2, 3])])
    _train("local:2x2", plan, tmp_path / "per_host", 3, "--per_host")
    _train("local:2x2", plan, tmp_path / "one_graph", 3, "--noper_host")
    _assert_same(_checkpoint(tmp_path / "per_host" / "model.ckpt-3"),
                 _checkpoint(tmp_path / "one_graph" / "model.ckpt-3"), exact=False)


@pytest.mark.long  # in CI: the per-host probe's data-parallel-4-two-rounds (3 tasks)
def test_tasks_that_exchange_no_tensor_still_agree_on_checkpoints_and_wait_for_each_other(tmp_path):
    """Data parallelism on 6 devices of 3 tasks: the exchange sums task 2's gradients on task 0, so tasks 1 and 2
    exchange no tensor, yet all three agree who saves what and wait for each other at the end (before: a queue
    made with two capacities, then an enqueue outside a session's device filters)."""
    plan = _plan_file(tmp_path / "plan.json", 3, 2, [(0, 2, [0, 1, 2, 3, 4, 5])])
    _train("local:3x2", plan, tmp_path / "per_host", 3, "--per_host")
    _train("local:3x2", plan, tmp_path / "one_graph", 3, "--noper_host")
    _assert_same(_checkpoint(tmp_path / "per_host" / "model.ckpt-3"),
                 _checkpoint(tmp_path / "one_graph" / "model.ckpt-3"), exact=False)


@pytest.mark.slow
@pytest.mark.primary_only  # process handling, not TensorFlow's: TF 2.21 runs the training launches
def test_a_killed_task_ends_every_other_naming_it(tmp_path):
    plan = _plan_file(tmp_path / "plan.json", 2, 1, [(0, 1, [0]), (2, 2, [1])])
    launch = Launch("--cluster=local:2x1", "--per_host", "--", "dapple_train", "--model=mlp", f"--plan={plan}",
                    "--steps=1000000", f"--model_dir={tmp_path / 'm'}", "--save_checkpoints_steps=20",
                    "--log_every=20", "--summary_every=0", "--failure_timeout=20")
    address = launch.wait_for(lambda text: text.startswith("dapple_launch: worker task 1 at"), 60)
    line = launch.wait_for(lambda text: text.startswith("[worker 1] dapple_launch: worker task's command (pid"), 120)
    launch.wait_for(lambda text: text.startswith("[worker 1] step 60/"), 300)
    os.kill(pid_of(line), signal.SIGKILL)
    killed_at = time.monotonic()
    code, output = launch.finish(timeout=120)
    assert code == 1, output
    assert time.monotonic() - killed_at < 20, output
    assert "[worker 0] error: training stopped at step" in output
    assert f"worker task 1 ({address.split(' at ')[1].split()[0]}) is unreachable" in output
    assert running_pids(output) == []
    assert tf.train.latest_checkpoint(str(tmp_path / "m")) is not None


@pytest.mark.slow
@pytest.mark.primary_only  # process handling, not TensorFlow's: TF 2.21 runs the training launches
def test_checkpoints_by_seconds_are_at_steps_every_task_agrees_on(tmp_path):
    """--save_checkpoints_secs per host: turned into a number of steps from the first steps' time, the first task's
    choice (parts of different steps could not be merged: task 0 would stop naming them)."""
    plan = _plan_file(tmp_path / "plan.json", 2, 1, [(0, 1, [0]), (2, 2, [1])])
    result = run_program("dapple_launch", "--cluster=local:2x1", "--per_host", "--", "dapple_train", "--model=mlp",
                         f"--plan={plan}", "--steps=60", f"--model_dir={tmp_path / 'm'}", "--save_checkpoints_steps=0",
                         "--save_checkpoints_secs=0.05", "--log_every=0", "--summary_every=0", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    paths = tf.train.get_checkpoint_state(str(tmp_path / "m")).all_model_checkpoint_paths
    steps = [int(p.rsplit("-", 1)[1]) for p in paths]
    assert len(steps) >= 2 and steps[-1] == 60, steps  # periodic ones, then the last step's
    every = steps[1] - steps[0] if len(steps) > 2 else steps[0]
    assert all(s % every == 0 for s in steps[:-1]), steps


@pytest.mark.slow
@pytest.mark.primary_only  # process handling, not TensorFlow's: TF 2.21 runs the training launches
def test_tasks_reading_different_batches_are_an_error_naming_them(tmp_path):
    plan = _plan_file(tmp_path / "plan.json", 2, 1, [(0, 0, [0]), (1, 1, [1])], names=("encode", "decode"))
    result = run_program("dapple_launch", "--cluster=local:2x1", "--per_host", "--", "dapple_train",
                         "--model_fn=tests.user_model:model_fn", "--input_fn=tests.user_model:task_dependent_input_fn",
                         f"--plan={plan}", "--steps=5", timeout=300)
    assert result.returncode == 1
    assert ("error: worker task(s) [1] read another batch than worker task 0 in their first step: training per host "
            "needs every task to read the same batches") in result.stdout, result.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.primary_only  # process handling, not TensorFlow's: TF 2.21 runs the training launches
def test_tf_config_disagreeing_with_the_plan_is_an_error_naming_both(tmp_path):
    plan = _plan_file(tmp_path / "plan.json", 2, 1, [(0, 1, [0]), (2, 2, [1])])
    result = run_program("dapple_launch", "--cluster=local:3x1", "--per_host", "--", "dapple_train", "--model=mlp",
                         f"--plan={plan}", "--steps=3", timeout=300)
    assert result.returncode == 1
    assert "error: TF_CONFIG names 3 worker tasks, the plan runs on tasks [0, 1]" in result.stdout, result.stdout[-3000:]


def _profile_file(path):
    """A profile of the tiny MLP whose head weighs more than its hidden layers (the planner's input, not measured)."""
    profile = layer_cost_pb2.LayerCostProfile(model_name="mlp", batch_size=24)
    for i, name in enumerate(("dense_0", "dense_1", "head")):
        layer = profile.layers.add(name=name, index=i, forward_ms=10.0, backward_ms=20.0,
                                   activation_bytes=24 * 64 * 4.0, parameter_bytes=4e7 if name == "head" else 1e4)
        layer.inputs.extend(["dense_0", "dense_1"][i - 1:i] if i else [])
    write_message(profile, str(path))
    return str(path)


@pytest.mark.slow
@pytest.mark.primary_only  # process handling, not TensorFlow's: TF 2.21 runs the training launches
def test_per_host_without_a_plan_trains_the_plan_task_0_makes(tmp_path):
    """No --plan: worker task 0 plans (here from a --profile, so that the chief plans the same), the other task
    waits for that plan instead of planning; the checkpoints are the one graph's to the last bit."""
    profile = _profile_file(tmp_path / "profile.pb")
    per_host, one_graph = tmp_path / "per_host", tmp_path / "one_graph"
    flags = ("--model=mlp", f"--profile={profile}", "--global_batch_size=24", "--steps=3", "--optimizer=adam")
    result = run_program("dapple_launch", "--cluster=local:2x1", "--per_host", "--", "dapple_train", *flags,
                         f"--model_dir={per_host}", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[worker 1] waiting for worker task 0's plan" in result.stdout
    assert "[worker 0] waiting for worker task 0's plan" not in result.stdout
    planned = [line for line in result.stdout.splitlines() if "training mlp:" in line]
    assert len(planned) == 2 and "2 stages" in planned[0], planned  # the head alone: one stage per task
    result = run_program("dapple_launch", "--cluster=local:2x1", "--noper_host", "--", "dapple_train", *flags,
                         f"--model_dir={one_graph}", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _assert_same(_checkpoint(per_host / "model.ckpt-3"), _checkpoint(one_graph / "model.ckpt-3"))


def test_a_task_waiting_for_a_plan_that_never_comes_names_task_0():
    from dapple_tf.cluster import host_signals  # pylint: disable=import-outside-toplevel
    from dapple_tf.cluster.servers import ClusterError, TFCluster, free_ports  # pylint: disable=import-outside-toplevel

    workers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    # task 1's server only: task 0 is gone (died after answering the first wait), and waiting does not hang on it
    server = tf.distribute.Server(tf.train.ClusterSpec({"worker": workers}), "worker", 1)
    cluster = TFCluster(workers=tuple(workers), task_type="worker", task_index=1)
    began = time.monotonic()
    with pytest.raises(ClusterError) as raised:
        host_signals.broadcast_text(cluster, [0, 1], "", 0, 1.0, "plan")
    assert time.monotonic() - began < 10
    assert str(raised.value) == (f"after 1 s, worker task 0 ({workers[0]}) sent nothing: is every task of the "
                                 "cluster running this program?")
    del server


def test_what_per_host_training_does_not_do_yet_is_refused_by_name():
    from dapple_tf.errors import PerHostError  # pylint: disable=import-outside-toplevel
    from dapple_tf.frontends import host_training, trainer  # pylint: disable=import-outside-toplevel

    options = trainer.TrainerOptions(save_checkpoints_secs=60, trace_path="step.json", eval_every=5)
    with pytest.raises(PerHostError) as raised:
        host_training.check_supported(options, horovod=object())
    assert str(raised.value) == (
        "training per host (TF_CONFIG names this process a worker task) does not support Horovod yet: run "
        "dapple_train as the chief (one graph for the cluster)")


def test_owners_one_writer_else_the_first_writer_else_the_first_holder():
    holdings = {0: {"w0": True, "global_step": True, "beta1_power": True, "shared_slot": False, "frozen": False},
                1: {"w1": True, "global_step": True, "beta1_power": True, "shared_slot": True, "frozen": False}}
    assert host_checkpoint.owners(holdings) == {"w0": 0, "w1": 1, "global_step": 0, "beta1_power": 0,
                                                "shared_slot": 1, "frozen": 0}


def test_written_variables_are_what_the_step_assigns():
    with tf.Graph().as_default():
        trained = tf.compat.v1.get_variable("trained", [2], initializer=tf.compat.v1.ones_initializer())
        frozen = tf.compat.v1.get_variable("frozen", [2], initializer=tf.compat.v1.ones_initializer(),
                                           trainable=False)
        step = tf.compat.v1.train.get_or_create_global_step()
        loss = tf.reduce_sum(trained * frozen)
        train_op = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, global_step=step)
        variables = tf.compat.v1.global_variables()
        assert host_checkpoint.written_variables(train_op, variables) == {"trained", "trained/Momentum",
                                                                           "global_step"}


def test_per_host_job_specs_run_the_command_in_every_worker_and_no_chief():
    pods = list(yaml.safe_load_all(job_specs.kubernetes("j", "img", 2, 8, ["dapple_train", "--plan=p"],
                                                        per_host=True)))[2:]
    assert [p["metadata"]["name"] for p in pods] == ["j-worker-0", "j-worker-1"]
    for i, pod in enumerate(pods):
        container = pod["spec"]["containers"][0]
        assert container["command"] == ["dapple_launch", "--tf_config", "--", "dapple_train", "--plan=p"]
        assert json.loads(container["env"][0]["value"]) == {
            "cluster": {"worker": ["j-worker-0.j:2222", "j-worker-1.j:2222"]}, "task": {"type": "worker", "index": i}}
    job = next(yaml.safe_load_all(job_specs.kubernetes("j", "img", 2, 8, ["dapple_train"], kind="tfjob",
                                                       per_host=True)))
    assert list(job["spec"]["tfReplicaSpecs"]) == ["Worker"]
    script = job_specs.slurm("j", 2, 8, ["dapple_train", "--plan=p"], per_host=True)
    assert "exec dapple_launch --tf_config -- dapple_train --plan=p'" in script
    assert '"chief"' not in script and "chief" not in script.split("set -euo pipefail")[1]

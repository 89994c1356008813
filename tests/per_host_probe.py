"""Trains a plan over in-process worker tasks twice, as one graph for the cluster and as one graph per task
(PipelineOptions.own_task), and prints both runs' weights and losses as JSON (lists, bit-exact as float hex).

    python -m tests.per_host_probe '[{"stages": [[0, 2, [[0, 0]]], [3, 4, [[1, 0]]]], "micro_batches": 2}]'

Prints, per case, whether the two runs are bit-identical, the largest weight difference and each graph's ops.
A stage's devices are [task, CPU index] pairs (every task has 2 CPU devices). Optional keys: "schedule" ("dapple"), "stage_functions" (false), "steps" (3), "batch" (12), "model"
("skip": tests.toy_models.skip_model_fn; "tied": tied_model_fn; "batch_norm": batch_norm_model_fn; "fused_batch_norm": fused_batch_norm_model_fn; "embedding": embedding_model_fn; "tied_embedding": tied_embedding_model_fn; "time_major": tests.time_major_models.attention_model_fn; "script:<idiom>": tests.script_models.model_fn(idiom), the script's own step),
"remapping" (true: grappler's remapper on), "clip" (clip_global_norm), "gradient_fn" (true: _normalized),
"batch_norm" ("per_slice"), "recompute" (None), "arithmetic" (true: grappler's arithmetic optimizer on). Run in
its own process by tests/test_per_host.py, so that the servers end with it; each per-host graph runs in a thread of this process with a session on its own
task's server, as the task's own process would.
"""

import json
import socket
import sys

import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2

import dapple_tf
from dapple_tf.cluster.servers import server_config
from scripts.bench.hosts import host_threads
from tests import script_models, time_major_models, toy_models

TIMEOUT_S = 120


def _device(task: int, index: int) -> str:
    return f"/job:worker/replica:0/task:{task}/device:CPU:{index}"


def _model_fn(case):
    if case.get("model") in ("embedding", "tied_embedding"):
        return getattr(toy_models, f"{case['model']}_model_fn")
    if case.get("model") == "time_major":
        return time_major_models.attention_model_fn
    values = toy_models.initial_values()
    return {"skip": toy_models.skip_model_fn, "tied": toy_models.tied_model_fn,
            "batch_norm": toy_models.batch_norm_model_fn,
            "fused_batch_norm": toy_models.fused_batch_norm_model_fn}[case.get("model", "skip")](values)


def _normalized(pairs):
    """A gradient_fn that needs every gradient at once: each divided by 1 + their global norm."""
    scale = 1.0 / (1.0 + tf.linalg.global_norm([g for g, _ in pairs]))
    return [(tf.IndexedSlices(g.values * scale, g.indices, g.dense_shape) if isinstance(g, tf.IndexedSlices)
             else g * scale, v) for g, v in pairs]


def _build(case, own_task=None):
    """(handle, weights by name) of the case's pipeline in the default graph."""
    model = case.get("model", "skip")
    if model.startswith("script:"):  # the script's own training step: its optimizer, no other
        idiom = model[len("script:"):]
        tf.compat.v1.set_random_seed(7)  # its variables' initializers are random: the same draw in every graph
        batch = script_models.ids_batch if idiom.startswith("sparse") else script_models.batch
        model_fn, optimizer = script_models.model_fn(idiom), None
    else:
        batch = {"embedding": toy_models.embedding_batch, "tied_embedding": toy_models.embedding_batch,
                 "time_major": time_major_models.batch}.get(model, toy_models.batch)
        model_fn, optimizer = _model_fn(case), tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
    x, y = tf.nest.map_structure(tf.constant, batch(case.get("batch", 12)))
    plan = dapple_tf.Plan.from_stages(
        [(first, last, [_device(*d) for d in devices]) for first, last, devices in case["stages"]],
        case["micro_batches"])
    options = dapple_tf.PipelineOptions(schedule=case.get("schedule", "dapple"),
                                        stage_functions=case.get("stage_functions", False), own_task=own_task,
                                        clip_global_norm=case.get("clip"),
                                        gradient_fn=_normalized if case.get("gradient_fn") else None,
                                        batch_norm=case.get("batch_norm", "per_slice"),
                                        recompute=case.get("recompute"))
    handle = dapple_tf.build_pipeline(model_fn, x, y, optimizer, plan, options)
    return handle


def _config(case):
    config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=TIMEOUT_S * 1000)
    if not case.get("remapping", True):
        config.graph_options.rewrite_options.remapping = rewriter_config_pb2.RewriterConfig.OFF
    if not case.get("arithmetic", True):
        config.graph_options.rewrite_options.arithmetic_optimization = rewriter_config_pb2.RewriterConfig.OFF
    return config


def _hex(values):
    return [float(v).hex() for v in values.ravel()]


def _weights(sess, handle):
    variables = [v for _, v in handle.grads_and_vars]
    return {v.op.name: _hex(value) for v, value in zip(variables, sess.run(variables))}


def _outputs(steps):
    """handle.outputs of each step, as hex."""
    return [{name: _hex(value) for name, value in sorted(step.items())} for step in steps]


def in_graph(case, target):
    with tf.Graph().as_default():
        handle = _build(case)
        merged = tf.compat.v1.summary.merge_all()
        fetches = {"train": handle.train_op, "loss": handle.loss, "outputs": handle.outputs}
        fetches.update({"summary": merged} if merged is not None else {})
        fetches.update({"global_norm": handle.global_norm} if handle.global_norm is not None else {})
        with tf.compat.v1.Session(target, config=handle.session_config(_config(case))) as sess:
            sess.run(handle.initializer)
            ran = [sess.run(fetches) for _ in range(case.get("steps", 3))]
            variables = tf.compat.v1.global_variables()
            return {"weights": _weights(sess, handle), "losses": [float(r["loss"]).hex() for r in ran],
                    "variables": {v.op.name: _hex(value) for v, value in zip(variables, sess.run(variables))},
                    "outputs": _outputs(r["outputs"] for r in ran),
                    "summaries": [r["summary"].hex() for r in ran if "summary" in r],
                    "global_norms": [float(r["global_norm"]).hex() for r in ran if "global_norm" in r],
                    "ops": len(sess.graph.get_operations())}


def per_host(case, targets):
    """Every task's graph built here in turn, then all run at once, one thread per task
    (scripts.bench.hosts.host_threads)."""
    built = []
    used = {d[0] for _, _, devices in case["stages"] for d in devices}
    for task, target in enumerate(targets[:1 + max(used)]):
        graph = tf.Graph()
        with graph.as_default():
            handle = _build(case, own_task=f"/job:worker/replica:0/task:{task}")
        built.append((graph, handle, target))
    try:
        results = host_threads.run(built, case.get("steps", 3), _config(case), timeout_s=TIMEOUT_S)
    except RuntimeError as e:
        return {"errors": [str(e)]}
    weights = {k: _hex(v) for r in results for k, v in r["weights"].items()}
    loss_task = next(r for r in results if r["losses"])
    return {"weights": weights, "losses": [float(v).hex() for v in loss_task["losses"]],
            "variables": {k: _hex(v) for r in results for k, v in r["variables"].items()},
            "outputs": _outputs(loss_task["outputs"]), "summaries": [s.hex() for s in loss_task["summaries"]],
            "global_norms": [n.hex() for n in loss_task["global_norms"]],
            "other_outputs": [r["outputs"] for r in results if r is not loss_task],
            "ops": [r["ops"] for r in results]}


def _compare(case, target, targets):
    """One case, both ways: whether weights and losses are bit-identical, the largest weight difference, and the
    ops of each graph."""
    import numpy as np

    one = in_graph(case, target)
    tf.compat.v1.Session.reset(target)  # variables and queues live in the servers until reset
    hosts = per_host(case, targets)
    tf.compat.v1.Session.reset(target)
    if "errors" in hosts:
        return {"errors": hosts["errors"]}
    as_array = lambda values: np.array([float.fromhex(v) for v in values])  # noqa: E731
    diffs = [float(np.max(np.abs(as_array(one["weights"][k]) - as_array(hosts["weights"][k])), initial=0.0))
             for k in one["weights"]]
    same = {key: one[key] == hosts[key]
            for key in ("weights", "losses", "variables", "outputs", "summaries", "global_norms")}
    return {"identical": all(same.values()), "same": same, "outputs": sorted(one["outputs"][0]),
            "global_norms": [float.fromhex(n) for n in hosts["global_norms"]],
            "summaries": len(one["summaries"]), "other_outputs": hosts["other_outputs"],
            "loss_hex": [one["losses"], hosts["losses"]],
            "variables": sorted(hosts["weights"]) == sorted(one["weights"]), "max_difference": max(diffs),
            "losses": [float.fromhex(v) for v in hosts["losses"]], "in_graph_ops": one["ops"],
            "per_host_ops": hosts["ops"]}


def main(text):
    cases = json.loads(text)
    tasks = max(1 + max(d[0] for _, _, devices in case["stages"] for d in devices) for case in cases)
    ports = []
    for _ in range(tasks):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    spec = tf.train.ClusterSpec({"worker": [f"127.0.0.1:{p}" for p in ports]})
    servers = [tf.distribute.Server(spec, "worker", task, config=server_config(2)) for task in range(tasks)]
    print(json.dumps([_compare(case, servers[0].target, [s.target for s in servers]) for case in cases]))


if __name__ == "__main__":
    main(sys.argv[1])

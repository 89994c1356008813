"""One case of the random equivalence harness, run in this process: the model trained `steps` steps on one device
(the reference: fuzz_models.py) and pipelined by the case's plan, from the same initial weights; the largest
difference of the trainable weights, and a digest of the pipelined ones (repeats of a case compare it).

The case's conditioning is measured too: the reference trained again from initial weights each changed by 2^-22
of itself, up or down at random (a round-off-sized change; a uniform scale would vanish in a batch norm). Where
that alone moves the weights by more than the harness's tolerance, one device does not reproduce its own result
to the tolerance either, and round-off cannot be told from error below that movement (docs/performance.md,
"Equivalence under stress": MobileNetV2 at 8 samples per batch norm).

Call `prepare()` once per process first (eight virtual CPU devices). A cluster case starts two in-process worker
servers (tf.distribute.Server cannot be stopped: run it in a process of its own); a per-host one (Case.per_host)
builds a graph per worker task and runs each in a thread, unless the runtime refuses the case per host (then one
graph for the cluster; the result's "per_host" says which ran).
"""

import hashlib
import time
from typing import Dict, List

import numpy as np

from scripts.bench.fuzz import fuzz_grammar
from scripts.bench.fuzz.fuzz_grammar import Case

STEPS = 3
PERTURBATION = 2.0 ** -22  # relative change of each initial weight for the conditioning run
NUM_DEVICES = fuzz_grammar.MAX_DEVICES


def prepare() -> None:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from scripts.cli import split_cpu  # pylint: disable=import-outside-toplevel

    split_cpu(NUM_DEVICES)
    tf.get_logger().setLevel("ERROR")


def _slices(total: int, parts: int) -> List[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def batch_norm_groups(case: Case) -> Dict[int, np.ndarray]:
    """Per batch-norm layer, the group of each sample: the rows the pipeline normalizes together (a replica's
    slice of a micro-batch, or with sync batch norm or one replica the micro-batch)."""
    micro = case.batch // case.micro_batches
    groups = {}
    for i, kind in enumerate(case.layers):
        if kind not in fuzz_grammar.BATCH_NORMS:
            continue
        replicas = next(r for a, b, r in case.stages if a <= i <= b)
        per_replica = replicas > 1 and case.batch_norm == "per_slice"
        ids, group = [], 0
        for _ in range(case.micro_batches):
            for size in (_slices(micro, replicas) if per_replica else [micro]):
                ids += [group] * size
                group += 1
        groups[i] = np.array(ids, np.int32)
    return groups


def _train(model_fn, x, y, initial, build):
    """(trainable weights by name, losses) after STEPS steps; `build(model_fn, features, labels, optimizer)` ->
    (train_op, loss, variables, session target, config, after-init op)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    with tf.Graph().as_default():
        optimizer = tf.compat.v1.train.MomentumOptimizer(0.05, 0.9)
        train_op, loss, variables, target, config, init = build(model_fn, tf.constant(x), tf.constant(y), optimizer)
        with tf.compat.v1.Session(target, config=config) as sess:
            sess.run(init)
            for v in variables:
                v.load(initial[v.op.name], sess)
            losses = []
            for _ in range(STEPS):
                losses.append(float(sess.run([loss, train_op])[0]))
            return dict(zip([v.op.name for v in variables], sess.run(variables))), losses


def _single(config):
    def build(model_fn, x, y, optimizer):
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        loss = model_fn(x, y)
        variables = tf.compat.v1.trainable_variables()
        grads = tf.compat.v1.gradients(loss, variables)
        return (optimizer.apply_gradients(zip(grads, variables)), loss, variables, "", config,
                tf.compat.v1.global_variables_initializer())
    return build


def _build(case: Case, devices: List[str], model_fn, x, y, optimizer, own_task=None):
    import dapple_tf  # pylint: disable=import-outside-toplevel

    stages, first = [], 0
    for a, b, replicas in case.stages:
        stages.append((a, b, devices[first:first + replicas]))
        first += replicas
    plan = dapple_tf.Plan.from_stages(stages, case.micro_batches)
    options = dapple_tf.PipelineOptions(schedule=case.schedule, recompute=list(case.recompute),
                                        stage_functions=case.stage_functions, batch_norm=case.batch_norm,
                                        own_task=own_task)
    return dapple_tf.build_pipeline(model_fn, x, y, optimizer, plan, options, layers=dapple_tf.layers_by_scope(depth=1))


def _pipelined(case: Case, devices: List[str], target: str, config):
    def build(model_fn, x, y, optimizer):
        handle = _build(case, devices, model_fn, x, y, optimizer)
        variables = [v for _, v in handle.grads_and_vars]
        return handle.train_op, handle.loss, variables, target, handle.session_config(config), handle.initializer
    return build


def _per_host(case: Case, model_fn, x, y, initial, devices: List[str], targets: List[str]):
    """(trainable weights by name, losses) of the case trained per host, every task's graph in a thread
    (host_threads.py); None when the case asks for something per-host graphs refuse (PerHostError)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from dapple_tf.errors import PerHostError  # pylint: disable=import-outside-toplevel
    from scripts.bench.hosts import host_threads  # pylint: disable=import-outside-toplevel

    used = sorted({tf.DeviceSpec.from_string(d).task for d in devices})
    built = []
    for task in used:
        with tf.Graph().as_default() as graph:
            try:
                handle = _build(case, devices, model_fn, tf.constant(x), tf.constant(y),
                                tf.compat.v1.train.MomentumOptimizer(0.05, 0.9), f"/job:worker/replica:0/task:{task}")
            except PerHostError:
                return None
        built.append((graph, handle, targets[task]))

    def initialize(sess, handle, task):
        sess.run(handle.initializer)
        for _, v in handle.grads_and_vars:
            if host_threads.owns(task, v.device):
                v.load(initial[v.op.name], sess)

    results = host_threads.run(built, STEPS, initialize=initialize)
    return ({k: v for r in results for k, v in r["weights"].items()},
            next(r["losses"] for r in results if r["losses"]))


def _initial(model_fn, x, y, config) -> Dict[str, np.ndarray]:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    with tf.Graph().as_default():
        model_fn(tf.constant(x), tf.constant(y))
        variables = tf.compat.v1.trainable_variables()
        with tf.compat.v1.Session(config=config) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            return dict(zip([v.op.name for v in variables], sess.run(variables)))


def digest(weights: Dict[str, np.ndarray]) -> str:
    h = hashlib.sha1()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(np.ascontiguousarray(weights[name]).tobytes())
    return h.hexdigest()[:16]


def _cluster_devices(count: int):
    """(devices, the servers' targets, servers): `count` CPU devices over two in-process worker servers."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from dapple_tf.cluster import servers as cluster  # pylint: disable=import-outside-toplevel

    per_task = [(count + 1) // 2, count // 2 or 1]
    spec = tf.train.ClusterSpec({cluster.JOB: [f"127.0.0.1:{p}" for p in cluster.free_ports(2)]})
    started = [tf.distribute.Server(spec, cluster.JOB, t, config=cluster.server_config(n))
               for t, n in enumerate(per_task)]
    devices = [f"/job:{cluster.JOB}/replica:0/task:{t}/device:CPU:{i}" for t, n in enumerate(per_task)
               for i in range(n)]
    return devices[:count], [server.target for server in started], started


class HarnessError(Exception):
    """A case failed in the harness's own part (its data or its one-device reference), not in the rewrite: the run
    stops there instead of shrinking the case (scripts/bench/fuzz/fuzz.py)."""


def perturbed(weights: Dict[str, np.ndarray], seed: int) -> Dict[str, np.ndarray]:
    """`weights` each changed by PERTURBATION of itself, up or down at random."""
    rng = np.random.RandomState(seed)
    return {name: (w * (1 + PERTURBATION * rng.choice([-1.0, 1.0], w.shape))).astype(w.dtype)
            for name, w in sorted(weights.items())}


def _relative(want: Dict[str, np.ndarray], got: Dict[str, np.ndarray]) -> float:
    return max(float(np.max(np.abs(want[n] - got[n]) / (1 + np.abs(want[n])))) for n in want)


def run(case: Case) -> dict:
    """The case's result: {"weights": largest |difference|, "relative": largest difference / (1 + |weight|),
    "conditioning": the same measure between the reference and the reference from perturbed inputs,
    "loss": largest loss difference, "digest": the pipelined weights' digest, "seconds"}."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from dapple_tf.rewrite.pipeline import NO_DEADLINE  # pylint: disable=import-outside-toplevel
    from scripts.bench.fuzz import fuzz_models  # pylint: disable=import-outside-toplevel

    started = time.perf_counter()
    config = tf.compat.v1.ConfigProto(device_count={"CPU": NUM_DEVICES})
    config.graph_options.rewrite_options.meta_optimizer_timeout_ms = NO_DEADLINE  # the reference too: load-proof
    try:  # the harness's own part: the data, the weights, the reference on one device
        x, y = fuzz_models.batch(case.input, case.batch, fuzz_grammar.numpy_seed(case.seed, case.index))
        pipelined_fn = fuzz_models.model_fn(case.layers)
        initial = _initial(pipelined_fn, x, y, config)
        reference_fn = fuzz_models.model_fn(case.layers, batch_norm_groups(case))
        want, want_losses = _train(reference_fn, x, y, initial, _single(config))
        moved, _ = _train(reference_fn, x, y, perturbed(initial, fuzz_grammar.numpy_seed(case.seed)), _single(config))
    except Exception as e:  # pylint: disable=broad-except
        raise HarnessError(f"{type(e).__name__}: {e}") from e
    per_host = None
    if case.cluster:
        devices, targets, _servers = _cluster_devices(case.devices)
        from dapple_tf.cluster.servers import session_config  # pylint: disable=import-outside-toplevel

        target, pipe_config = targets[0], session_config(120)
        per_host = _per_host(case, pipelined_fn, x, y, initial, devices, targets) if case.per_host else None
    else:
        devices, target, pipe_config = [f"/device:CPU:{i}" for i in range(case.devices)], "", config
    if per_host is not None:
        got, got_losses = per_host
    else:
        got, got_losses = _train(pipelined_fn, x, y, initial, _pipelined(case, devices, target, pipe_config))
    if sorted(want) != sorted(got):
        return {"error": f"the pipeline trains {sorted(got)}, one device {sorted(want)}"}
    worst = max(want, key=lambda n: float(np.max(np.abs(want[n] - got[n]))))
    diff = np.abs(want[worst] - got[worst])
    return {"weights": float(diff.max()), "variable": worst,
            "relative": _relative(want, got), "conditioning": _relative(want, moved),
            "loss": max(abs(a - b) for a, b in zip(want_losses, got_losses)), "digest": digest(got),
            "per_host": per_host is not None,
            "seconds": time.perf_counter() - started}

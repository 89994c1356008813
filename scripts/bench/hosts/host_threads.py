"""Per-host graphs (PipelineOptions.own_task) of in-process worker servers, run as their own processes would run
them: each task's graph in a thread of this process, with a session on its own task's server. The fuzz harness's
per-host cases and tests/per_host_probe.py use it.
"""

import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

TIMEOUT_S = 120


def owns(task: int, device: str) -> bool:
    """Whether a variable on `device` is task `task`'s to report (unplaced ones: task 0's)."""
    return f"/task:{task}/" in device or (not device and task == 0)


def run(tasks: Sequence[Tuple[object, object, str]], steps: int, config=None,
        initialize: Optional[Callable] = None, timeout_s: float = TIMEOUT_S) -> List[Dict]:
    """`tasks`: (graph, PipelineHandle, session target) per task, task 0 first. All run at once: host_session.start
    (with `initialize(session, handle, task)` instead of the handle's initializer when given), then `steps` steps.
    Returns per task {"losses": the loss after each step (empty but on the loss's task), "weights": {name: value}
    of the trained variables the task owns, "variables": of all its global variables (optimizer slots, moving
    averages), "outputs": handle.outputs fetched with each step, "summaries": the merged summaries (serialized) and
    "global_norms": the gradients' global norm (clip_global_norm) of each step on the loss's task, "ops": its graph's operations}; raises RuntimeError naming every task's error."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from dapple_tf.cluster import host_session  # pylint: disable=import-outside-toplevel

    results: List[Dict] = [{} for _ in tasks]
    errors: List[str] = []

    def train(task, graph, handle, target):
        try:
            options = handle.session_config(config or tf.compat.v1.ConfigProto(
                operation_timeout_in_ms=int(timeout_s * 1000)))
            with graph.as_default():
                merged = tf.compat.v1.summary.merge_all() if handle.loss is not None else None
                fetches = {"train": handle.train_op, "outputs": handle.outputs}
                fetches.update({k: v for k, v in (("loss", handle.loss), ("summary", merged),
                                                  ("global_norm", handle.global_norm)) if v is not None})
            with graph.as_default(), tf.compat.v1.Session(target, config=options) as sess:
                own_init = (lambda: initialize(sess, handle, task)) if initialize else None
                host_session.start(sess, handle, timeout_s, initialize=own_init)
                ran = [sess.run(fetches) for _ in range(steps)]
                trained = [v for _, v in handle.grads_and_vars if owns(task, v.device)]
                variables = [v for v in tf.compat.v1.global_variables() if owns(task, v.device)]
                results[task] = {"losses": [float(r["loss"]) for r in ran if "loss" in r],
                                 "weights": dict(zip([v.op.name for v in trained], sess.run(trained))),
                                 "variables": dict(zip([v.op.name for v in variables], sess.run(variables))),
                                 "outputs": [r["outputs"] for r in ran],
                                 "summaries": [r["summary"] for r in ran if "summary" in r],
                                 "global_norms": [float(r["global_norm"]) for r in ran if "global_norm" in r],
                                 "ops": len(graph.get_operations())}
        except Exception as e:  # pylint: disable=broad-except
            errors.append(f"task {task}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=train, args=(task, *t)) for task, t in enumerate(tasks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    return results

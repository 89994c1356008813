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
    of the trained variables the task owns, "ops": its graph's operations}; raises RuntimeError naming every task's
    error."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from dapple_tf.cluster import host_session  # pylint: disable=import-outside-toplevel

    results: List[Dict] = [{} for _ in tasks]
    errors: List[str] = []

    def train(task, graph, handle, target):
        try:
            options = handle.session_config(config or tf.compat.v1.ConfigProto(
                operation_timeout_in_ms=int(timeout_s * 1000)))
            with graph.as_default(), tf.compat.v1.Session(target, config=options) as sess:
                own_init = (lambda: initialize(sess, handle, task)) if initialize else None
                host_session.start(sess, handle, timeout_s, initialize=own_init)
                fetches = [handle.train_op] + ([handle.loss] if handle.loss is not None else [])
                losses = [sess.run(fetches)[1:] for _ in range(steps)]
                variables = [v for _, v in handle.grads_and_vars if owns(task, v.device)]
                results[task] = {"losses": [float(l[0]) for l in losses if l],
                                 "weights": dict(zip([v.op.name for v in variables], sess.run(variables))),
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

"""Starting a per-host graph's session (PipelineOptions.own_task): this task's variables first, then, once every
other task has initialized the variables this task copies or reads, the copies.

Each task initializes only the variables on its own devices (its stages' first devices), so no value is written
twice; a task whose stage replicas copy another task's variables waits for them here, as TensorFlow's
SessionManager waits with `ready_for_local_init_op`. Given the cluster, it first waits for the tasks this task
exchanges with (handle.tasks, also the session's device filters): TF's session creation waits for ever for a
worker that never answers.
"""

import time
from typing import Callable, Dict, List, Optional

import tensorflow as tf

from dapple_tf.cluster.servers import ClusterError, TFCluster, wait_for_workers
from dapple_tf.rewrite.hosts.host_part import task_of


def start(session: tf.compat.v1.Session, handle, timeout_s: float, cluster: Optional[TFCluster] = None,
          poll_s: float = 0.1, initialize: Optional[Callable[[], None]] = None) -> None:
    """Waits for the peer tasks (with `cluster`), runs handle.initializer (or `initialize()`: a restore of this
    task's variables), waits until the other tasks' variables are initialized, runs handle.local_init_op. Raises
    ClusterError naming the tasks that do not answer, or whose variables are still uninitialized, after
    `timeout_s`."""
    if cluster is not None:
        wait_for_peers(cluster, handle.tasks[1:], timeout_s, poll_s)
    if initialize is None:
        session.run(handle.initializer)
    else:
        initialize()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            missing = [name.decode() for name in session.run(handle.ready_for_local_init_op)]
        except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError) as e:
            missing = [f"(unreachable: {e.message.splitlines()[0]})"]
        if not missing:
            break
        if time.monotonic() >= deadline:
            waiting = "; ".join(f"{task}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                                for task, names in _by_task(session.graph, missing).items())
            raise ClusterError(f"after {timeout_s:g} s, other tasks have not initialized the variables this task "
                               f"copies ({waiting}): is every task of the cluster running this program?")
        time.sleep(poll_s)
    session.run(handle.local_init_op)


def wait_for_peers(cluster: TFCluster, tasks, timeout_s: float, poll_s: float = 0.1) -> None:
    """Waits until the worker tasks `tasks` ("/job:worker/replica:0/task:K") answer; raises ClusterError naming
    those that do not after `timeout_s` (servers.wait_for_workers on those tasks)."""
    wait_for_workers(cluster, timeout_s, poll_s, tasks=[tf.DeviceSpec.from_string(t).task for t in tasks])


def _by_task(graph: tf.Graph, names: List[str]) -> Dict[str, List[str]]:
    """The variables' names grouped by the task of their device ("?" for a name no variable has)."""
    devices = {v.op.name: v.device for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)}
    out: Dict[str, List[str]] = {}
    for name in names:
        out.setdefault(task_of(devices[name]) if devices.get(name) else "?", []).append(name)
    return out

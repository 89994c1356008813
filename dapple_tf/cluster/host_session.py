"""Starting a per-host graph's session (PipelineOptions.own_task): this task's variables first, then, once every
other task has initialized the variables this task copies or reads, the copies.

Each task initializes only the variables on its own devices (its stages' first devices), so no value is written
twice; a task whose stage replicas copy another task's variables waits for them here, as TensorFlow's
SessionManager waits with `ready_for_local_init_op`.
"""

import time

import tensorflow as tf

from dapple_tf.cluster.servers import ClusterError


def start(session: tf.compat.v1.Session, handle, timeout_s: float, poll_s: float = 0.1) -> None:
    """Runs handle.initializer, waits until the other tasks' variables are initialized, runs handle.local_init_op.
    Raises ClusterError naming the variables still uninitialized after `timeout_s` (their task did not start)."""
    session.run(handle.initializer)
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [name.decode() for name in session.run(handle.ready_for_local_init_op)]
        if not missing:
            break
        if time.monotonic() >= deadline:
            raise ClusterError(f"after {timeout_s:g} s, variables of other tasks are still not initialized: "
                               f"{missing[:5]}{' ...' if len(missing) > 5 else ''}; is every task of the cluster "
                               "running this program?")
        time.sleep(poll_s)
    session.run(handle.local_init_op)

"""Run as the chief under dapple_launch: a 3-stage 2:1:3 plan spanning the launched cluster's 3 worker
tasks trains like one device. Prints one line per schedule: `SCHEDULE max_rel_diff=X losses=[...]`;
exits 1 if any weight differs by more than rtol 1e-5.

    dapple_launch --cluster=local:3x2 -- python tests/cluster_chief.py dapple gpipe
"""

import sys

import numpy as np
import tensorflow as tf

import dapple_tf
from dapple_tf.cluster.servers import TFCluster, session_config, wait_for_workers
from tests import toy_models
from tests.pipeline_harness import train_pipelined, train_single

STEPS, BATCH, MICRO_BATCHES = 3, 14, 2


def device(task, index):
    return f"/job:worker/replica:0/task:{task}/device:CPU:{index}"


PLAN_2_1_3 = [(0, 0, [device(0, 0), device(0, 1)]), (1, 2, [device(1, 0)]),
              (3, 4, [device(1, 1), device(2, 0), device(2, 1)])]


def sgd():
    return tf.compat.v1.train.GradientDescentOptimizer(0.1)


def main(schedules):
    cluster = TFCluster.from_tf_config()
    wait_for_workers(cluster, timeout_s=120)
    values = toy_models.initial_values()
    x, y = toy_models.batch(BATCH)
    model_fn = toy_models.skip_model_fn(values)
    _, expected, expected_losses = train_single(model_fn, x, y, sgd, STEPS)
    ok = True
    for schedule in schedules:
        plan = dapple_tf.Plan.from_stages(PLAN_2_1_3, num_micro_batches=MICRO_BATCHES)
        _, weights, losses, _, _ = train_pipelined(model_fn, x, y, sgd, plan, schedule, STEPS,
                                                   target=cluster.target, config=session_config(120))
        diff = max(float(np.max(np.abs(weights[k] - expected[k]) / (np.abs(expected[k]) + 1e-6))) for k in expected)
        loss_diff = float(np.max(np.abs(np.array(losses) - np.array(expected_losses))))
        ok = ok and all(np.allclose(weights[k], expected[k], rtol=1e-5, atol=1e-6) for k in expected)
        print(f"{schedule} max_rel_diff={diff:.3g} max_loss_diff={loss_diff:.3g} losses={[round(float(v), 6) for v in losses]}",
              flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

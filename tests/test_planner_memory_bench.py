"""The planner's memory model against the runtime (scripts/bench/memory/planner_memory.py): the benchmark runs, and the
estimated per-device peak of a 2-stage plan describes the peak measured in a traced pipelined step.

Both sides read TF's allocator, whose peaks follow the executor's op order: the benchmark's 25% target is
checked by the benchmark (docs/planner.md has its runs), not here. GNMT's decoder device read 0.83-0.91 in the
benchmark's runs and 0.696 in one CI run with its working-bytes term, 0.68 without it, so no bound on one run
tells the two apart (the MLP's second device: 0.74-0.96); the terms
themselves are tested on fixed numbers in tests/test_planner_memory_model.py (working bytes held once by the step
and by a stage, the step peak decomposed in time)."""

import json

import pytest

from tests.programs import run_program


@pytest.mark.long
def test_estimated_peak_describes_the_measured_one(tmp_path):
    out = tmp_path / "rows.json"
    r = run_program("bench.memory.planner_memory", "--models=mlp,vgg19,gnmt", f"--json={out}")
    assert r.returncode == 0, r.stderr
    rows = json.load(open(out))
    assert [row["model"] for row in rows] == ["mlp", "vgg19", "gnmt"]
    for row in rows:
        assert row["memory_source"] == "step"
        for est, meas in zip(row["estimated"], row["measured"]):
            # Single runs move each side by up to 10%; a factor of 2 either way would be another model
            # (activations of every micro-batch, or none, or the optimizer's state counted twice).
            assert meas > 0 and 0.5 <= est / meas <= 2.0, row


def test_the_measured_side_counts_the_constants_each_device_keeps():
    import numpy as np
    import tensorflow as tf

    from dapple_tf.trace.step_stats import constant_bytes_per_device

    graph = tf.compat.v1.GraphDef()
    for name, device, value in [("images", "/job:localhost/replica:0/task:0/device:CPU:0", np.zeros([8, 4], np.float32)),
                                ("labels", "/job:localhost/replica:0/task:0/device:CPU:1", np.zeros([8], np.int64))]:
        node = graph.node.add(name=name, op="Const", device=device)
        node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value))
    graph.node.add(name="add", op="AddV2", device="/job:localhost/replica:0/task:0/device:CPU:0")
    assert constant_bytes_per_device([graph]) == {"/job:localhost/replica:0/task:0/device:CPU:0": 8 * 4 * 4,
                                                  "/job:localhost/replica:0/task:0/device:CPU:1": 8 * 8}

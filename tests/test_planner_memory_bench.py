"""The planner's memory model against the runtime (scripts/bench/planner_memory.py): estimated
per-device peak of a 2-stage plan within 25% of the peak measured in a traced pipelined step
(gnmt: its decoder stage holds an LSTM backward's slice-gradient buffers, the working-bytes term)."""

import json

import pytest

from tests.programs import run_program


@pytest.mark.slow
def test_estimated_peak_within_25_percent_of_measured(tmp_path):
    out = tmp_path / "rows.json"
    r = run_program("bench.planner_memory", "--models=mlp,vgg19,gnmt", f"--json={out}")
    assert r.returncode == 0, r.stderr
    rows = json.load(open(out))
    assert [row["model"] for row in rows] == ["mlp", "vgg19", "gnmt"]
    for row in rows:
        assert row["memory_source"] == "step"
        for est, meas in zip(row["estimated"], row["measured"]):
            # The benchmark's target is 25% (WORKSPACE_NOTES.md has its tables); single runs move by up
            # to 10% (the profile's step peak and the traced peaks follow the executor's op order), so
            # the test allows 30%. The model without working bytes (GNMT's decoder at 0.68) fails it,
            # and so does the step peak taken as every gradient and kept byte alive at once (VGG-19's
            # first device at 0.67 once the measured side counts the input constants).
            assert meas > 0 and 0.70 <= est / meas <= 1.30, row


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

"""The executed order of tasks on every device (RunMetadata step stats) is the schedule's order."""

import pytest
import tensorflow as tf

import dapple_tf
from tests import toy_models
from tests.pipeline_harness import cpu, train_pipelined


def executed_tasks(run_metadata, handle):
    """Per device: the tasks in the order they ran, and each task's (first start, last end) in µs."""
    where = {}
    for (device, task, replica), names in handle.task_op_names.items():
        for name in names:
            where[name] = (device, task, replica)
    spans = {}
    for dev_stats in run_metadata.step_stats.dev_stats:
        for node in dev_stats.node_stats:
            key = where.get(node.node_name)
            if key is None:
                continue
            start, end = node.all_start_micros, node.all_start_micros + node.all_end_rel_micros
            device = tf.DeviceSpec.from_string(dev_stats.device).replace(job=None, replica=None, task=None).to_string()
            lo, hi = spans.get((device, key[1]), (start, end))
            spans[(device, key[1])] = (min(lo, start), max(hi, end))
    per_device = {}
    for (device, task), span in spans.items():
        per_device.setdefault(device, []).append((span, task))
    return {d: sorted(v, key=lambda x: x[0]) for d, v in per_device.items()}


@pytest.mark.parametrize("schedule", ["dapple", "gpipe"])
def test_each_device_runs_its_stage_order(schedule):
    x, y = toy_models.batch(16)
    plan = dapple_tf.Plan.from_stages(
        [(0, 1, [cpu(0), cpu(1)]), (2, 2, [cpu(2)]), (3, 4, [cpu(3)])], num_micro_batches=4
    )
    metadata = tf.compat.v1.RunMetadata()
    sgd = lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1)  # noqa: E731
    *_, handle, _ = train_pipelined(
        toy_models.skip_model_fn(toy_models.initial_values()), x, y, sgd, plan, schedule, 1, run_metadata=metadata
    )
    order = executed_tasks(metadata, handle)
    stage_of_device = {d: s.index for s in handle.stages for d in s.devices}
    assert set(order) == set(stage_of_device)
    for device, spans in order.items():
        expected = [str(t) for t in handle.schedule.stage_tasks[stage_of_device[device]]]
        assert [str(task) for _, task in spans] == expected, device
        for ((_, end), _), ((start, _), task) in zip(spans, spans[1:]):
            assert end <= start, f"{device}: {task} started before the previous task ended"

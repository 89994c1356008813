"""The order of tasks on every device is the schedule's: in the graph TF ran (every operation of a task waits for
all of the previous task's in the partition graphs, after grappler) and as measured (RunMetadata step stats)."""

import pytest
import tensorflow as tf

import dapple_tf
from dapple_tf.trace.step_stats import op_interval_ns
from tests import toy_models
from tests.pipeline_harness import cpu, train_pipelined


def executed_tasks(run_metadata, handle):
    """Per device: the tasks in the order they ran, and each task's (first start, last kernel end) in ns. Not TF's
    all_end: it is stamped after the successors were released, and a preempted thread stamped one 2 ms after the
    next task began (CI, 2026-11-28; dapple_tf.trace.step_stats.op_interval_ns)."""
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
            start, end = op_interval_ns(node)
            device = tf.DeviceSpec.from_string(dev_stats.device).replace(job=None, replica=None, task=None).to_string()
            lo, hi = spans.get((device, key[1]), (start, end))
            spans[(device, key[1])] = (min(lo, start), max(hi, end))
    per_device = {}
    for (device, task), span in spans.items():
        per_device.setdefault(device, []).append((span, task))
    return {d: sorted(v, key=lambda x: x[0]) for d, v in per_device.items()}


def partition_graph_ancestors(run_metadata):
    """{node name: names of its ancestors} in the partition graphs TF ran (a _Recv's input is its _Send)."""
    nodes = {n.name: n for g in run_metadata.partition_graphs for n in g.node}
    transfer = lambda n: tuple(n.attr[k].s for k in ("tensor_name", "send_device", "recv_device"))  # noqa: E731
    sends = {transfer(n): name for name, n in nodes.items() if n.op in ("_Send", "_HostSend")}
    inputs = {name: [i.lstrip("^").split(":")[0] for i in n.input] for name, n in nodes.items()}
    for name, n in nodes.items():
        if n.op in ("_Recv", "_HostRecv"):
            inputs[name].append(sends[transfer(n)])
    found = {}

    def ancestors(name):
        if name not in found:
            seen, stack = set(), [name]
            while stack:
                for parent in inputs[stack.pop()]:
                    if parent not in seen:
                        seen.add(parent)
                        stack.append(parent)
            found[name] = seen
        return found[name]

    return nodes, ancestors


def unordered_operations(run_metadata, handle, device, tasks):
    """(task, its operation, how many of the previous task's it does not wait for) in the graph TF ran on `device`,
    for consecutive `tasks` (after grappler's rewrites: the order TF's executor keeps)."""
    nodes, ancestors = partition_graph_ancestors(run_metadata)
    replicas = {j for s in handle.stages for j, d in enumerate(s.devices) if d == device}
    ran = [(task, [n for r in replicas for n in handle.task_op_names.get((device, task, r), ()) if n in nodes])
           for task in tasks]
    ran = [(task, names) for task, names in ran if names]
    return [(task, name, len(set(before) - ancestors(name)))
            for (_, before), (task, names) in zip(ran, ran[1:]) for name in names if set(before) - ancestors(name)]


THREE_STAGES = [(0, 1, [cpu(0), cpu(1)]), (2, 2, [cpu(2)]), (3, 4, [cpu(3)])]
INTERLEAVED = [(0, 0, [cpu(0), cpu(1)]), (1, 1, [cpu(2)]), (2, 2, [cpu(0), cpu(1)]), (3, 4, [cpu(2)])]


@pytest.mark.parametrize("schedule,stages", [("dapple", THREE_STAGES), ("gpipe", THREE_STAGES),
                                             ("zb-h1", THREE_STAGES), ("zb-h2", THREE_STAGES),
                                             ("interleaved", INTERLEAVED)])
def test_each_device_runs_its_stage_order(schedule, stages):
    """Each device runs its stage's order (interleaved: its device group's merged order of several stages)."""
    x, y = toy_models.batch(16)
    plan = dapple_tf.Plan.from_stages(stages, num_micro_batches=4)
    metadata = tf.compat.v1.RunMetadata()
    sgd = lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1)  # noqa: E731
    *_, handle, _ = train_pipelined(
        toy_models.skip_model_fn(toy_models.initial_values()), x, y, sgd, plan, schedule, 1, run_metadata=metadata
    )
    order = executed_tasks(metadata, handle)
    lane_of_device = {d: handle.schedule.lane_of(s.index) for s in handle.stages for d in s.devices}
    assert set(order) == set(lane_of_device)
    for device, spans in order.items():
        has_ops = {task for (d, task, _), names in handle.task_op_names.items() if d == device and names}
        # the first stage's B tasks are empty under zero bubble: it sends no input gradient
        expected = [t.label for t in handle.schedule.lane_tasks[lane_of_device[device]] if t in has_ops]
        assert len(expected) >= 2 * plan.num_micro_batches * len(handle.schedule.lane_stages(lane_of_device[device]))
        assert [task.label for _, task in spans] == expected, device
        for ((_, end), _), ((start, _), task) in zip(spans, spans[1:]):
            assert end <= start, f"{device}: {task} started before the previous task ended"
        assert unordered_operations(metadata, handle, device, handle.schedule.lane_tasks[lane_of_device[device]]) == []


def test_the_order_check_finds_operations_that_do_not_wait():
    """unordered_operations reads the graph TF ran: without their control inputs, the second task's entry operations
    no longer wait for the first task (nor some of its operations for each other, which the third task sees)."""
    x, y = toy_models.batch(16)
    plan = dapple_tf.Plan.from_stages(THREE_STAGES, num_micro_batches=4)
    metadata = tf.compat.v1.RunMetadata()
    sgd = lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1)  # noqa: E731
    *_, handle, _ = train_pipelined(
        toy_models.skip_model_fn(toy_models.initial_values()), x, y, sgd, plan, "dapple", 1, run_metadata=metadata
    )
    device, tasks = cpu(3), handle.schedule.lane_tasks[handle.schedule.lane_of(2)]  # last stage: F0 B0 F1 B1 ...
    assert unordered_operations(metadata, handle, device, tasks) == []
    second = set(handle.task_op_names[(device, tasks[1], 0)])
    for graph in metadata.partition_graphs:
        for node in graph.node:
            if node.name in second:
                kept = [i for i in node.input if not i.startswith("^")]
                del node.input[:]
                node.input.extend(kept)
    unordered = unordered_operations(metadata, handle, device, tasks)
    assert tasks[1] in {task for task, _, _ in unordered} and tasks[0] not in {task for task, _, _ in unordered}


def _graph_ops(schedule):
    x, y = toy_models.batch(16)
    plan = dapple_tf.Plan.from_stages([(0, 1, [cpu(0), cpu(1)]), (2, 2, [cpu(2)]), (3, 4, [cpu(3)])],
                                      num_micro_batches=4)
    with tf.Graph().as_default() as graph:
        features, labels = tf.constant(x), tf.constant(y)
        handle = dapple_tf.build_pipeline(toy_models.skip_model_fn(toy_models.initial_values()), features, labels,
                                          tf.compat.v1.train.GradientDescentOptimizer(0.1), plan,
                                          dapple_tf.PipelineOptions(schedule=schedule))
    return graph.get_operations(), handle


def test_zero_bubble_moves_weight_gradients_into_w_tasks_without_copies():
    """zb-h1 builds the same computation as dapple: as many MatMuls (forward, input and weight gradients),
    each in exactly one task; every W task holds weight-gradient MatMuls, no B task of the first stage exists."""
    dapple_ops, _ = _graph_ops("dapple")
    zb_ops, handle = _graph_ops("zb-h1")
    count = lambda ops: sum(op.type == "MatMul" for op in ops)  # noqa: E731
    assert count(zb_ops) == count(dapple_ops) > 0
    owner = {}
    for key, names in handle.task_op_names.items():
        for name in names:
            assert name not in owner, f"{name} is in tasks {owner[name]} and {key}"
            owner[name] = key
    by_kind, matmul_names = {}, {op.name for op in zb_ops if op.type == "MatMul"}
    for (device, task, replica), names in handle.task_op_names.items():
        matmuls = [n for n in names if n in matmul_names]
        by_kind.setdefault(task.kind, 0)
        by_kind[task.kind] += len(matmuls)
        if task.kind == "W":
            assert matmuls, f"W task {task} of {device} has no weight-gradient MatMul"
        if task.kind == "B" and names:
            assert task.stage > 0, f"the first stage sends no input gradient, yet has B task {task}"
    # forward: one MatMul per dense layer per micro-batch and replica; B and W split the backward's
    assert by_kind["F"] > 0 and by_kind["B"] > 0 and by_kind["W"] > 0

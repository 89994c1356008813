"""dapple_tf.trace.timeline: the measured timeline of one traced pipelined step (virtual CPU devices), its
boxes per task, transfers, AllReduce and optimizer steps, its Chrome trace and its picture."""

import collections
import json

import pytest
import tensorflow as tf

import dapple_tf
from dapple_tf.trace import timeline
from planner.simulation.simulator import (KIND_ALLREDUCE, KIND_BACKWARD, KIND_FORWARD, KIND_OPTIMIZER,
                                          KIND_SEND_ACTIVATION, KIND_SEND_GRADIENT, KIND_WEIGHT, simulate)
from tests import toy_models
from tests.pipeline_harness import SESSION_CONFIG, cpu

M = 2
PLANS = {
    "straight": [(0, 2, [cpu(0)]), (3, 4, [cpu(1)])],
    "replicated_2_1": [(0, 2, [cpu(0), cpu(1)]), (3, 4, [cpu(2)])],
}
LOCAL = "/job:localhost/replica:0/task:0"


def traced_step(stages, partition_graphs=True, schedule="dapple"):
    """Builds the dapple pipeline of the toy model for `stages`, runs a step, traces the next one."""
    x, y = toy_models.batch(8)
    plan = dapple_tf.Plan.from_stages(stages, num_micro_batches=M)
    with tf.Graph().as_default():
        handle = dapple_tf.build_pipeline(toy_models.skip_model_fn(toy_models.initial_values()), tf.constant(x),
                                          tf.constant(y), tf.compat.v1.train.GradientDescentOptimizer(0.1), plan,
                                          dapple_tf.PipelineOptions(schedule=schedule))
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE,
                                          output_partition_graphs=partition_graphs)
        metadata = tf.compat.v1.RunMetadata()
        with tf.compat.v1.Session(config=SESSION_CONFIG) as sess:
            sess.run(handle.initializer)
            sess.run(handle.train_op)
            sess.run(handle.train_op, options=options, run_metadata=metadata)
    return metadata, handle


@pytest.fixture(scope="module", params=sorted(PLANS))
def traced(request):
    metadata, handle = traced_step(PLANS[request.param])
    return metadata, handle, timeline.measured_timeline(metadata, handle)


def counts(result, kind):
    return collections.Counter((e.stage, e.micro_batch) for e in result.events if e.kind == kind)


def test_one_forward_and_backward_box_per_task_in_the_schedule_order(traced):
    _, handle, measured = traced
    every = collections.Counter({(s, m): 1 for s in range(2) for m in range(M)})
    assert counts(measured, KIND_FORWARD) == every and counts(measured, KIND_BACKWARD) == every
    for s, tasks in enumerate(handle.schedule.stage_tasks):
        boxes = sorted(measured.stage_events(s, (KIND_FORWARD, KIND_BACKWARD)), key=lambda e: e.start_ms)
        assert [e.label for e in boxes] == [str(t) for t in tasks]
        for before, after in zip(boxes, boxes[1:]):  # the schedule's control edges chain them
            assert before.end_ms <= after.start_ms, (before, after)
    ids = [d for s in handle.stages for d in s.devices]
    assert measured.device_stage == {i: s.index for s in handle.stages for i, d in enumerate(ids) if d in s.devices}
    assert all(0.0 <= e.start_ms <= e.end_ms <= measured.iteration_ms for e in measured.events)


def test_transfers_allreduce_and_optimizer_boxes(traced):
    _, handle, measured = traced
    assert counts(measured, KIND_SEND_ACTIVATION) == {(0, m): 1 for m in range(M)}
    assert counts(measured, KIND_SEND_GRADIENT) == {(1, m): 1 for m in range(M)}
    assert {e.resource for e in measured.events if e.kind == KIND_SEND_ACTIVATION} == {"link0>1"}
    assert {e.resource for e in measured.events if e.kind == KIND_SEND_GRADIENT} == {"link1>0"}
    replicated = {s.index: 1 for s in handle.stages if s.replication > 1}
    assert counts(measured, KIND_ALLREDUCE) == {(s, -1): n for s, n in replicated.items()}
    assert counts(measured, KIND_OPTIMIZER) == {(0, -1): 1, (1, -1): 1}
    assert [st.devices for st in measured.stages] == [
        tuple(i for i, d in sorted(measured.device_stage.items()) if d == s) for s in range(2)
    ]
    assert all((st.allreduce_ms > 0) == (s in replicated) for s, st in enumerate(measured.stages))


def test_without_partition_graphs_the_graph_gives_the_same_transfers():
    metadata, handle = traced_step(PLANS["replicated_2_1"], partition_graphs=False)
    assert not metadata.partition_graphs
    measured = timeline.measured_timeline(metadata, handle)
    assert counts(measured, KIND_SEND_ACTIVATION) == {(0, m): 1 for m in range(M)}
    assert counts(measured, KIND_SEND_GRADIENT) == {(1, m): 1 for m in range(M)}


def test_a_remote_receive_times_its_transfer_and_other_devices_are_ignored():
    metadata, handle = traced_step(PLANS["straight"])
    receive = next(n for g in metadata.partition_graphs for n in g.node
                   if n.op == "_Recv" and "dapple/stage0/mb1/" in n.attr["tensor_name"].s.decode())
    last_us = max(n.all_start_micros + n.all_end_rel_micros for d in metadata.step_stats.dev_stats
                  for n in d.node_stats)
    # as a cluster's worker reports a transfer from another task: one RecvTensor op on the receiver
    remote = metadata.step_stats.dev_stats.add(device=LOCAL + handle.stages[1].devices[0])
    tensor, send, recv = (receive.attr[k].s.decode() for k in ("tensor_name", "send_device", "recv_device"))
    remote.node_stats.add(node_name="RecvTensor", all_start_micros=last_us + 100, all_end_rel_micros=1000,
                          timeline_label=f"[64B] [0.5Mb/s] {tensor} from {send} to {recv}")
    stream = metadata.step_stats.dev_stats.add(device=LOCAL + handle.stages[0].devices[0] + "/stream:all")
    stream.node_stats.add(node_name="kernel", all_start_micros=last_us + 10**6, all_end_rel_micros=5)
    measured = timeline.measured_timeline(metadata, handle)
    box = next(e for e in measured.events if e.kind == KIND_SEND_ACTIVATION and e.micro_batch == 1)
    assert box.duration_ms == pytest.approx(1.0)
    assert box.end_ms == pytest.approx(measured.iteration_ms)  # not the stream's kernel, a second later


def run_during_forward(metadata, handle, stage, forward, backward, op_type):
    """Moves one `op_type` operation of `backward` (on `stage`'s device) to the start of `forward`, as a backward's
    factor of forward values runs (e.g. a GELU derivative's)."""
    device = handle.stages[stage].devices[0]
    nodes = {n.node_name: n for d in metadata.step_stats.dev_stats if d.device.endswith(device) for n in d.node_stats}
    forward_start = min(nodes[n].all_start_nanos for n in handle.task_op_names[(device, forward, 0)] if n in nodes)
    early = next(nodes[n] for n in handle.task_op_names[(device, backward, 0)]
                 if n in nodes and f" = {op_type}(" in nodes[n].timeline_label)
    early.all_start_nanos, early.op_start_rel_nanos = forward_start + 1000, 0
    early.op_end_rel_nanos = early.all_end_rel_nanos = 1000
    early.all_start_micros, early.op_start_rel_micros = (forward_start + 1000) // 1000, 0
    early.op_end_rel_micros = early.all_end_rel_micros = 1


def box(result, kind, stage, mb):
    return next((e.start_ms, e.end_ms) for e in result.events if (e.kind, e.stage, e.micro_batch) == (kind, stage, mb))


def test_a_backward_operation_run_during_the_forward_stays_out_of_the_backward_box():
    metadata, handle = traced_step(PLANS["straight"])
    before = timeline.measured_timeline(metadata, handle)
    forward, backward = handle.schedule.stage_tasks[1][:2]  # F0 B0 on the last stage
    run_during_forward(metadata, handle, 1, forward, backward, "Mul")
    after = timeline.measured_timeline(metadata, handle)
    assert box(after, KIND_FORWARD, 1, 0) == box(before, KIND_FORWARD, 1, 0)
    assert box(after, KIND_BACKWARD, 1, 0)[0] == box(after, KIND_FORWARD, 1, 0)[1]  # from the end of the task before
    assert box(after, KIND_BACKWARD, 1, 0)[1] == box(before, KIND_BACKWARD, 1, 0)[1]


def test_a_backward_box_starts_when_its_gradient_arrives():
    metadata, handle = traced_step(PLANS["straight"])
    tasks = handle.schedule.stage_tasks[0]  # F0 F1 B0 B1
    run_during_forward(metadata, handle, 0, tasks[0], tasks[2], "TanhGrad")
    measured = timeline.measured_timeline(metadata, handle)
    arrived, previous_end = box(measured, KIND_SEND_GRADIENT, 1, 0)[1], box(measured, KIND_FORWARD, 0, 1)[1]
    assert arrived > previous_end  # stage 1's F0 and B0 outlast stage 0's F1 here: the wait is for the gradient
    assert box(measured, KIND_BACKWARD, 0, 0)[0] == pytest.approx(arrived)


def test_chrome_trace_holds_the_boxes(traced, tmp_path):
    _, handle, measured = traced
    path = tmp_path / "measured.json"
    written = timeline.write_measured_trace(measured, str(path))
    boxes = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert written == len(boxes)
    for device, stage in measured.device_stage.items():
        mine = collections.Counter(e["cat"] for e in boxes if e["pid"] == device)
        # an optimizer step that ran entirely inside the last backward is a zero-length box, left out
        expected_optimizer = sum(e.duration_ms > 0 for e in measured.events if e.kind == KIND_OPTIMIZER and e.stage == stage)
        assert mine[KIND_FORWARD] == M and mine[KIND_BACKWARD] == M and mine[KIND_OPTIMIZER] == expected_optimizer
        names = [e["name"] for e in sorted(boxes, key=lambda e: e["ts"])
                 if e["pid"] == device and e["cat"] in (KIND_FORWARD, KIND_BACKWARD)]
        assert names == [str(t) for t in handle.schedule.stage_tasks[stage]]


def test_picture_of_measured_above_simulated(traced, tmp_path):
    _, handle, measured = traced
    simulated = simulate(measured.stages, handle.schedule, micro_batch_size=measured.micro_batch_size)
    path = tmp_path / "measured_vs_simulated.png"
    info = timeline.draw_measured_vs_simulated(measured, simulated, str(path))
    assert path.stat().st_size > 0
    devices = len(measured.device_stage)
    assert info.rows == [devices, devices]
    assert info.boxes[KIND_FORWARD] == info.boxes[KIND_BACKWARD] == 2 * M * devices
    drawn = sum(len([d for d, s in measured.device_stage.items() if s == e.stage])
                for e in measured.events if e.kind == KIND_OPTIMIZER and e.duration_ms > 0)
    assert info.boxes[KIND_OPTIMIZER] == 2 * drawn  # the simulation replays the measured optimizer times
    replicated_devices = sum(s.replication for s in handle.stages if s.replication > 1)
    assert info.boxes[KIND_ALLREDUCE] == 2 * replicated_devices


def test_a_later_stage_backward_is_drawn_as_input_then_weight_gradients(traced):
    """Stage 1 computes the input gradients stage 0 waits for first (tasks.input_gradients_first): its
    backward is a B box up to its marker and a W box after; stage 0, whose input gradients nobody needs, has
    one B box per micro-batch."""
    _, _, measured = traced
    b = {e.micro_batch: e for e in measured.events if e.kind == KIND_BACKWARD and e.stage == 1}
    w = {e.micro_batch: e for e in measured.events if e.kind == KIND_WEIGHT and e.stage == 1}
    assert sorted(w) == sorted(b) == list(range(M))
    for m in range(M):
        assert w[m].start_ms == b[m].end_ms < w[m].end_ms
    assert not [e for e in measured.events if e.kind == KIND_WEIGHT and e.stage == 0]
    assert measured.stages[1].backward_input_ms is not None and measured.stages[0].backward_input_ms is None


def test_interleaved_boxes_per_device_group(tmp_path):
    """Stages 0, 2 on one device and 1, 3 on another: each device's boxes in its group's merged order, the
    transfers named by the stage that sends them, one optimizer box per group; the picture has two rows."""
    stages = [(0, 0, [cpu(0)]), (1, 1, [cpu(1)]), (2, 2, [cpu(0)]), (3, 4, [cpu(1)])]
    metadata, handle = traced_step(stages, schedule="interleaved")
    measured = timeline.measured_timeline(metadata, handle)
    assert measured.device_stage == {0: 0, 1: 1}
    assert measured.device_stages(0) == (0, 2) and measured.device_stages(1) == (1, 3)
    every = collections.Counter({(s, m): 1 for s in range(4) for m in range(M)})
    assert counts(measured, KIND_FORWARD) == every
    for lane, tasks in enumerate(handle.schedule.lane_tasks):
        boxes = sorted((e for s in handle.schedule.lane_stages(lane)
                        for e in measured.stage_events(s, (KIND_FORWARD, KIND_BACKWARD))), key=lambda e: e.start_ms)
        assert [(e.stage, e.label) for e in boxes] == [(t.stage, str(t)) for t in tasks]
        assert {e.resource for e in boxes} == {f"group{lane}"}
    assert counts(measured, KIND_SEND_ACTIVATION) == {(s, m): 1 for s in range(3) for m in range(M)}
    assert counts(measured, KIND_SEND_GRADIENT) == {(s, m): 1 for s in range(1, 4) for m in range(M)}
    assert {e.resource for e in measured.events if e.kind == KIND_SEND_ACTIVATION} == {"link0>1", "link1>0"}
    assert counts(measured, KIND_OPTIMIZER) == {(0, -1): 1, (1, -1): 1}
    simulated = simulate(measured.stages, handle.schedule, micro_batch_size=measured.micro_batch_size)
    info = timeline.draw_measured_vs_simulated(measured, simulated, str(tmp_path / "interleaved.png"))
    assert info.rows == [2, 2]
    assert info.boxes[KIND_FORWARD] == 2 * 4 * M


def test_an_operation_ends_when_its_kernel_does():
    """Not at TF's all_end, stamped after the operation released its successors (a preempted thread stamped it
    4.8 ms after a successor's start); a worker's RecvTensor record has only all_end."""
    from tensorflow.core.framework import step_stats_pb2

    from dapple_tf.trace.step_stats import op_interval_ns

    preempted = step_stats_pb2.NodeExecStats(all_start_nanos=10_000, op_start_rel_nanos=200, op_end_rel_nanos=900,
                                             all_end_rel_nanos=4_800_000)
    assert op_interval_ns(preempted) == (10_000, 10_900)
    micros = step_stats_pb2.NodeExecStats(all_start_micros=10, op_end_rel_micros=3, all_end_rel_micros=4800)
    assert op_interval_ns(micros) == (10_000, 13_000)
    receive = step_stats_pb2.NodeExecStats(node_name="RecvTensor", all_start_micros=10, all_end_rel_micros=1000)
    assert op_interval_ns(receive) == (10_000, 1_010_000)

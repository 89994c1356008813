"""The measured timeline of one pipelined training step, in the simulator's terms.

`measured_timeline(run_metadata, handle)` reads a step run with RunOptions(trace_level=FULL_TRACE)
(best also output_partition_graphs=True) into a planner.simulation.simulator.SimulationResult, which the
planner's tools show like a simulated iteration: `write_measured_trace` (Chrome trace) and
`draw_measured_vs_simulated` (one PNG, measured above simulated). Times are ms from the step's first
operation on a plan device; device ids index the plan's devices in stage order. The boxes:
- F/B of (stage, micro-batch): first start to last end of the task's operations on the stage's
  FIRST device, from no earlier than the end of the task before it on that device and the arrival
  of its input from another stage (a backward's factors of forward values run during the forward
  and the wait for the gradient); a backward whose input gradients come first (tasks.input_gradients_first) is a B box
  up to the end of the operations its input gradients need (handle.input_gradient_op_names) and a W
  box (weight gradients) after it. Only the stage's
  first device counts (replica 0; replicas run the same order), and bookkeeping operations are left out
  (constants, variable reads, no-ops, identities), which run as soon as the previous task ends and
  would stretch the box over the wait for the task's input;
- transfers: a tensor sent from a device of stage a to one of stage b (the partition graphs' _Recv
  nodes, else the graph's cross-stage edges) belongs to the task that made it (tensor_name
  "edge_<id>_<source op>"), else to the one using it: an activation transfer (stage a, micro-batch
  m) from a forward task, a gradient transfer from a backward task. Between tasks of a cluster TF
  times it as one "RecvTensor" op on the receiver, from the request to the arrival: the piece runs
  from the source op's end (or the request, if later) to the arrival. In one process TF times no
  _Send/_Recv: the piece runs from the source op's end to its first consumer's start (an upper bound,
  waiting for the receiver included). A box spans from its last piece ready to its last arrival;
- AllReduce of a stage: first start to last end of its collectives (those of no task) and of the
  operations the handle lists as AllReduce (handle.allreduce_op_names) on any of its devices,
  waiting for the slowest replica included;
- optimizer step: the apply ops on the stage's first device, from the end of the stage's last task
  (apply ops of variables whose gradients are complete may run during the last backward: that part
  is drawn as backward) to the last apply op's end.
Where stages share devices (interleaved), the compute boxes of a device group are its stages' tasks, its
transfers are numbered by the tasks that make (or use) them, and its AllReduce and optimizer boxes are the
whole group's, drawn as its first stage's.
Devices of several hosts share one time scale only as far as the hosts' clocks agree.
An operation runs from its executor's start stamp to its kernel's end (step_stats.op_interval_ns), not TF's
all_end, which a preempted thread can stamp after the operation's successors started.
"""

import collections
import re
from typing import Dict, List, Optional, Sequence, Tuple

from dapple_tf.rewrite.update.replicas import canonical_device
from dapple_tf.trace.step_stats import op_interval_ns
from planner.simulation import gantt as gantt_lib, trace as trace_lib
from planner.formats.schedule import BATCHED_W, FORWARD, WEIGHT
from planner.simulation.simulator import (KIND_ALLREDUCE, KIND_BACKWARD, KIND_FORWARD, KIND_OPTIMIZER,
                                          KIND_SEND_ACTIVATION, KIND_SEND_GRADIENT, KIND_WEIGHT, Event,
                                          SimulationResult, StageCost, lane_name)

_BOOKKEEPING = frozenset({"Const", "HostConst", "VarHandleOp", "ReadVariableOp", "NoOp", "Identity", "Shape", "ShapeN",
                          "Size", "Rank"})
_LABEL_TYPE = re.compile(r"^\S+ = (\w+)\(")  # timeline_label "name = Type(inputs)"
_REMOTE_RECV = re.compile(r"(edge_\d+_\S+) from ")  # RecvTensor's timeline_label
_EDGE_SOURCE = re.compile(r"^edge_\d+_(.+)$")
_APPLY = re.compile(r"^(_Mkl)?(Resource)?(Sparse)?Apply")
_COLLECTIVE = re.compile(r"^(Collective|Nccl)|Allreduce")  # TF collectives, NCCL, Horovod
Op = Tuple[str, int, int]  # (type, start ns, end ns)


def _canonical(device: str) -> Optional[str]:
    try:
        return canonical_device(device)
    except ValueError:  # ".../stream:all", "/host:CPU 0/memcpy"
        return None


def _read_stats(step_stats, devices: Sequence[str]):
    """Per plan device {op name: (type, start, end)}, and remote receives {tensor_name: (start, end)}."""
    ops: Dict[str, Dict[str, Op]] = {d: {} for d in devices}
    remote: Dict[str, Tuple[int, int]] = {}
    for dev_stats in step_stats.dev_stats:
        device = _canonical(dev_stats.device)
        if device not in ops:
            continue
        for node in dev_stats.node_stats:
            start, end = op_interval_ns(node)
            match = _REMOTE_RECV.search(node.timeline_label) if node.node_name == "RecvTensor" else None
            if match:
                remote[match.group(1)] = (start, end)
                continue
            kind = _LABEL_TYPE.match(node.timeline_label)
            old = ops[device].get(node.node_name)
            ops[device][node.node_name] = (kind.group(1) if kind else "", min(start, old[1]) if old else start,
                                           max(end, old[2]) if old else end)
    return ops, remote


def _span(ops: Sequence[Op]) -> Optional[Tuple[int, int]]:
    return (min(o[1] for o in ops), max(o[2] for o in ops)) if ops else None


def _clipped_task_spans(handle, ops):
    """{task: (start, end)} on its stage's first device, each start clipped to the end of the task before it in its
    device group's order. Every operation of a task waits for the task before it in the built graph, but after
    grappler's rewrites a few need only forward values (factors of a GELU's derivative, measured on BERT) and run
    as soon as those are ready, inside the previous task's box."""
    spans = {}
    for stage in handle.stages:
        device = stage.devices[0]
        for task in handle.schedule.stage_tasks[stage.index]:
            names = handle.task_op_names.get((device, task, 0), ())
            found = [ops[device][n] for n in names if n in ops[device]]
            span = _span([o for o in found if o[0] not in _BOOKKEEPING] or found)
            if span:
                spans[task] = span
    for lane_tasks in handle.schedule.lane_tasks:
        previous_end = None
        for task in lane_tasks:
            if task not in spans:
                continue
            start, end = spans[task]
            if previous_end is not None:
                spans[task] = (min(max(start, previous_end), end), end)
            previous_end = end
    return spans


def _task_spans(handle, ops):
    """(kind, stage, micro-batch, span, resource) of every task on its stage's first device."""
    out = []
    spans = _clipped_task_spans(handle, ops)
    for stage in handle.stages:
        device = stage.devices[0]
        for task in handle.schedule.stage_tasks[stage.index]:
            span = spans.get(task)
            if not span:
                continue
            resource = lane_name(handle.schedule, handle.schedule.lane_of(stage.index))
            if task.kind in (FORWARD, WEIGHT):  # a W task of its own: zero-bubble schedules
                out.append((KIND_FORWARD if task.kind == FORWARD else KIND_WEIGHT, stage.index, task.micro_batch,
                            span, resource))
                continue
            # the input gradients' operations (tasks.input_gradients_first) are B; what follows them is W
            b_names = getattr(handle, "input_gradient_op_names", {}).get((device, task, 0), ())
            b_span = _span([ops[device][n] for n in b_names if n in ops[device]])
            split = b_span[1] if b_span else None
            if split is None or not span[0] < split < span[1]:
                out.append((KIND_BACKWARD, stage.index, task.micro_batch, span, resource))
                continue
            out.append((KIND_BACKWARD, stage.index, task.micro_batch, (span[0], split), resource))
            out.append((KIND_WEIGHT, stage.index, task.micro_batch, (split, span[1]), resource))
    return out


def _after_inputs(handle, task_spans, arrivals):
    """Task boxes start no earlier than their input's arrival on their device: a forward's activation from the
    stage before, a backward's (B's and W's) gradient from the stage after; what ran before it (operations on
    forward values alone) is not what the task waited for."""
    out = []
    for kind, stage, mb, (start, end), resource in task_spans:
        device = _canonical(handle.stages[stage].devices[0])
        key = ((device, KIND_SEND_ACTIVATION, stage - 1, mb) if kind == KIND_FORWARD
               else (device, KIND_SEND_GRADIENT, stage + 1, mb))
        if key in arrivals:
            start = min(max(start, arrivals[key]), end)
        out.append((kind, stage, mb, (start, end), resource))
    return out


def _stage_spans(handle, ops, task_names):
    """Per stage: its AllReduce (collectives of no task, and the handle's AllReduce ops: exchange_sum's
    plain ops across processes, on all its devices) and its apply operations (per device group where
    stages share devices)."""
    reduce_names = set(getattr(handle, "allreduce_op_names", ()))
    out = []
    for stage in handle.stages[:handle.schedule.num_lanes]:
        reduce = [o for d in stage.devices for n, o in ops[d].items()
                  if (_COLLECTIVE.search(o[0]) or (n in reduce_names and o[0] not in _BOOKKEEPING))
                  and n not in task_names]
        apply = [o for o in ops[stage.devices[0]].values() if _APPLY.match(o[0])]
        for kind, found, resource in ((KIND_ALLREDUCE, reduce, f"allreduce{stage.index}"),
                                      (KIND_OPTIMIZER, apply, lane_name(handle.schedule, stage.index))):
            if found:
                out.append((kind, stage.index, -1, _span(found), resource))
    return out


def _after_tasks(stage_spans, task_spans, schedule):
    """Optimizer boxes start no earlier than their device group's last task ends: apply ops of variables
    whose gradients are complete may run while the last backward still computes others' (drawn inside it)."""
    last_end = {}
    for _, stage, _, (_, end), _ in task_spans:
        lane = schedule.lane_of(stage)
        last_end[lane] = max(last_end.get(lane, end), end)
    out = []
    for kind, stage, mb, (start, end), resource in stage_spans:
        if kind == KIND_OPTIMIZER and stage in last_end:
            start = min(max(start, last_end[stage]), end)
        out.append((kind, stage, mb, (start, end), resource))
    return out


def _cross_device_edges(run_metadata, graph):
    """(tensor_name or None, source op, send device, recv device, consumer op names) per transfer."""
    for partition in run_metadata.partition_graphs:
        consumers = collections.defaultdict(list)
        for node in partition.node:
            for name in node.input:
                consumers[name.lstrip("^").split(":")[0]].append(node.name)
        for node in partition.node:
            if node.op in ("_Recv", "_HostRecv"):
                tensor = node.attr["tensor_name"].s.decode()
                source = _EDGE_SOURCE.match(tensor)
                yield (tensor, source.group(1) if source else "", node.attr["send_device"].s.decode(),
                       node.attr["recv_device"].s.decode(), consumers[node.name])
    if not run_metadata.partition_graphs:
        for op in graph.get_operations():
            for t in op.inputs:
                if op.device and t.op.device:  # grappler removes identities such as tf.gradients' grad_ys
                    after = [c.name for out in op.outputs for c in out.consumers()] if op.type == "Identity" else []
                    yield None, t.op.name, t.op.device, op.device, [op.name] + after


def _transfer_span(source: Optional[Op], consumers: List[Op], remote) -> Optional[Tuple[int, int]]:
    """One piece: a remote receive from max(request, source end) to its arrival, else from the source
    op's end to its first consumer's start (either one alone if the other was not traced)."""
    ready = source[2] if source else None
    if remote:
        return (remote[0] if ready is None else min(max(remote[0], ready), remote[1])), remote[1]
    used = min((c[1] for c in consumers), default=ready)
    return None if used is None else (used if ready is None else ready, max(used, ready or used))


def _transfer_spans(ops, remote, edges, lane_of_device, task_of, schedule):
    """(transfer boxes, {(receiving device, kind, sending stage, micro-batch): last arrival there})."""
    boxes: Dict[tuple, Tuple[int, int]] = {}
    arrivals: Dict[tuple, int] = {}
    for tensor, source, send, recv, consumers in edges:
        send, recv = _canonical(send), _canonical(recv)
        src, dst = lane_of_device.get(send), lane_of_device.get(recv)
        task = task_of.get(source) or next((task_of[c] for c in consumers if c in task_of), None)
        if src is None or dst is None or src == dst or task is None:
            continue
        span = _transfer_span(ops[send].get(source), [ops[recv][c] for c in consumers if c in ops[recv]],
                              remote.get(tensor))
        if span:
            sender = src  # the sending stage: its group's, or where groups hold several stages, by the task
            if schedule.lanes:
                sender = task.stage if source in task_of else task.stage + (-1 if task.kind == FORWARD else 1)
            key = (KIND_SEND_ACTIVATION if task.kind == FORWARD else KIND_SEND_GRADIENT, sender, task.micro_batch,
                   f"link{src}>{dst}")
            old = boxes.get(key, span)
            boxes[key] = (max(old[0], span[0]), max(old[1], span[1]))  # the last piece: ready, arrived
            arrival = (recv,) + key[:3]
            arrivals[arrival] = max(arrivals.get(arrival, span[1]), span[1])
    return [(kind, src, mb, span, resource) for (kind, src, mb, resource), span in boxes.items()], arrivals


def _stage_costs(handle, events: Sequence[Event], device_ids) -> Tuple[StageCost, ...]:
    """Measured per-stage costs: mean F/B and transfer (to the next stage and back) boxes, AR, optimizer."""
    def mean(kind, stage, resource=None):
        found = [e.duration_ms for e in events if e.kind == kind and e.stage == stage
                 and resource in (None, e.resource)]
        return sum(found) / len(found) if found else 0.0

    lane = handle.schedule.lane_of

    def weight(s):  # per micro-batch; dapple-batched-w's one stacked W box (and the W left in B) spread over all M
        if handle.schedule.kind != BATCHED_W:
            return mean(KIND_WEIGHT, s)
        total = sum(e.duration_ms for e in events if e.kind == KIND_WEIGHT and e.stage == s)
        return total / handle.schedule.num_micro_batches

    def backward_input(s):  # the B part where the backward is split, else None (all of it)
        return mean(KIND_BACKWARD, s) if weight(s) > 0 else None

    return tuple(StageCost(mean(KIND_FORWARD, s), mean(KIND_BACKWARD, s) + weight(s), devices=device_ids[s],
                           backward_input_ms=backward_input(s),
                           forward_transfer_ms=mean(KIND_SEND_ACTIVATION, s, f"link{lane(s)}>{lane(s + 1)}"),
                           backward_transfer_ms=mean(KIND_SEND_GRADIENT, s + 1, f"link{lane(s + 1)}>{lane(s)}"),
                           allreduce_ms=mean(KIND_ALLREDUCE, s), optimizer_ms=mean(KIND_OPTIMIZER, s))
                 for s in range(len(handle.stages)))


def measured_timeline(run_metadata, handle) -> SimulationResult:
    """The traced step of `handle` (a dapple_tf.PipelineHandle) as a SimulationResult (see the module
    docstring); `memory_timeline` is empty per stage (draw it with memory=False)."""
    schedule = handle.schedule
    devices = list(dict.fromkeys(d for stage in handle.stages for d in stage.devices))
    lane_of_device = {d: schedule.lane_of(stage.index) for stage in handle.stages for d in stage.devices}
    task_of = {name: task for (_, task, _), names in handle.task_op_names.items() for name in names}
    ops, remote = _read_stats(run_metadata.step_stats, devices)
    times = [t for per_device in ops.values() for o in per_device.values() for t in o[1:]]
    times += [t for span in remote.values() for t in span]
    if not times:
        raise ValueError("the run metadata holds no step stats of the plan's devices: run the step with "
                         "RunOptions(trace_level=FULL_TRACE)")
    origin = min(times)
    edges = _cross_device_edges(run_metadata, handle.train_op.graph)
    transfers, arrivals = _transfer_spans(ops, remote, edges, lane_of_device, task_of, schedule)
    tasks = _after_inputs(handle, _task_spans(handle, ops), arrivals)
    spans = tasks + _after_tasks(_stage_spans(handle, ops, set(task_of)), tasks, schedule) + transfers
    events = sorted((Event(kind, s, mb, (a - origin) / 1e6, (b - origin) / 1e6, resource)
                     for kind, s, mb, (a, b), resource in spans),
                    key=lambda e: (e.start_ms, e.stage, e.kind, e.micro_batch))
    device_ids = [tuple(i for i, d in enumerate(devices) if lane_of_device[d] == schedule.lane_of(s))
                  for s in range(len(handle.stages))]
    return SimulationResult(
        schedule=handle.schedule,
        stages=_stage_costs(handle, events, device_ids),
        events=tuple(events),
        iteration_ms=(max(times) - origin) / 1e6,
        micro_batch_size=handle.micro_batch_size,
        device_stage={i: lane_of_device[d] for i, d in enumerate(devices)},
        memory_timeline=tuple(() for _ in range(schedule.num_lanes)),
    )


def write_measured_trace(result: SimulationResult, path: str) -> int:
    """A measured timeline as a Chrome trace (planner/simulation/trace.py's format; zero-length transfers left
    out); returns the number of boxes written."""
    return trace_lib.write_trace(result, path)


def _title(source: str, r: SimulationResult) -> str:
    s = r.schedule
    return f"{source}: {s.kind}, S={s.num_stages}, M={s.num_micro_batches}; iteration {r.iteration_ms:.2f} ms"


def draw_measured_vs_simulated(measured: SimulationResult, simulated: SimulationResult, path: str,
                               titles: Optional[Sequence[str]] = None) -> gantt_lib.GanttInfo:
    """One PNG: the measured timeline above the simulated one, on one time scale (no memory plots)."""
    titles = list(titles) if titles is not None else [_title("measured", measured), _title("simulated", simulated)]
    return gantt_lib.draw_gantt([measured, simulated], path, titles=titles, memory=False)

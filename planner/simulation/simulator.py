"""Discrete-event simulation of one training iteration of a pipeline under a `Schedule`.

The simulator takes explicit per-stage costs (`StageCost`, usually built from a plan by
planner/simulation/sim_adapter.py with the planner's cost model) and a `Schedule`, and plays one iteration:

- every stage is one compute lane; all replicas of a stage run the same order in lockstep, so a
  stage's devices share its timeline (costs are those of the largest replica slice); where stages
  share devices (the interleaved schedule's device groups), a group is one lane that runs the merged
  order of its stages' tasks, and its memory is the sum of its stages';
- the boundary between stage s and s+1 is a link: an activation transfer (split/concat between
  the two device sets) follows F(s, m) and precedes F(s+1, m); a gradient transfer follows
  B(s+1, m) and precedes B(s, m). Transfers on one link run one at a time, first ready first
  served; with `duplex_links` (default) the two directions are separate links;
- after its last backward a stage AllReduces its gradients (`allreduce_ms`), then runs its
  optimizer step on the compute lane. With `overlap_allreduce` gradients are reduced layer by
  layer while the last backward runs: only `allreduce_tail_ms` (default: what is left of the
  AllReduce after the last backward if gradients appear at an even rate,
  max(0, allreduce_ms - backward_ms)) remains after the last backward;
- memory per device = `static_bytes` (parameters, gradients, optimizer state) plus
  `activation_bytes` for every micro-batch in flight on its stage: allocated when F(s, m)
  starts, freed when B(s, m) ends;
- a stage with `backward_input_ms` (the runtime's B/W split on every stage but the first) runs
  B(s, m) for that long, sends its input gradients, then W(s, m), the weight gradients, for the
  rest of its backward; its activations are freed at the end of W(s, m);
- a schedule with W tasks (zero bubble) runs B(s, m) and W(s, m) where the schedule puts them: B
  lasts `backward_input_ms` (when not given: 0 on the first stage, whose inputs need no gradient,
  half the backward elsewhere), W the rest; activations are freed at the end of W(s, m);
- a stage with `recompute` (GPipe's re-computation) runs R(s, m), its forward again, on its lane
  right before B(s, m), in the backward's slot (it needs no gradient, only the lane); it keeps
  only `boundary_bytes` per micro-batch in flight, and one micro-batch's full activations while
  a forward runs and from R(s, m) to the end of B(s, m).

    >>> from planner.formats.schedule import build_schedule
    >>> r = simulate([StageCost(1.0, 2.0)] * 2, build_schedule(2, 4, "dapple"))
    >>> r.iteration_ms
    15.0
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Dict, List, Optional, Sequence, Tuple

from planner.formats.schedule import BACKWARD, FORWARD, Schedule

# Event kinds, in drawing order.
KIND_FORWARD = "forward"
KIND_BACKWARD = "backward"
KIND_WEIGHT = "weight_gradient"
KIND_RECOMPUTE = "recompute"
KIND_SEND_ACTIVATION = "send_activation"
KIND_SEND_GRADIENT = "send_gradient"
KIND_ALLREDUCE = "allreduce"
KIND_OPTIMIZER = "optimizer"
COMPUTE_KINDS = (KIND_FORWARD, KIND_RECOMPUTE, KIND_BACKWARD, KIND_WEIGHT, KIND_OPTIMIZER)
COMM_KINDS = (KIND_SEND_ACTIVATION, KIND_SEND_GRADIENT)
_LABEL = {
    KIND_FORWARD: "F",
    KIND_BACKWARD: "B",
    KIND_WEIGHT: "W",
    KIND_RECOMPUTE: "R",
    KIND_SEND_ACTIVATION: "A",
    KIND_SEND_GRADIENT: "G",
}


class SimulationError(ValueError):
    """Inconsistent stage costs and schedule, or an iteration that cannot finish."""


@dataclasses.dataclass(frozen=True)
class StageCost:
    """What one stage costs, per micro-batch and per device of the stage.

    `forward_transfer_ms` / `backward_transfer_ms` describe the boundary to the NEXT stage
    (activations sent forward, gradients sent back; ignored on the last stage);
    `backward_transfer_ms=None` means the same as forward. `devices=None` lets `simulate`
    number devices consecutively.
    """

    forward_ms: float
    backward_ms: float
    devices: Optional[Tuple[int, ...]] = None
    forward_transfer_ms: float = 0.0
    backward_transfer_ms: Optional[float] = None
    allreduce_ms: float = 0.0
    allreduce_tail_ms: Optional[float] = None
    optimizer_ms: float = 0.0
    static_bytes: float = 0.0
    activation_bytes: float = 0.0
    recompute: bool = False  # re-computation: R(s, m) before B(s, m), only boundary inputs kept
    boundary_bytes: float = 0.0  # with recompute: what a micro-batch in flight keeps (its inputs)
    # B/W split: the input gradients are sent after this much of the backward; the rest (weight gradients)
    # runs as W(s, m) right after. None: the whole backward precedes the gradient transfer.
    backward_input_ms: Optional[float] = None

    @property
    def splits_backward(self) -> bool:
        return self.backward_input_ms is not None and 0.0 <= self.backward_input_ms < self.backward_ms

    def input_gradient_ms(self, stage: int) -> float:
        """B's share of the backward in a schedule with W tasks (see the module docstring)."""
        if self.backward_input_ms is not None:
            return min(self.backward_input_ms, self.backward_ms)
        return 0.0 if stage == 0 else self.backward_ms / 2

    @property
    def overlapped_allreduce_tail_ms(self) -> float:
        if self.allreduce_tail_ms is not None:
            return self.allreduce_tail_ms
        return max(0.0, self.allreduce_ms - self.backward_ms)

    @property
    def gradient_transfer_ms(self) -> float:
        return self.forward_transfer_ms if self.backward_transfer_ms is None else self.backward_transfer_ms


@dataclasses.dataclass(frozen=True)
class Event:
    """One box of the timeline: a task on a compute lane or a link."""

    kind: str
    stage: int  # compute/allreduce: the stage; transfers: the sending stage
    micro_batch: int  # -1 for allreduce and optimizer
    start_ms: float
    end_ms: float
    resource: str  # "stage1" ("group1" where stages share devices), "link1>2", "link2>1", "link1-2" (shared),
    # "allreduce1"; links and AllReduce numbered by device group

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms

    @property
    def label(self) -> str:
        if self.kind == KIND_ALLREDUCE:
            return "AR"
        if self.kind == KIND_OPTIMIZER:
            return "opt"
        return f"{_LABEL[self.kind]}{self.micro_batch}"


@dataclasses.dataclass
class SimulationResult:
    """Timeline and summary numbers of one simulated iteration (times in ms, memory in bytes)."""

    schedule: Schedule
    stages: Tuple[StageCost, ...]
    events: Tuple[Event, ...]
    iteration_ms: float
    micro_batch_size: int
    device_stage: Dict[int, int]  # device id -> its (first) stage; every stage of its group: device_stages
    memory_timeline: Tuple[Tuple[Tuple[float, float], ...], ...]  # per device group (stage): (time, bytes) steps
    device_memory_bytes: Optional[float] = None

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def devices(self) -> Tuple[int, ...]:
        return tuple(sorted(self.device_stage))

    @property
    def global_batch_size(self) -> int:
        return self.schedule.num_micro_batches * self.micro_batch_size

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.global_batch_size / (self.iteration_ms / 1000.0) if self.iteration_ms > 0 else 0.0

    def stage_events(self, stage: int, kinds: Sequence[str] = COMPUTE_KINDS) -> List[Event]:
        return [e for e in self.events if e.stage == stage and e.kind in kinds]

    def device_stages(self, device: int) -> Tuple[int, ...]:
        """The stages `device` runs: one, or its device group's (interleaved)."""
        return self.schedule.lane_stages(self.schedule.lane_of(self.device_stage[device]))

    def stage_devices(self, stage: int) -> List[int]:
        lane = self.schedule.lane_of(stage)
        return [d for d, s in sorted(self.device_stage.items()) if self.schedule.lane_of(s) == lane]

    def busy_ms(self, stage: int) -> float:
        """Compute time (forward, backward, optimizer) of each device of `stage` (for all its group's stages)."""
        stages = self.schedule.lane_stages(self.schedule.lane_of(stage))
        return sum(e.duration_ms for s in stages for e in self.stage_events(s))

    def stage_bubble_fraction(self, stage: int) -> float:
        """Share of the iteration a device of `stage` does not compute."""
        if self.iteration_ms <= 0:
            return 0.0
        return 1.0 - self.busy_ms(stage) / self.iteration_ms

    @property
    def bubble_fraction(self) -> Dict[int, float]:
        """Per device id: idle (bubble, waiting on transfers or AllReduce) share of the iteration."""
        return {d: self.stage_bubble_fraction(s) for d, s in sorted(self.device_stage.items())}

    def stage_peak_memory(self, stage: int) -> float:
        """Peak memory of a device of `stage` (with its group's other stages)."""
        return max((b for _, b in self.memory_timeline[self.schedule.lane_of(stage)]), default=0.0)

    @property
    def peak_memory_bytes(self) -> Dict[int, float]:
        """Per device id: parameters + optimizer state + peak live activations."""
        return {d: self.stage_peak_memory(s) for d, s in sorted(self.device_stage.items())}

    def peak_in_flight(self, stage: int) -> int:
        """Most micro-batches whose activations were alive at once on `stage`, over time."""
        changes = []
        release = KIND_WEIGHT if self.stages[stage].splits_backward or self.schedule.splits_backward else KIND_BACKWARD
        for e in self.stage_events(stage, (KIND_FORWARD, release)):
            if e.kind == KIND_FORWARD:
                changes.append((e.start_ms, 1, 1))
            else:
                changes.append((e.end_ms, 0, -1))  # frees before a forward starting at the same time
        count = peak = 0
        for _, _, delta in sorted(changes):
            count += delta
            peak = max(peak, count)
        return peak

    @property
    def out_of_memory(self) -> bool:
        cap = self.device_memory_bytes
        return bool(cap) and any(p > cap for p in self.peak_memory_bytes.values())

    def summary(self) -> str:
        """A readable multi-line report."""
        s = self.schedule
        lines = [
            f"{s.kind} schedule, S={s.num_stages}, M={s.num_micro_batches}, K={list(s.warmup)}, "
            f"micro-batch size {self.micro_batch_size}",
            f"iteration: {self.iteration_ms:.2f} ms, throughput: {self.throughput:.2f} samples/s",
            "stage  devices  fwd_ms  bwd_ms  allreduce_ms  bubble  peak_in_flight  peak_memory_GiB",
        ]
        for i, st in enumerate(self.stages):
            devs = self.stage_devices(i)
            dev_text = f"{devs[0]}" if len(devs) == 1 else f"{devs[0]}-{devs[-1]}"
            lines.append(
                f"{i:5d}  {dev_text:>7}  {st.forward_ms:6.2f}  {st.backward_ms:6.2f}  {st.allreduce_ms:12.2f}  "
                f"{self.stage_bubble_fraction(i):6.1%}  {self.peak_in_flight(i):14d}  "
                f"{self.stage_peak_memory(i) / 2**30:15.2f}"
            )
        if self.device_memory_bytes:
            lines.append(
                f"device memory {self.device_memory_bytes / 2**30:.2f} GiB: "
                + ("OUT OF MEMORY" if self.out_of_memory else "fits")
            )
        return "\n".join(lines)


@dataclasses.dataclass
class _Op:
    kind: str
    stage: int
    micro_batch: int
    resource: str
    duration: float
    waiting: int = 0  # unfinished dependencies
    dependents: List[int] = dataclasses.field(default_factory=list)
    ready_ms: float = 0.0
    start_ms: Optional[float] = None
    end_ms: Optional[float] = None


def _assign_devices(stages: Sequence[StageCost], schedule: Schedule) -> Dict[int, int]:
    """Device id -> stage (the first of its device group); stages of one group share their devices."""
    device_stage: Dict[int, int] = {}
    group_devices: Dict[int, Tuple[int, ...]] = {}
    next_id = 0
    for s, st in enumerate(stages):
        lane = schedule.lane_of(s)
        devices = st.devices if st.devices is not None else group_devices.get(lane, (next_id,))
        if not devices:
            raise SimulationError(f"stage {s} has no devices")
        if lane in group_devices:
            if tuple(devices) != group_devices[lane]:
                raise SimulationError(f"stage {s} runs on devices {list(devices)} but its device group {lane} (stage "
                                      f"{lane}) on {list(group_devices[lane])}")
            continue
        group_devices[lane] = tuple(devices)
        for d in devices:
            if d in device_stage:
                raise SimulationError(f"device {d} is used by stages {device_stage[d]} and {s}")
            device_stage[d] = s
        next_id = max(device_stage) + 1
    return device_stage


def _check_costs(stages: Sequence[StageCost]) -> None:
    for s, st in enumerate(stages):
        for name in ("forward_ms", "backward_ms", "forward_transfer_ms", "allreduce_ms",
                     "overlapped_allreduce_tail_ms", "optimizer_ms",
                     "static_bytes", "activation_bytes", "boundary_bytes"):
            if getattr(st, name) < 0:
                raise SimulationError(f"stage {s}: {name} must be >= 0, got {getattr(st, name)}")
        if st.gradient_transfer_ms < 0:
            raise SimulationError(f"stage {s}: backward_transfer_ms must be >= 0, got {st.gradient_transfer_ms}")


class _OpGraph:
    """The ops of one iteration and their dependencies: every stage's compute lane in its
    schedule's order, the transfers on the links between stages, and each stage's AllReduce and
    optimizer step."""

    def __init__(self):
        self.ops: List[_Op] = []
        self.index: Dict[Tuple[str, int, int], int] = {}
        self.lanes: List[List[int]] = []  # per device group (stage)
        self.lane_names: List[str] = []
        self.last_task: Dict[int, int] = {}  # stage -> its last lane op before the optimizer

    def add(self, kind, stage, mb, resource, duration) -> int:
        self.index[(kind, stage, mb)] = len(self.ops)
        self.ops.append(_Op(kind, stage, mb, resource, float(duration)))
        return len(self.ops) - 1

    def depend(self, op, on) -> None:
        self.ops[on].dependents.append(op)
        self.ops[op].waiting += 1

    def add_lanes(self, stages: Sequence[StageCost], schedule: Schedule) -> None:
        split_schedule = schedule.splits_backward
        for g, tasks in enumerate(schedule.lane_tasks):
            lane = []
            for task in tasks:
                lane.extend(self._task_ops(task.stage, stages[task.stage], task, split_schedule, lane_name(schedule, g)))
                self.last_task[task.stage] = lane[-1]
            self.lanes.append(lane)
            self.lane_names.append(lane_name(schedule, g))

    def _task_ops(self, s: int, st: StageCost, task, split_schedule: bool, lane_name: str) -> List[int]:
        """The lane ops of one scheduled task: a backward may be preceded by its recomputation
        and split into B and W (module docstring)."""
        add, mb = self.add, task.micro_batch
        kind = {FORWARD: KIND_FORWARD, BACKWARD: KIND_BACKWARD}.get(task.kind, KIND_WEIGHT)
        out = []
        if kind == KIND_BACKWARD and st.recompute:
            out.append(add(KIND_RECOMPUTE, s, mb, lane_name, st.forward_ms))
        if split_schedule and kind != KIND_FORWARD:
            b_ms = st.input_gradient_ms(s)
            out.append(add(kind, s, mb, lane_name, b_ms if kind == KIND_BACKWARD else st.backward_ms - b_ms))
        elif kind == KIND_BACKWARD and st.splits_backward:
            out.append(add(kind, s, mb, lane_name, st.backward_input_ms))
            out.append(add(KIND_WEIGHT, s, mb, lane_name, st.backward_ms - st.backward_input_ms))
        else:
            out.append(add(kind, s, mb, lane_name, st.forward_ms if task.kind == FORWARD else st.backward_ms))
        return out

    def add_transfers(self, stages: Sequence[StageCost], schedule: Schedule, duplex_links: bool) -> None:
        index, depend = self.index, self.depend
        for s in range(len(stages) - 1):
            st = stages[s]
            a, b = schedule.lane_of(s), schedule.lane_of(s + 1)
            fwd_link = f"link{a}>{b}" if duplex_links else f"link{min(a, b)}-{max(a, b)}"
            bwd_link = f"link{b}>{a}" if duplex_links else f"link{min(a, b)}-{max(a, b)}"
            for i in range(schedule.num_micro_batches):
                a = self.add(KIND_SEND_ACTIVATION, s, i, fwd_link, st.forward_transfer_ms)
                depend(a, index[(KIND_FORWARD, s, i)])
                depend(index[(KIND_FORWARD, s + 1, i)], a)
                g = self.add(KIND_SEND_GRADIENT, s + 1, i, bwd_link, st.gradient_transfer_ms)
                depend(g, index[(KIND_BACKWARD, s + 1, i)])
                depend(index[(KIND_BACKWARD, s, i)], g)

    def add_updates(self, stages: Sequence[StageCost], schedule: Schedule, overlap_allreduce: bool) -> None:
        """Each stage's AllReduce after its last backward, then its optimizer step on its lane (a device group
        updates its stages in the order their backwards end)."""
        for s in sorted(range(len(stages)), key=lambda s: self.last_task[s]):
            st, lane = stages[s], schedule.lane_of(s)
            tail = min(st.overlapped_allreduce_tail_ms, st.allreduce_ms) if overlap_allreduce else st.allreduce_ms
            ar = self.add(KIND_ALLREDUCE, s, -1, f"allreduce{lane}", tail)
            self.depend(ar, self.last_task[s])
            opt = self.add(KIND_OPTIMIZER, s, -1, lane_name(schedule, lane), st.optimizer_ms)
            self.depend(opt, ar)
            self.lanes[lane].append(opt)


def lane_name(schedule: Schedule, lane: int) -> str:
    """The compute resource of device group `lane`: "stage<i>", or "group<i>" where stages share devices."""
    return f"group{lane}" if schedule.lanes else f"stage{lane}"


class _Player:
    """Plays an _OpGraph, filling in the ops' start and end times: compute lanes run their fixed
    order; every other resource serves ready ops first come first."""

    def __init__(self, graph: _OpGraph):
        self.ops = graph.ops
        self.index = graph.index
        self.lane_of = dict(zip(graph.lane_names, graph.lanes))
        self.position = {name: 0 for name in self.lane_of}
        self.busy_until: Dict[str, float] = {}
        self.ready_queues: Dict[str, List[Tuple[float, int]]] = {}
        self.heap: List[Tuple[float, int, int]] = []  # (end time, seq, op)
        self.seq = 0

    def start(self, op_id, now) -> None:
        op = self.ops[op_id]
        op.start_ms, op.end_ms = now, now + op.duration
        self.busy_until[op.resource] = op.end_ms
        heapq.heappush(self.heap, (op.end_ms, self.seq, op_id))
        self.seq += 1

    def release(self, op_id, now) -> None:
        op = self.ops[op_id]
        op.waiting -= 1
        if op.waiting == 0:
            op.ready_ms = now
            if op.resource not in self.lane_of:
                heapq.heappush(self.ready_queues.setdefault(op.resource, []), (now, op_id))

    def try_start(self, now) -> None:
        ops, busy_until, position = self.ops, self.busy_until, self.position
        progressed = True
        while progressed:
            progressed = False
            for name, lane in self.lane_of.items():
                p = position[name]
                if p < len(lane) and busy_until.get(name, 0.0) <= now and ops[lane[p]].waiting == 0:
                    position[name] = p + 1
                    self.start(lane[p], now)
                    progressed = True
            for name, queue in self.ready_queues.items():
                if queue and busy_until.get(name, 0.0) <= now:
                    _, op_id = heapq.heappop(queue)
                    self.start(op_id, now)
                    progressed = True

    def play(self) -> None:
        """Runs every op; SimulationError if some never can."""
        for op in self.ops:
            if op.waiting == 0 and op.resource not in self.lane_of:
                heapq.heappush(self.ready_queues.setdefault(op.resource, []),
                               (0.0, self.index[(op.kind, op.stage, op.micro_batch)]))
        self.try_start(0.0)
        heap, done = self.heap, 0
        while heap:
            now = heap[0][0]
            while heap and heap[0][0] == now:
                _, _, op_id = heapq.heappop(heap)
                done += 1
                for d in self.ops[op_id].dependents:
                    self.release(d, now)
            self.try_start(now)
        if done != len(self.ops):
            stuck = [f"{o.kind} stage {o.stage} mb {o.micro_batch}" for o in self.ops if o.start_ms is None][:4]
            raise SimulationError("simulation cannot finish; stuck at " + ", ".join(stuck))


def _events(graph: _OpGraph, stages: Sequence[StageCost], overlap_allreduce: bool) -> Tuple[Event, ...]:
    """The played ops as events in drawing order."""
    ops = graph.ops
    if overlap_allreduce:  # draw the whole AllReduce: it began during the last backward
        for o in ops:
            if o.kind == KIND_ALLREDUCE:
                last_backward = ops[graph.last_task[o.stage]]
                o.start_ms = max(last_backward.start_ms, o.end_ms - stages[o.stage].allreduce_ms)
    return tuple(
        sorted(
            (Event(o.kind, o.stage, o.micro_batch, o.start_ms, o.end_ms, o.resource) for o in ops),
            key=lambda e: (e.start_ms, e.stage, e.kind, e.micro_batch),
        )
    )


def simulate(
    stages: Sequence[StageCost],
    schedule: Schedule,
    *,
    micro_batch_size: int = 1,
    overlap_allreduce: bool = False,
    duplex_links: bool = True,
    device_memory_bytes: Optional[float] = None,
) -> SimulationResult:
    """Plays one iteration of `schedule` with `stages` costs; see the module docstring."""
    stages = tuple(stages)
    num_stages = len(stages)
    if num_stages != schedule.num_stages:
        raise SimulationError(f"got costs for {num_stages} stages but the schedule has {schedule.num_stages}")
    _check_costs(stages)
    schedule.validate()
    device_stage = _assign_devices(stages, schedule)
    graph = _OpGraph()
    graph.add_lanes(stages, schedule)
    graph.add_transfers(stages, schedule, duplex_links)
    graph.add_updates(stages, schedule, overlap_allreduce)
    _Player(graph).play()
    events = _events(graph, stages, overlap_allreduce)
    timelines = tuple(_memory_timeline(stages, schedule.lane_stages(g), events, schedule.splits_backward)
                      for g in range(schedule.num_lanes))
    return SimulationResult(
        schedule=schedule,
        stages=stages,
        events=events,
        iteration_ms=max((e.end_ms for e in events), default=0.0),
        micro_batch_size=micro_batch_size,
        device_stage=device_stage,
        memory_timeline=timelines,
        device_memory_bytes=device_memory_bytes,
    )


def _memory_timeline(stages: Sequence[StageCost], lane_stages: Sequence[int], events: Sequence[Event],
                     split_schedule: bool = False) -> Tuple[Tuple[float, float], ...]:
    """(time, bytes) steps of a device running `lane_stages`."""
    changes = []
    for e in events:
        if e.stage not in lane_stages:
            continue
        st = stages[e.stage]
        kept = st.boundary_bytes if st.recompute else st.activation_bytes  # per micro-batch in flight
        if e.kind == KIND_FORWARD:
            changes.append((e.start_ms, 1, st.activation_bytes))
            if st.recompute:  # only the boundary inputs outlive the forward
                changes.append((e.end_ms, 0, kept - st.activation_bytes))
        elif e.kind == KIND_RECOMPUTE:
            changes.append((e.start_ms, 1, st.activation_bytes - kept))
        elif e.kind == (KIND_WEIGHT if st.splits_backward or split_schedule else KIND_BACKWARD):
            changes.append((e.end_ms, 0, -st.activation_bytes))
    current = sum(stages[s].static_bytes for s in lane_stages)
    points = [(0.0, current)]
    for t, _, delta in sorted(changes):
        current += delta
        if points[-1][0] == t:
            points[-1] = (t, current)
        else:
            points.append((t, current))
    return tuple(points)

"""Pipeline schedules as plain data: the ordered forward/backward tasks of every stage.

One `Schedule` object is shared by the simulator (planner/simulation/simulator.py) and by the graph
runtime (dapple_tf), which turns each stage's order into control edges, so what is simulated
is what is built.

    >>> print(build_schedule(2, 4, "dapple"))
    dapple schedule, S=2 stages, M=4 micro-batches, K=[2, 1]
    stage 0: F0 F1 B0 F2 B1 F3 B2 B3
    stage 1: F0 B0 F1 B1 F2 B2 F3 B3

Kinds:
- "gpipe": every stage runs all M forwards, then all M backwards (GPipe).
- "zb-h1", "zb-h2": zero bubble (planner/formats/zero_bubble.py): each backward split into B (the input
  gradients the previous stage waits for) and W (the weight gradients), W placed to fill bubbles.

    >>> print(build_schedule(2, 4, "zb-h1"))
    zb-h1 schedule, S=2 stages, M=4 micro-batches, K=[2, 1]
    stage 0: F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3
    stage 1: F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3

- "interleaved": 1F1B with virtual stages (planner/formats/interleaved.py): P device groups each run v
  non-adjacent stages, stage s on group s % P, in one merged order per group (`lane_tasks`).

    >>> print(build_schedule(4, 2, "interleaved", num_lanes=2))
    interleaved schedule, S=4 stages on 2 device groups, M=2 micro-batches, K=[4, 3]
    group 0: F0.s0 F1.s0 F0.s2 F1.s2 B0.s2 B1.s2 B0.s0 B1.s0
    group 1: F0.s1 F1.s1 F0.s3 B0.s3 F1.s3 B1.s3 B0.s1 B1.s1

- "dapple": early backward (DAPPLE paper section 5.3): stage i first injects K_i forwards,
  then strictly alternates one backward and one forward, then drains the backwards.
  K_i comes from policy "A" (K_i = min(S - i, D)), policy "B" (K_i = min(2(S - i) - 1, D)),
  or is given explicitly. D caps the in-flight micro-batches (memory); it defaults to M.
- "dapple-batched-w": DAPPLE's order of F and B (input gradients), every W at the end of its stage.
  The runtime computes the weight gradients of all micro-batches together where it can (one matrix
  product over the micro-batches' rows instead of M thin ones and a running sum; the others stay in B:
  dapple_tf/rewrite/stages/weight_batching.py); a stage's W runs while earlier stages drain their backwards.
  Activations and output gradients stay alive until the W: GPipe's activation memory and more (D caps
  only the warm-up forwards).

    >>> print(build_schedule(2, 3, "dapple-batched-w"))
    dapple-batched-w schedule, S=2 stages, M=3 micro-batches, K=[2, 1]
    stage 0: F0 F1 B0 F2 B1 B2 W0 W1 W2
    stage 1: F0 B0 F1 B1 F2 B2 W0 W1 W2

Dependencies: F(s, m) needs F(s-1, m); B(s, m) needs F(s, m) and B(s+1, m); W(s, m) needs B(s, m).
In a schedule without W tasks a B is the whole backward. Every replica of a stage runs its stage's order;
where stages share devices (interleaved), the devices run their group's merged order.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence, Tuple

from planner.formats import interleaved, zero_bubble

FORWARD = "F"
BACKWARD = "B"
WEIGHT = "W"
INTERLEAVED = "interleaved"
BATCHED_W = "dapple-batched-w"
SCHEDULE_KINDS = ("dapple", "gpipe") + zero_bubble.KINDS + (INTERLEAVED, BATCHED_W)
DAPPLE_WARMUP_KINDS = ("dapple", BATCHED_W, "zb-h1")  # the kinds that take DAPPLE's K_i (policy or explicit)
POLICIES = ("A", "B")


_PROTO_NAMES = {"dapple": "DAPPLE", "gpipe": "GPIPE", "zb-h1": "ZB_H1", "zb-h2": "ZB_H2", INTERLEAVED: "INTERLEAVED",
                BATCHED_W: "DAPPLE_BATCHED_W"}


def schedule_enum(kind: str) -> int:
    """The plan file's Schedule value (planner/formats/plan.proto) of a schedule kind."""
    from planner.formats import plan_pb2

    return plan_pb2.Schedule.Value(_PROTO_NAMES[kind])


def schedule_kind(value: int) -> Optional[str]:
    """The schedule kind of a plan file's Schedule value; None for SCHEDULE_UNSPECIFIED."""
    from planner.formats import plan_pb2

    name = plan_pb2.Schedule.Name(value)
    return next((kind for kind, proto_name in _PROTO_NAMES.items() if proto_name == name), None)


class ScheduleError(ValueError):
    """An invalid schedule request or an order that cannot run."""


@dataclasses.dataclass(frozen=True, order=True)
class Task:
    """One forward, backward (or its input-gradient part) or weight-gradient pass of one micro-batch
    on one stage."""

    stage: int
    kind: str  # FORWARD, BACKWARD or WEIGHT
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"

    @property
    def label(self) -> str:
        """The task with its stage, as a device group's order prints it: "F3.s2"."""
        return f"{self}.s{self.stage}"

    def dependencies(self, num_stages: int) -> Tuple["Task", ...]:
        """The tasks of other stages, and this stage's own forward, that must finish first."""
        if self.kind == FORWARD:
            return (Task(self.stage - 1, FORWARD, self.micro_batch),) if self.stage > 0 else ()
        if self.kind == WEIGHT:
            return (Task(self.stage, BACKWARD, self.micro_batch),)
        deps = [Task(self.stage, FORWARD, self.micro_batch)]
        if self.stage + 1 < num_stages:
            deps.append(Task(self.stage + 1, BACKWARD, self.micro_batch))
        return tuple(deps)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per stage, the order in which its forward and backward tasks run; where stages share devices
    (interleaved), per device group the merged order of its stages' tasks."""

    kind: str
    num_micro_batches: int
    warmup: Tuple[int, ...]  # K_i per stage (for gpipe: M; interleaved: per device group)
    stage_tasks: Tuple[Tuple[Task, ...], ...]
    lanes: Tuple[Tuple[Task, ...], ...] = ()  # per device group; () when every stage has devices of its own

    @property
    def num_stages(self) -> int:
        return len(self.stage_tasks)

    @property
    def num_lanes(self) -> int:
        """Device groups: stages on distinct devices (P; S unless stages share devices)."""
        return len(self.lanes) or self.num_stages

    @property
    def lane_tasks(self) -> Tuple[Tuple[Task, ...], ...]:
        """Per device group, the order its devices run."""
        return self.lanes or self.stage_tasks

    def lane_of(self, stage: int) -> int:
        """The device group that runs `stage`."""
        return stage % self.num_lanes

    def lane_stages(self, lane: int) -> Tuple[int, ...]:
        return tuple(range(lane, self.num_stages, self.num_lanes))

    @functools.cached_property
    def splits_backward(self) -> bool:
        """True when backwards are B (input gradients) and W (weight gradients) tasks of their own."""
        return any(task.kind == WEIGHT for tasks in self.stage_tasks for task in tasks)

    def __str__(self) -> str:
        groups = f" on {self.num_lanes} device groups" if self.lanes else ""
        lines = [
            f"{self.kind} schedule, S={self.num_stages} stages{groups}, "
            f"M={self.num_micro_batches} micro-batches, K={list(self.warmup)}"
        ]
        for g, tasks in enumerate(self.lanes):
            lines.append(f"group {g}: " + " ".join(t.label for t in tasks))
        if not self.lanes:
            for s, tasks in enumerate(self.stage_tasks):
                lines.append(f"stage {s}: " + " ".join(str(t) for t in tasks))
        return "\n".join(lines)

    def in_flight(self, stage: int) -> Tuple[int, ...]:
        """Micro-batches whose activations are alive on `stage` after each of its tasks (until the
        backward, or until W where backwards are split)."""
        release = WEIGHT if self.splits_backward else BACKWARD
        count, counts = 0, []
        for task in self.stage_tasks[stage]:
            count += {FORWARD: 1, release: -1}.get(task.kind, 0)
            counts.append(count)
        return tuple(counts)

    def peak_in_flight(self, stage: int) -> int:
        return max(self.in_flight(stage), default=0)

    def lane_peak_in_flight(self, lane: int) -> int:
        """Most (stage, micro-batch) activations alive at once on a device of group `lane`."""
        release = WEIGHT if self.splits_backward else BACKWARD
        count = peak = 0
        for task in self.lane_tasks[lane]:
            count += {FORWARD: 1, release: -1}.get(task.kind, 0)
            peak = max(peak, count)
        return peak

    def execution_order(self) -> Tuple[Task, ...]:
        """A global order consistent with every device group's order and all dependencies.

        Raises ScheduleError naming the blocked tasks if the orders deadlock.
        """
        num_stages, lanes = self.num_stages, self.lane_tasks
        position = [0] * len(lanes)
        done = set()
        order = []
        total = sum(len(t) for t in lanes)
        while len(order) < total:
            progressed = False
            for g, tasks in enumerate(lanes):
                if position[g] == len(tasks):
                    continue
                task = tasks[position[g]]
                if all(dep in done for dep in task.dependencies(num_stages)):
                    done.add(task)
                    order.append(task)
                    position[g] += 1
                    progressed = True
            if not progressed:
                where = "group" if self.lanes else "stage"
                blocked = [
                    f"{where} {g} waits at {tasks[position[g]].label if self.lanes else tasks[position[g]]}"
                    for g, tasks in enumerate(lanes)
                    if position[g] < len(tasks)
                ]
                raise ScheduleError("schedule deadlocks: " + "; ".join(blocked))
        return tuple(order)

    def validate(self) -> None:
        """Checks every stage runs each F and B (and W, where backwards are split) exactly once, F before
        B before W, and no deadlock."""
        m = self.num_micro_batches
        kinds = (FORWARD, BACKWARD, WEIGHT) if self.splits_backward else (FORWARD, BACKWARD)
        for s, tasks in enumerate(self.stage_tasks):
            expected = {Task(s, k, i) for k in kinds for i in range(m)}
            if len(tasks) != len(expected) or set(tasks) != expected:
                names = " and ".join(f"{k}0..{k}{m - 1}" for k in kinds)
                raise ScheduleError(f"stage {s} must run {names} exactly once, got " + " ".join(str(t) for t in tasks))
            seen = set()
            for task in tasks:
                before = {BACKWARD: FORWARD, WEIGHT: BACKWARD}.get(task.kind)
                if before and (before, task.micro_batch) not in seen:
                    raise ScheduleError(f"stage {s}: {task} runs before {before}{task.micro_batch}")
                seen.add((task.kind, task.micro_batch))
        for g, tasks in enumerate(self.lanes):
            stages = self.lane_stages(g)
            for s in stages:
                if tuple(t for t in tasks if t.stage == s) != self.stage_tasks[s]:
                    raise ScheduleError(f"group {g}'s order does not run stage {s}'s tasks in the stage's order")
            if any(t.stage not in stages for t in tasks):
                raise ScheduleError(f"group {g} runs a task of a stage it does not hold (its stages: {list(stages)})")
        self.execution_order()


def warmup_counts(
    num_stages: int, policy: str = "A", max_in_flight: Optional[int] = None
) -> Tuple[int, ...]:
    """K_i for each stage under policy A or B, capped by D = max_in_flight (if given)."""
    if policy not in POLICIES:
        raise ScheduleError(f"unknown warm-up policy {policy!r}; expected one of {POLICIES}")
    if num_stages < 1:
        raise ScheduleError(f"a pipeline needs at least one stage, got {num_stages}")
    counts = []
    for i in range(num_stages):
        k = num_stages - i if policy == "A" else 2 * (num_stages - i) - 1
        if max_in_flight is not None:
            k = min(k, max_in_flight)
        counts.append(max(1, k))
    return tuple(counts)


def _dapple_order(stage: int, num_micro_batches: int, warmup: int) -> Tuple[Task, ...]:
    k = min(warmup, num_micro_batches)
    tasks = [Task(stage, FORWARD, i) for i in range(k)]
    next_forward, next_backward = k, 0
    while next_backward < num_micro_batches:
        tasks.append(Task(stage, BACKWARD, next_backward))
        next_backward += 1
        if next_forward < num_micro_batches:
            tasks.append(Task(stage, FORWARD, next_forward))
            next_forward += 1
    return tuple(tasks)


def _checked_warmup(warmup: Sequence[int], num_stages: int) -> Tuple[int, ...]:
    k = tuple(int(x) for x in warmup)
    if len(k) != num_stages:
        raise ScheduleError(f"got {len(k)} warm-up counts for {num_stages} stages")
    if any(x < 1 for x in k):
        raise ScheduleError(f"warm-up counts must be >= 1, got {list(k)}")
    return k


def build_schedule(
    num_stages: int,
    num_micro_batches: int,
    kind: str = "dapple",
    policy: str = "A",
    warmup: Optional[Sequence[int]] = None,
    max_in_flight: Optional[int] = None,
    num_lanes: Optional[int] = None,
) -> Schedule:
    """Builds and validates the schedule for `num_stages` stages and M micro-batches.

    `warmup` (explicit K_i per stage) overrides `policy`; `max_in_flight` is D. `num_lanes`: the device
    groups (P) the stages run on, stage s on group s % P; fewer than the stages only with "interleaved".
    """
    if kind not in SCHEDULE_KINDS:
        raise ScheduleError(f"unknown schedule {kind!r}; expected one of {SCHEDULE_KINDS}")
    if num_micro_batches < 1:
        raise ScheduleError(f"need at least one micro-batch, got {num_micro_batches}")
    if num_stages < 1:
        raise ScheduleError(f"a pipeline needs at least one stage, got {num_stages}")
    m = num_micro_batches
    lanes = num_stages if num_lanes is None else num_lanes
    if kind == INTERLEAVED:
        return _interleaved(num_stages, lanes, m, warmup)
    if lanes != num_stages:
        raise ScheduleError(f"{num_stages} stages on {lanes} device groups share devices; only the "
                            f"{INTERLEAVED!r} schedule runs several stages on one device, not {kind!r}")
    if kind in zero_bubble.KINDS:
        if warmup is not None and kind != "zb-h1":
            raise ScheduleError(f"{kind} sets its own warm-up; explicit warm-up counts are for {DAPPLE_WARMUP_KINDS}")
        dapple_warmup = _checked_warmup(warmup, num_stages) if warmup is not None else warmup_counts(
            num_stages, policy, max_in_flight)
        forward_cap, live_cap = zero_bubble.caps(kind, dapple_warmup, max_in_flight)
        orders = zero_bubble.stage_orders(num_stages, m, forward_cap, live_cap)
        k = tuple(next((i for i, (kind_, _) in enumerate(order) if kind_ != FORWARD), m) for order in orders)
        stage_tasks = tuple(tuple(Task(s, kind_, i) for kind_, i in order) for s, order in enumerate(orders))
    elif kind == "gpipe":
        k = tuple([m] * num_stages)
        stage_tasks = tuple(
            tuple(Task(s, FORWARD, i) for i in range(m)) + tuple(Task(s, BACKWARD, i) for i in range(m))
            for s in range(num_stages)
        )
    else:
        if warmup is not None:
            k = _checked_warmup(warmup, num_stages)
        else:
            k = warmup_counts(num_stages, policy, max_in_flight)
        stage_tasks = tuple(_dapple_order(s, m, k[s]) for s in range(num_stages))
        if kind == BATCHED_W:
            stage_tasks = tuple(tasks + tuple(Task(s, WEIGHT, i) for i in range(m)) for s, tasks in enumerate(stage_tasks))
    schedule = Schedule(kind=kind, num_micro_batches=m, warmup=k, stage_tasks=stage_tasks)
    schedule.validate()
    return schedule


def _interleaved(num_stages: int, num_lanes: int, num_micro_batches: int, warmup) -> Schedule:
    if warmup is not None:
        raise ScheduleError(f"{INTERLEAVED!r} sets its own warm-up; explicit warm-up counts are for {DAPPLE_WARMUP_KINDS}")
    problem = interleaved.check(num_stages, num_lanes, num_micro_batches)
    if problem:
        raise ScheduleError(problem)
    chunks = num_stages // num_lanes
    orders = interleaved.lane_orders(num_lanes, chunks, num_micro_batches)
    lanes = tuple(tuple(Task(s, kind, i) for kind, s, i in order) for order in orders)
    stage_tasks = tuple(tuple(t for t in lanes[s % num_lanes] if t.stage == s) for s in range(num_stages))
    warmup = tuple(interleaved.warmup_forwards(g, num_lanes, chunks, num_micro_batches) for g in range(num_lanes))
    schedule = Schedule(kind=INTERLEAVED, num_micro_batches=num_micro_batches, warmup=warmup,
                        stage_tasks=stage_tasks, lanes=lanes if chunks > 1 else ())
    schedule.validate()
    return schedule


def device_groups(stage_devices: Sequence[Sequence]) -> int:
    """P, the device groups of stages given by their devices (names or ids, replica order): S when no two
    stages share a device; fewer when stages repeat round-robin (stage s on exactly the devices of stage
    s % P, in the same order; P >= 2), which only the interleaved schedule runs. ScheduleError for any other
    sharing."""
    groups: list = []
    for s, devices in enumerate(stage_devices):
        devices = tuple(devices)
        if len(set(devices)) != len(devices):
            raise ScheduleError(f"stage {s} lists a device twice: {list(devices)}; each device runs one replica")
        shared = [d for d in devices if s and d in tuple(stage_devices[s - 1])]
        if shared:
            raise ScheduleError(f"device {shared[0]!r} is used by stages {s - 1} and {s}; adjacent stages cannot share "
                                f"devices (the interleaved schedule's stages take device groups round-robin)")
        if devices in groups:
            continue
        for g, other in enumerate(groups):
            shared = sorted(set(devices) & set(other), key=str)
            if shared:
                first = next(i for i, d in enumerate(stage_devices) if tuple(d) == other)
                raise ScheduleError(
                    f"stages {first} and {s} share devices {shared} but not all of them in the same order "
                    f"({list(other)} vs {list(devices)}); stages may share devices only as whole groups")
        groups.append(devices)
    num_groups = len(groups)
    for s, devices in enumerate(stage_devices):
        if tuple(devices) != groups[s % num_groups]:
            raise ScheduleError(
                f"stage {s} runs on {list(devices)}, but stages that share devices must take the {num_groups} "
                f"device groups round-robin: stage {s} on the devices of stage {s % num_groups} "
                f"({list(groups[s % num_groups])})")
    return num_groups

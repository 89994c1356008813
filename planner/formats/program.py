"""The pipeline program: what one training step runs where, as plain data, and how it is lowered.

A plan says which devices run which layers, M and the schedule. The program spells out what that means for one
step, before any TensorFlow operation exists: each stage replica's slice of a micro-batch, each device's tasks in
the schedule's order, every transfer between stage replicas (activations forward, their gradients back, per
micro-batch and row range), every gradient reduction and its device group, and the apply on every device that
holds a copy of the weights. It is what the runtime (dapple_tf) builds and what the simulator times, so it can be
printed (`dapple_plan --explain`) and tested on its own.

Lowering is the second step: the same program for a set of devices, all of them (one graph for the cluster) or one
task's (a per-host graph, PipelineOptions.own_task). `lower` decides, for that set only, what each transfer and
reduction becomes: an edge between two devices of the built graph is a tensor (TensorFlow moves it, across tasks
too in one graph); an edge from or to another task's graph is a queue; a reduction is TensorFlow's collective
(NCCL on GPUs; the ring on CPU devices of one process) or the graph's own exchange of gradient pieces (CPU
devices of several processes, and every CPU group of a per-host graph: pieces summed on their owners for two
devices, recursive halving and doubling for three or more). The rules are the runtime's
(dapple_tf/rewrite/update/collectives.py, hosts/host_part.py).

The program is plan-level: a transfer moves a stage boundary's rows between stages s and s + 1 (the model decides
which tensors cross, and a later stage reading an earlier one's tensor adds transfers the template knows); a
reduction is a stage's group (weights shared between stages add groups).
"""

import dataclasses
import re
from typing import Dict, Optional, Sequence, Tuple

from planner.formats.schedule import Schedule, Task

ACTIVATION = "activation"
GRADIENT = "gradient"
TENSOR = "tensor"  # an edge within the built graph
QUEUE = "queue"  # an edge to or from another task's graph (per-host graphs)
COLLECTIVE = "collective"  # TensorFlow's all-reduce (NCCL on GPUs, ring on CPUs)
EXCHANGE_PIECES = "exchange: pieces summed on owners"
EXCHANGE_HALVING = "exchange: recursive halving and doubling"
HALVING_DEVICES = 3  # dapple_tf/rewrite/update/halving_exchange.py: from 3 devices on

_TASK = re.compile(r"^(/job:[^/]+(?:/replica:\d+)?(?:/task:\d+)?)")


def task_of(device: str) -> str:
    """The task part of a device name ("/job:worker/replica:0/task:1" for ".../task:1/device:CPU:0"); "" for a
    device of no job (this process's)."""
    match = _TASK.match(device)
    return match.group(1) if match else ""


def _short(device: str) -> str:
    """"task:1/CPU:0" for "/job:worker/replica:0/task:1/device:CPU:0"."""
    task = re.search(r"task:(\d+)", device)
    kind = re.search(r"device:([A-Za-z]+:\d+)", device, re.IGNORECASE) or re.search(r"([A-Za-z]+:\d+)$", device)
    where = kind.group(1) if kind else device
    return f"task:{task.group(1)}/{where}" if task else where


def slice_sizes(total: int, parts: int) -> Tuple[int, ...]:
    """`parts` contiguous sizes summing to `total`, differing by at most one (larger first)."""
    base, extra = divmod(total, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


def offsets(sizes: Sequence[int]) -> Tuple[int, ...]:
    """The first row of each block of `sizes`."""
    out, total = [], 0
    for size in sizes:
        out.append(total)
        total += size
    return tuple(out)


# Who reads whose rows at a stage boundary: the pairs of the program's transfers, and of the runtime's (dapple_tf's
# stage builder reads and cuts by them, and each side of a per-host graph's queue is built from them alone). A
# boundary tensor split by samples ("batch-major") moves rows between the replicas whose slices overlap; one that is
# not is read whole from the producer's replica 0 by every consumer replica.

def overlapping_blocks(sizes: Sequence[int], start: int, size: int) -> Tuple[Tuple[int, int, int], ...]:
    """(block index, first row within [start, start + size), row count) of each block of `sizes` overlapping it."""
    end, out = start + size, []
    for i, (first, n) in enumerate(zip(offsets(sizes), sizes)):
        lo, hi = max(start, first), min(end, first + n)
        if lo < hi:
            out.append((i, lo - start, hi - lo))
    return tuple(out)


def producers_read(batch_major: bool, producer_sizes: Sequence[int], start: int, size: int) -> Tuple[int, ...]:
    """The producer replicas whose tensor a consumer replica of rows [start, start + size) reads."""
    if not batch_major:
        return (0,)
    return tuple(i for i, _, _ in overlapping_blocks(producer_sizes, start, size))


def gradient_pieces(batch_major: bool, producer_sizes: Sequence[int], start: int, size: int
                    ) -> Tuple[Tuple[int, int, int], ...]:
    """(producer replica, first row in the consumer's slice, rows) of each piece of the input gradient of a consumer
    replica of rows [start, start + size)."""
    if not batch_major:
        return ((0, 0, size),)
    return overlapping_blocks(producer_sizes, start, size)


def consumers_reading(batch_major: bool, producer_sizes: Sequence[int], consumer_sizes: Sequence[int], i: int
                      ) -> Tuple[int, ...]:
    """The consumer replicas whose `producers_read` includes producer replica i (its inverse, in one pass)."""
    return tuple(j for j, _, _ in gradient_pieces_for(batch_major, producer_sizes, consumer_sizes, i))


def gradient_pieces_for(batch_major: bool, producer_sizes: Sequence[int], consumer_sizes: Sequence[int], i: int
                        ) -> Tuple[Tuple[int, int, int], ...]:
    """(consumer replica, first row in producer replica i's slice, rows) of each gradient piece producer replica i
    gets (the pieces `gradient_pieces` cuts for it, in one pass)."""
    if not batch_major:
        return tuple((j, 0, size) for j, size in enumerate(consumer_sizes)) if i == 0 else ()
    first = offsets(producer_sizes)[i]
    end, out = first + producer_sizes[i], []
    for j, (start, size) in enumerate(zip(offsets(consumer_sizes), consumer_sizes)):
        lo, hi = max(start, first), min(start + size, end)
        if lo < hi:
            out.append((j, lo - first, hi - lo))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Replica:
    """Replica `index` of stage `stage` on `device`, holding rows [first_row, first_row + rows) of each
    micro-batch."""

    stage: int
    index: int
    device: str
    first_row: int
    rows: int

    def __str__(self) -> str:
        return f"s{self.stage}r{self.index}"


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Rows [first_row, first_row + rows) of micro-batch `micro_batch` (counted within the micro-batch) moving from
    `source` to `target`: a stage boundary's activations forward, or their gradient back."""

    kind: str  # ACTIVATION or GRADIENT
    micro_batch: int
    source: Replica
    target: Replica
    first_row: int
    rows: int

    @property
    def crosses_tasks(self) -> bool:
        return task_of(self.source.device) != task_of(self.target.device)

    def __str__(self) -> str:
        arrow = f"{self.source} -> {self.target}"
        return (f"{self.kind} mb{self.micro_batch} {arrow}: rows {self.first_row}-{self.first_row + self.rows - 1}, "
                f"{_short(self.source.device)} -> {_short(self.target.device)}")


@dataclasses.dataclass(frozen=True)
class Reduction:
    """The sum of a stage's weight gradients over its replicas' devices, once per step after its last backward."""

    stage: int
    devices: Tuple[str, ...]

    @property
    def tasks(self) -> Tuple[str, ...]:
        return tuple(dict.fromkeys(map(task_of, self.devices)))


@dataclasses.dataclass(frozen=True)
class PipelineProgram:
    """One step of a plan: see the module docstring. `device_tasks` lists each device's tasks in order, as
    (task, replica) pairs."""

    global_batch_size: int
    num_micro_batches: int
    schedule: Schedule
    stages: Tuple[Tuple[Replica, ...], ...]  # per stage, its replicas
    layers: Tuple[Tuple[str, ...], ...]  # per stage, its layers' names (may be empty)
    recompute: Tuple[bool, ...]
    device_tasks: Dict[str, Tuple[Tuple[Task, int], ...]]
    transfers: Tuple[Transfer, ...]
    reductions: Tuple[Reduction, ...]

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch_size // self.num_micro_batches

    @property
    def devices(self) -> Tuple[str, ...]:
        return tuple(self.device_tasks)

    @property
    def tasks(self) -> Tuple[str, ...]:
        return tuple(dict.fromkeys(map(task_of, self.devices)))

    def __str__(self) -> str:
        return explain(self)


def build_program(stage_devices: Sequence[Sequence[str]], global_batch_size: int, schedule: Schedule,
                  layers: Optional[Sequence[Sequence[str]]] = None,
                  recompute: Optional[Sequence[bool]] = None) -> PipelineProgram:
    """The program of stages on `stage_devices` (per stage, its replicas' devices), the global batch cut into
    `schedule.num_micro_batches` micro-batches, run in `schedule`'s order."""
    num_stages, m = len(stage_devices), schedule.num_micro_batches
    if schedule.num_stages != num_stages:
        raise ValueError(f"the schedule has {schedule.num_stages} stages, the plan {num_stages}")
    if global_batch_size % m:
        raise ValueError(f"the global batch size {global_batch_size} is not divisible by {m} micro-batches")
    size = global_batch_size // m
    stages = []
    for s, devices in enumerate(stage_devices):
        if len(devices) > size:
            raise ValueError(f"stage {s} has {len(devices)} replicas but a micro-batch only {size} samples")
        sizes = slice_sizes(size, len(devices))
        stages.append(tuple(Replica(s, j, d, first, n) for j, (d, first, n) in
                            enumerate(zip(devices, offsets(sizes), sizes))))
    device_tasks: Dict[str, list] = {}
    for lane, tasks in enumerate(schedule.lane_tasks):
        for stage in schedule.lane_stages(lane):
            for replica in stages[stage]:
                device_tasks.setdefault(replica.device, [])
        for task in tasks:
            for replica in stages[task.stage]:
                device_tasks[replica.device].append((task, replica.index))
    transfers = []
    for mb in range(m):
        for s in range(num_stages - 1):
            producer_sizes, consumer_sizes = [r.rows for r in stages[s]], [r.rows for r in stages[s + 1]]
            for source in stages[s]:
                for j, first, rows in gradient_pieces_for(True, producer_sizes, consumer_sizes, source.index):
                    target, lo = stages[s + 1][j], source.first_row + first
                    transfers.append(Transfer(ACTIVATION, mb, source, target, lo, rows))
                    transfers.append(Transfer(GRADIENT, mb, target, source, lo, rows))
    reductions = tuple(Reduction(s, tuple(r.device for r in replicas)) for s, replicas in enumerate(stages)
                       if len(replicas) > 1)
    return PipelineProgram(
        global_batch_size=global_batch_size, num_micro_batches=m, schedule=schedule, stages=tuple(stages),
        layers=tuple(tuple(names) for names in layers) if layers is not None else ((),) * num_stages,
        recompute=tuple(recompute) if recompute is not None else (False,) * num_stages,
        device_tasks={d: tuple(tasks) for d, tasks in device_tasks.items()},
        transfers=tuple(sorted(transfers, key=lambda t: (t.micro_batch, t.kind != ACTIVATION, t.source.stage))),
        reductions=reductions)


@dataclasses.dataclass(frozen=True)
class Lowered:
    """A program lowered for the devices of one graph: `own_task`'s (a per-host graph) or all (None)."""

    program: PipelineProgram
    own_task: Optional[str]
    devices: Tuple[str, ...]  # the devices this graph builds tasks on
    edges: Tuple[Tuple[Transfer, str], ...]  # each transfer this graph builds a side of, and how (TENSOR or QUEUE)
    reductions: Tuple[Tuple[Reduction, str], ...]  # each reduction this graph takes part in, and how

    def __str__(self) -> str:
        return explain_lowered(self)


def _is_gpu(device: str) -> bool:
    return "GPU" in device.upper().rsplit("/", 1)[-1]


def reduction_means(devices: Sequence[str], per_host: bool) -> str:
    """How the runtime sums gradients over `devices`: collectives.uses_exchange and halving_exchange's rule."""
    several_tasks = len({task_of(d) for d in devices}) > 1
    if all(map(_is_gpu, devices)) or not (several_tasks or per_host):
        return COLLECTIVE
    return EXCHANGE_HALVING if len(devices) >= HALVING_DEVICES else EXCHANGE_PIECES


def lower(program: PipelineProgram, own_task: Optional[str] = None) -> Lowered:
    """`program` for one graph: of the whole cluster (own_task None), or of task `own_task` (a per-host graph)."""
    if own_task is None:
        local = set(program.devices)
    else:
        own_task = task_of(own_task) or own_task
        if own_task not in program.tasks:
            raise ValueError(f"own_task {own_task} runs none of the plan's devices; the plan's tasks: "
                             f"{list(program.tasks)}")
        local = {d for d in program.devices if task_of(d) == own_task}
    edges = []
    for t in program.transfers:
        ends = (t.source.device in local) + (t.target.device in local)
        if ends:
            edges.append((t, TENSOR if ends == 2 else QUEUE))
    reductions = tuple((r, reduction_means(r.devices, own_task is not None)) for r in program.reductions
                       if local & set(r.devices))
    return Lowered(program, own_task, tuple(d for d in program.devices if d in local), tuple(edges), reductions)


def explain(program: PipelineProgram) -> str:
    """The program as text: stages and slices, each device's tasks, the transfers of micro-batch 0 (every
    micro-batch moves the same rows), the reductions."""
    p = program
    lines = [f"pipeline program: {len(p.stages)} stages, M={p.num_micro_batches} micro-batches of "
             f"{p.micro_batch_size} samples (global batch {p.global_batch_size}), schedule {p.schedule.kind}, "
             f"{len(p.devices)} devices in {len(p.tasks)} task(s)"]
    for s, replicas in enumerate(p.stages):
        names = p.layers[s]
        what = f" layers {names[0]}..{names[-1]}" if len(names) > 1 else (f" layer {names[0]}" if names else "")
        again = ", recomputed" if p.recompute[s] else ""
        lines.append(f"stage {s}:{what}, {len(replicas)} replica(s){again}")
        for r in replicas:
            lines.append(f"  {r} on {r.device}: rows {r.first_row}-{r.first_row + r.rows - 1} of each micro-batch")
    lines.append("tasks per device, in order:")
    for device, tasks in p.device_tasks.items():
        lines.append(f"  {_short(device)}: " + " ".join(f"{t.label}r{j}" for t, j in tasks))
    first = [t for t in p.transfers if t.micro_batch == 0]
    lines.append(f"transfers of micro-batch 0 (each of the {p.num_micro_batches} moves the same rows):"
                 if first else "transfers: none (one stage)")
    lines += [f"  {t}" + ("  [crosses tasks]" if t.crosses_tasks else "") for t in first]
    lines.append("gradient reductions, after each stage's last backward:" if p.reductions else
                 "gradient reductions: none (no stage is replicated)")
    for r in p.reductions:
        lines.append(f"  stage {r.stage}: sum over {', '.join(map(_short, r.devices))}")
    lines.append("apply: the optimizer's step on every device, on its copy of its stages' weights")
    return "\n".join(lines)


def explain_lowered(lowered: Lowered) -> str:
    """What one graph builds of the program: its devices, how each transfer and reduction it takes part in is
    built."""
    p = lowered.program
    who = f"task {lowered.own_task} (per-host graph)" if lowered.own_task else "one graph for every task"
    lines = [f"lowered for {who}: devices {', '.join(map(_short, lowered.devices))}"]
    for t, how in lowered.edges:
        if t.micro_batch == 0:
            lines.append(f"  {how}: {t}")
    if p.num_micro_batches > 1 and lowered.edges:
        rest = "micro-batch 1" if p.num_micro_batches == 2 else f"micro-batches 1-{p.num_micro_batches - 1}"
        lines.append(f"  (the same for {rest})")
    for r, how in lowered.reductions:
        lines.append(f"  stage {r.stage} gradients: {how} over {', '.join(map(_short, r.devices))}")
    return "\n".join(lines)


def program_of_plan(plan, schedule: Schedule) -> PipelineProgram:
    """The program of a plan proto (planner/formats/plan.proto) run in `schedule` (its own:
    planner.simulation.sim_adapter.plan_schedule)."""
    names = list(plan.cluster.device_names)
    devices = [[names[i] if i < len(names) else f"device:{i}" for i in st.device_ids] for st in plan.stages]
    return build_program(devices, plan.global_batch_size, schedule, [list(st.layer_names) for st in plan.stages],
                         [st.recompute for st in plan.stages])

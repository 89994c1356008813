"""`dapple_tf.Plan`: which layers form each stage, on which devices, and how many micro-batches.

A plan comes from the planner's plan file (`Plan.from_file`, `Plan.from_proto`) or is written by
hand (`Plan.from_stages`). `Plan.resolve(layer_names)` checks it against a model's layers and
returns the stages with layer indices; `Plan.schedule(kind, num_stages)` builds the
planner.formats.schedule.Schedule the runtime turns into control edges.
"""

import dataclasses
from typing import Optional, Sequence, Tuple, Union

from dapple_tf.errors import PlanError
from planner.formats import schedule as schedule_lib
from planner.formats import plan_pb2, read_message

LayerRef = Union[int, str]


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """A stage as the user or the plan file gives it: a layer range and devices."""

    first_layer: LayerRef
    last_layer: LayerRef
    devices: Tuple[str, ...]
    recompute: bool = False  # re-computation chosen by the planner (plan.proto Stage.recompute)


@dataclasses.dataclass(frozen=True)
class ResolvedStage:
    """A stage checked against the model: layer indices (inclusive) and devices."""

    index: int
    first_layer: int
    last_layer: int
    layer_names: Tuple[str, ...]
    devices: Tuple[str, ...]

    @property
    def replication(self) -> int:
        return len(self.devices)


class Plan:
    """Stages (layer ranges and devices), micro-batch count M and warm-up policy."""

    def __init__(
        self,
        stages: Sequence[StageSpec],
        num_micro_batches: int,
        policy: str = "A",
        warmup: Optional[Sequence[int]] = None,
        expected_layer_names: Optional[Sequence[Sequence[str]]] = None,
        source: str = "manual",
        schedule_kind: Optional[str] = None,
        global_batch_size: int = 0,
    ):
        if not stages:
            raise PlanError(f"{source}: a plan needs at least one stage")
        if not isinstance(num_micro_batches, int) or num_micro_batches < 1:
            raise PlanError(f"{source}: num_micro_batches must be a positive integer, got {num_micro_batches!r}")
        if policy not in schedule_lib.POLICIES:
            raise PlanError(f"{source}: unknown warm-up policy {policy!r}; expected one of {schedule_lib.POLICIES}")
        if warmup is not None and len(warmup) != len(stages):
            raise PlanError(f"{source}: {len(warmup)} warm-up counts for {len(stages)} stages")
        self.stages = tuple(stages)
        self.num_micro_batches = num_micro_batches
        self.policy = policy
        self.warmup = tuple(warmup) if warmup is not None else None
        self.expected_layer_names = expected_layer_names
        self.source = source
        self.schedule_kind = schedule_kind  # from a plan file (a planner.formats.schedule kind) or None
        self.global_batch_size = global_batch_size  # from a plan file; 0 if unknown
        for i, stage in enumerate(self.stages):
            if not stage.devices:
                raise PlanError(f"{source}: stage {i} has no devices")
            for device in stage.devices:
                if not isinstance(device, str):
                    raise PlanError(f"{source}: stage {i}: a device is a string such as '/cpu:0', got {device!r}")
        try:
            self.num_device_groups = schedule_lib.device_groups([s.devices for s in self.stages])
        except schedule_lib.ScheduleError as e:
            raise PlanError(f"{source}: {e}") from e

    def __repr__(self) -> str:
        stages = ", ".join(f"({s.first_layer!r}, {s.last_layer!r}, {list(s.devices)})" for s in self.stages)
        return f"Plan([{stages}], num_micro_batches={self.num_micro_batches}, policy={self.policy!r})"

    @property
    def devices(self) -> Tuple[str, ...]:
        """Every device of the plan, once (stages that share devices, interleaved, list them again)."""
        return tuple(dict.fromkeys(d for s in self.stages for d in s.devices))

    @property
    def default_schedule(self) -> str:
        """The plan file's schedule; else "interleaved" where stages share devices, "dapple" otherwise."""
        if self.schedule_kind:
            return self.schedule_kind
        return schedule_lib.INTERLEAVED if self.num_device_groups < len(self.stages) else "dapple"

    @property
    def recompute(self) -> Tuple[bool, ...]:
        """Per stage, whether the plan chose re-computation."""
        return tuple(s.recompute for s in self.stages)

    def with_devices(self, rename) -> "Plan":
        """The same plan with every device string passed through `rename` (checked again)."""
        return Plan(
            [dataclasses.replace(s, devices=tuple(rename(d) for d in s.devices)) for s in self.stages],
            self.num_micro_batches,
            policy=self.policy,
            warmup=self.warmup,
            expected_layer_names=self.expected_layer_names,
            source=self.source,
            schedule_kind=self.schedule_kind,
            global_batch_size=self.global_batch_size,
        )

    @classmethod
    def from_stages(
        cls,
        stages: Sequence[Tuple[LayerRef, LayerRef, Sequence[str]]],
        num_micro_batches: int,
        policy: str = "A",
        warmup: Optional[Sequence[int]] = None,
    ) -> "Plan":
        """A hand-written plan: `[(first_layer, last_layer, [device, ...]), ...]`, layers by name or index."""
        specs = []
        for i, stage in enumerate(stages):
            try:
                first, last, devices = stage
            except (TypeError, ValueError):
                raise PlanError(f"stage {i} must be (first_layer, last_layer, [devices]), got {stage!r}") from None
            if isinstance(devices, str):
                devices = [devices]
            specs.append(StageSpec(first, last, tuple(devices)))
        return cls(specs, num_micro_batches, policy=policy, warmup=warmup)

    @classmethod
    def from_proto(cls, proto: plan_pb2.Plan, source: str = "plan") -> "Plan":
        """A plan written by the planner (planner/formats/plan.proto)."""
        names = list(proto.cluster.device_names)
        specs, expected, warmup = [], [], []
        for i, stage in enumerate(proto.stages):
            devices = []
            for d in stage.device_ids:
                if not 0 <= d < len(names):
                    raise PlanError(
                        f"{source}: stage {i} uses device id {d} but the cluster names {len(names)} devices"
                    )
                devices.append(names[d])
            specs.append(StageSpec(stage.first_layer, stage.last_layer, tuple(devices), recompute=stage.recompute))
            expected.append(tuple(stage.layer_names))
            warmup.append(stage.warmup_micro_batches)
        policy = "B" if proto.policy == plan_pb2.POLICY_B else "A"
        explicit = proto.policy == plan_pb2.EXPLICIT or all(k > 0 for k in warmup)
        return cls(
            specs,
            proto.num_micro_batches,
            policy=policy,
            warmup=warmup if explicit and warmup else None,
            expected_layer_names=expected if any(expected) else None,
            source=source,
            schedule_kind=schedule_lib.schedule_kind(proto.schedule),
            global_batch_size=proto.global_batch_size,
        )

    @classmethod
    def from_file(cls, path: str) -> "Plan":
        """Reads a plan file (.pb/.pbtxt/.json) written by dapple_plan."""
        return cls.from_proto(read_message(path, plan_pb2.Plan), source=path)

    def _layer_index(self, ref: LayerRef, layer_names: Sequence[str], stage: int) -> int:
        if isinstance(ref, bool) or not isinstance(ref, (int, str)):
            raise PlanError(f"{self.source}: stage {stage}: a layer is named by its name or index, got {ref!r}")
        if isinstance(ref, int):
            if not 0 <= ref < len(layer_names):
                raise PlanError(
                    f"{self.source}: stage {stage}: layer index {ref} is out of range; "
                    f"the model has {len(layer_names)} layers"
                )
            return ref
        if ref not in layer_names:
            raise PlanError(
                f"{self.source}: stage {stage}: {ref!r} is not a layer of the model; its layers are {list(layer_names)}"
            )
        return list(layer_names).index(ref)

    def resolve(self, layer_names: Sequence[str]) -> Tuple[ResolvedStage, ...]:
        """Checks the stages cover the model's layers in order, each exactly once."""
        resolved, expected_first = [], 0
        for i, spec in enumerate(self.stages):
            first = self._layer_index(spec.first_layer, layer_names, i)
            last = self._layer_index(spec.last_layer, layer_names, i)
            if first != expected_first:
                what = "start at the model's first layer" if i == 0 else f"start right after stage {i - 1}"
                raise PlanError(
                    f"{self.source}: stage {i} starts at layer {first} ({layer_names[first]!r}) but must {what}: "
                    f"layer {expected_first} ({layer_names[expected_first] if expected_first < len(layer_names) else '-'!r})"
                )
            if last < first:
                raise PlanError(f"{self.source}: stage {i} ends (layer {last}) before it starts (layer {first})")
            names = tuple(layer_names[first : last + 1])
            if self.expected_layer_names and self.expected_layer_names[i] and tuple(self.expected_layer_names[i]) != names:
                raise PlanError(
                    f"{self.source}: stage {i} names layers {list(self.expected_layer_names[i])} but the model's layers "
                    f"{first}..{last} are {list(names)}"
                )
            resolved.append(ResolvedStage(i, first, last, names, spec.devices))
            expected_first = last + 1
        if expected_first != len(layer_names):
            raise PlanError(
                f"{self.source}: the stages end at layer {expected_first - 1} but the model has {len(layer_names)} "
                f"layers; layers {list(layer_names[expected_first:])} belong to no stage"
            )
        return tuple(resolved)

    def schedule(self, kind: Optional[str] = None) -> schedule_lib.Schedule:
        """The task order for `kind` (planner.formats.schedule.SCHEDULE_KINDS; None: `default_schedule`); the warm-up policy and
        counts are DAPPLE's (the other kinds set their own)."""
        kind = kind or self.default_schedule
        try:
            return schedule_lib.build_schedule(
                len(self.stages), self.num_micro_batches, kind=kind, policy=self.policy,
                warmup=self.warmup if kind in schedule_lib.DAPPLE_WARMUP_KINDS else None, num_lanes=self.num_device_groups,
            )
        except schedule_lib.ScheduleError as e:
            raise PlanError(f"{self.source}: {e}") from e

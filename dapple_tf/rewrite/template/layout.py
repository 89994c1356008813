"""`PipelineLayout`: the plan resolved against one model, made once by build_pipeline.

It carries what the passes after the template read of the plan: the stages (layer ranges and
devices), the micro-batch count M and size, the schedule (planner.formats.schedule), and which
stages recompute. The passes take it instead of reading the plan.
"""

import dataclasses
from typing import Optional, Tuple

from dapple_tf.errors import PlanError
from dapple_tf.plan import Plan, ResolvedStage
from dapple_tf.rewrite.batch import microbatch
from dapple_tf.rewrite.template import recompute as recompute_lib
from planner.formats.schedule import BATCHED_W, Schedule


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """Stages, M, the micro-batch size, the schedule and the re-computation choice of one build."""

    stages: Tuple[ResolvedStage, ...]
    num_micro_batches: int
    micro_batch_size: int
    schedule: Schedule
    recompute: Tuple[bool, ...]  # per stage

    @property
    def replication(self) -> Tuple[int, ...]:
        return tuple(stage.replication for stage in self.stages)

    @classmethod
    def of(cls, plan: Plan, template, schedule: Optional[str] = None, recompute=None) -> "PipelineLayout":
        """The layout of `plan` for the model cut into its stages (`template`: a template.Template);
        `schedule` and `recompute` as in PipelineOptions (None: the plan's)."""
        stages = tuple(st.stage for st in template.stages)
        if plan.global_batch_size and plan.global_batch_size != template.global_batch_size:
            raise PlanError(
                f"{plan.source}: the plan is for a global batch of {plan.global_batch_size} but the features hold "
                f"{template.global_batch_size} samples"
            )
        micro_size = microbatch.micro_batch_size(
            template.global_batch_size, plan.num_micro_batches, [s.replication for s in stages]
        )
        layout = cls(
            stages=stages,
            num_micro_batches=plan.num_micro_batches,
            micro_batch_size=micro_size,
            schedule=plan.schedule(schedule or plan.default_schedule),
            recompute=recompute_lib.stages_to_recompute(recompute, plan.recompute, len(stages)),
        )
        if layout.schedule.kind == BATCHED_W and any(layout.recompute):
            stages_ = [i for i, on in enumerate(layout.recompute) if on]
            raise PlanError(
                f"{plan.source}: schedule {BATCHED_W!r} keeps every micro-batch's activations until its stage's last "
                f"backward, which re-computation (stages {stages_}) exists to avoid: set recompute=False or choose another "
                f"schedule")
        return layout

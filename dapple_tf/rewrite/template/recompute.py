"""Re-computation (GPipe's re-materialization): which stages use it, and their recomputed clones.

With re-computation a stage's forward task keeps alive only what its backward task needs to run
the forward again: the boundary inputs it received (and its input slices and variable handles,
which live anyway). The backward task imports the stage's operations a second time, fed by those
stored tensors, and differentiates this recomputed clone instead of the forward one; the forward
clone's intermediate tensors then have no consumer after the forward task and are freed. Created
inside the backward task, the recomputed clone's entry operations get the task's control edges
(tasks.chain), so the recomputation runs in the backward task's slot of the schedule, not early.

Random state: the recomputed clone is imported with the same per-clone seeds as the forward
clone (graph_defs.private_copy with the same salt), so each seeded random op of the two clones
draws the same values as long as both run once per step (train_op runs both). Random ops without
a seed get one here, at build time, shared by both clones. Operations that change state when they
run (assignments, tf.random.Generator draws) would run twice: a stage holding one is refused.
"""

import dataclasses
import random
from typing import Dict, Sequence, Tuple

import tensorflow as tf

from dapple_tf.rewrite.graphs import graph_defs as graph_defs_lib
from dapple_tf.errors import DappleError, PlanError
from dapple_tf.rewrite.graphs import v1_control_flow
from dapple_tf.rewrite.template.template import BOUNDARY, StageTemplate

# Operations whose second run would not repeat the first (they write state or advance a generator).
_STATE_CHANGING_PREFIXES = ("Assign", "ResourceScatter", "ResourceApply", "ResourceStridedSliceAssign", "Rng")
_STATE_CHANGING_OPS = {
    "StatefulUniform", "StatefulUniformInt", "StatefulUniformFullInt", "StatefulStandardNormal",
    "StatefulStandardNormalV2", "StatefulTruncatedNormal", "StatefulRandomBinomial",
    "RandomShuffle", "QueueEnqueueV2", "QueueDequeueV2", "LookupTableInsertV2", "LookupTableRemoveV2",
}


def stages_to_recompute(recompute, plan_choice: Sequence[bool], num_stages: int) -> Tuple[bool, ...]:
    """Per stage, whether to recompute: `recompute` is None (the plan's choice), a bool (every
    stage or none), or a list of stage indices."""
    if recompute is None:
        return tuple(bool(r) for r in plan_choice) if plan_choice else (False,) * num_stages
    if isinstance(recompute, bool):
        return (recompute,) * num_stages
    if isinstance(recompute, (list, tuple, set, frozenset)):
        chosen = set()
        for s in recompute:
            if isinstance(s, bool) or not isinstance(s, int):
                raise PlanError(f"recompute lists stage indices (ints), got {s!r}")
            if not 0 <= s < num_stages:
                raise PlanError(
                    f"recompute names stage {s}, but the plan has {num_stages} stages (0..{num_stages - 1})"
                )
            chosen.add(s)
        return tuple(s in chosen for s in range(num_stages))
    raise PlanError(f"recompute must be True, False, None or a list of stage indices, got {recompute!r}")


def _random_nodes(stage: graph_defs_lib.StageGraphDef):
    yield from (n for n in stage.graph_def.node if "seed2" in n.attr)
    for function in stage.graph_def.library.function:
        yield from (n for n in function.node_def if "seed2" in n.attr)


def check_repeatable(stage: graph_defs_lib.StageGraphDef, index: int) -> None:
    """Refuses a stage whose operations change state when run (a second run would differ)."""
    nodes = list(stage.graph_def.node) + [n for f in stage.graph_def.library.function for n in f.node_def]
    for node in nodes:
        if node.op in _STATE_CHANGING_OPS or node.op.startswith(_STATE_CHANGING_PREFIXES):
            raise DappleError(
                f"stage {index} cannot be recomputed: {node.name} ({node.op}) changes state each time it runs, so "
                "the recomputed forward would differ from the first; leave this stage out of `recompute`"
            )


def with_fixed_seeds(stage: graph_defs_lib.StageGraphDef, rng: random.Random) -> graph_defs_lib.StageGraphDef:
    """The stage with every unseeded random op given a seed (drawn from `rng`), so that the
    forward clone and the recomputed clone draw the same values."""
    if not any(n.attr["seed"].i == 0 and n.attr["seed2"].i == 0 for n in _random_nodes(stage)):
        return stage
    copy = tf.compat.v1.GraphDef()
    copy.CopyFrom(stage.graph_def)
    result = dataclasses.replace(stage, graph_def=copy, seeded=True)
    for node in _random_nodes(result):
        if node.attr["seed"].i == 0 and node.attr["seed2"].i == 0:
            node.attr["seed"].i = rng.randrange(1, 2**31 - 1)
    return result


def recomputed_clone(
    stage: StageTemplate,
    graph_def: tf.compat.v1.GraphDef,
    forward_inputs: Dict[str, tf.Tensor],
    wanted: Sequence[str],
    name: str,
    extra_feed: Dict[str, tf.Tensor] = None,
    contexts=(),
) -> Tuple[Dict[str, tf.Tensor], Dict[str, tf.Tensor]]:
    """Imports the stage again (call inside the backward task's capture and device scope), fed by
    the tensors the forward clone was fed (and `extra_feed`: sync batch norm's instance keys).
    Returns (inputs fed, template name -> recomputed tensor).

    Boundary inputs are fed through identities of the backward task's own: the gradients are taken
    w.r.t. them, and the identities' control edges hold the recomputation in the task's slot.
    """
    kinds = {e.tensor.name: e.kind for e in stage.externals}
    feed = {
        key: tf.identity(t, name="recompute_input") if kinds[key] == BOUNDARY else t
        for key, t in forward_inputs.items()
    }
    input_map = {**feed, **(extra_feed or {})}
    results = v1_control_flow.import_clone(graph_def, list(contexts), input_map, list(wanted), name)
    return feed, dict(zip(wanted, results))

"""What dapple_demo says under the speed benchmark's table: the planner's ties as a short table, and one sentence
on which plan won, by how much and, where a pipeline lost, why. Both are computed from the benchmark's --json rows
(scripts/bench/speed/speedup.py: `plan`, `stages`, `speedup`, `ideal_speedup`, `slice_slowdown`, `simulated_speedup`,
and on the planner's row `ties` and `profile_spread`), so they run on hand-made rows too.
"""

import dataclasses
import math
import re
from typing import Dict, List, Optional, Sequence, Tuple

from planner.planning import ties

MAX_TIES_ROWS = 5


@dataclasses.dataclass(frozen=True)
class Shape:
    """A plan as its row's `stages` describes it ('0-3@[0] 4-8@[1], M=2, dapple'): the devices of each stage, M and
    the schedule."""

    stage_devices: Tuple[Tuple[int, ...], ...]
    num_micro_batches: int
    schedule: str

    @property
    def is_pipeline(self) -> bool:
        return len(self.stage_devices) > 1

    @property
    def num_workers(self) -> int:
        return len({d for devices in self.stage_devices for d in devices})


def shape_of(row: Dict) -> Shape:
    """The Shape of a benchmark row, from its `stages` text."""
    text = row["stages"]
    stages = tuple(tuple(int(d) for d in devices.split(",") if d.strip())
                   for devices in re.findall(r"\d+-\d+@\[([\d, ]*)\]", text))
    m = re.search(r"M=(\d+)", text)
    parts = [p.strip() for p in text.split(",")]
    return Shape(stages, int(m.group(1)) if m else 1, parts[-1] if parts else "dapple")


def batch_size(row: Dict) -> int:
    """The global batch a row measured: its samples per second times its step."""
    return round(row["samples_per_s"] * row["measured_ms"] / 1e3)


def slice_size(row: Dict) -> int:
    """The most samples one worker computes at once in the row's plan (a micro-batch over a stage's replicas)."""
    shape = shape_of(row)
    replicas = min((len(d) for d in shape.stage_devices), default=1)
    return math.ceil(batch_size(row) / shape.num_micro_batches / max(1, replicas))


def plan_words(row: Dict) -> str:
    """A plan as a newcomer reads it: 'data parallel on 2 workers (dp2)', 'a 2-stage pipeline with M=4
    (straight2-M4)'; the row's own name for the other benchmark plans."""
    if row["plan"] != "planner":
        return row["plan"]
    shape = shape_of(row)
    stages, n, m = len(shape.stage_devices), shape.num_workers, shape.num_micro_batches
    if stages == 1:
        return "one worker" if n == 1 else f"data parallel on {n} workers (dp{n}{f'-M{m}' if m > 1 else ''})"
    if all(len(d) == 1 for d in shape.stage_devices):
        kind = "gpipe" if shape.schedule == "gpipe" else "straight"
        suffix = "" if shape.schedule in ("dapple", "gpipe") else f"-{shape.schedule}"
        return f"a {stages}-stage pipeline with M={m} ({kind}{stages}-M{m}{suffix})"
    replicas = ":".join(str(len(d)) for d in shape.stage_devices)
    return f"a {stages}-stage pipeline with M={m}, stages on {replicas} workers ({row['stages']})"


def _x(value: float) -> str:
    return f"{value:.2f}x"


def why_pipeline_lost(row: Dict) -> str:
    """Why a pipeline fell short on this machine, from what the benchmark measured: the per-sample cost of its
    slices over the whole batch's, and the bubble's cap (the ideal speedup)."""
    return (f"with M={shape_of(row).num_micro_batches} its bubble caps it at {_x(row['ideal_speedup'])}, and its "
            f"{slice_size(row)}-sample slices cost {_x(row['slice_slowdown'])} per sample what the whole "
            f"{batch_size(row)}-sample batch does here")


def _best(rows: Sequence[Dict]) -> Optional[Dict]:
    return max(rows, key=lambda r: r["speedup"], default=None)


def _measured(rows: Sequence[Dict]) -> List[Dict]:
    return [r for r in rows if isinstance(r.get("speedup"), (int, float)) and not math.isnan(r["speedup"])
            and "stages" in r]


def verdict(rows: Sequence[Dict]) -> str:
    """One sentence: which plan was fastest over one worker and by how much (the planner's choice, another plan, or
    none beat one worker), and where a pipeline lost, why (why_pipeline_lost); "" without a `single` row and
    another measured one."""
    rows = _measured(rows)
    if not any(r["plan"] == "single" for r in rows):
        return ""
    others = [r for r in rows if r["plan"] != "single"]
    winner = _best(others)
    if winner is None:
        return ""
    chosen = next((r for r in others if r["plan"] == "planner"), None)
    chosen_stages = chosen["stages"] if chosen else None
    pipeline = _best([r for r in others if r["plan"] != "planner" and shape_of(r).is_pipeline
                      and r["stages"] != chosen_stages])
    if winner["speedup"] <= 1.0:
        return _nothing_won(chosen, pipeline)
    if chosen is not None and (winner is chosen or winner["stages"] == chosen_stages):
        return _planner_won(chosen, pipeline)
    return _other_won(winner, chosen)


def _pipeline_clause(pipeline: Dict, lead: str) -> str:
    return f"{lead}{pipeline['plan']}, reached {_x(pipeline['speedup'])}: {why_pipeline_lost(pipeline)}"


def _planner_won(chosen: Dict, pipeline: Optional[Dict]) -> str:
    sentence = (f"On this machine the planner's choice, {plan_words(chosen)}, was fastest: {_x(chosen['speedup'])} "
                "one worker")
    if pipeline is not None:
        sentence += _pipeline_clause(pipeline, "; the best other pipeline, " if shape_of(chosen).is_pipeline
                                     else "; the best pipeline, ")
    return sentence + "."


def _other_won(winner: Dict, chosen: Optional[Dict]) -> str:
    kind = "a pipeline" if shape_of(winner).is_pipeline else "a plan"
    sentence = f"On this machine {kind} was fastest: {winner['plan']}, {_x(winner['speedup'])} one worker"
    if chosen is not None:
        slices = f"; {why_pipeline_lost(chosen)}" if shape_of(chosen).is_pipeline else ""
        sentence += (f", ahead of the planner's choice, {plan_words(chosen)}, at {_x(chosen['speedup'])} (simulated "
                     f"{_x(chosen['simulated_speedup'])}{slices})")
    return sentence + "."


def _nothing_won(chosen: Optional[Dict], pipeline: Optional[Dict]) -> str:
    sentence = "On this machine nothing beat one worker"
    if chosen is not None:
        sentence += f": the planner's choice, {plan_words(chosen)}, reached {_x(chosen['speedup'])}"
    if pipeline is not None:
        sentence += _pipeline_clause(pipeline, "; the best pipeline, " if chosen else ": the best pipeline, ")
    return sentence + "."


def proto_ties(plan) -> List[Tuple[str, float]]:
    """A planner's plan_pb2.Plan's ties as ties_table_of takes them: (description, simulated ms), the plan first;
    [] without ties."""
    if not plan.ties:
        return []
    return [(ties.describe(plan), plan.simulated_iteration_ms)] + [(t.description, t.simulated_iteration_ms)
                                                                   for t in plan.ties]


def ties_table(rows: Sequence[Dict], limit: int = MAX_TIES_ROWS) -> str:
    """ties_table_of the planner's row among the benchmark's `rows` ("" without one, or without ties)."""
    chosen = next((r for r in rows if r.get("plan") == "planner"), None) or {}
    return ties_table_of(chosen.get("ties") or [], chosen.get("profile_spread", 0.0), limit)


def ties_table_of(plans: Sequence[Sequence], spread: float, limit: int = MAX_TIES_ROWS) -> str:
    """A planner's ties (plans simulated within its profile's `spread` of its choice, planner/planning/ties.py) as a
    table of at most `limit` plans: plan, simulated ms and ratio to the chosen; `plans` are (description, simulated
    ms), the chosen first; "" without ties."""
    if len(plans) < 2:
        return ""
    shown, more = plans[:limit], len(plans) - limit
    chosen_ms = shown[0][1]
    labels = [description + (" (chosen)" if i == 0 else "") for i, (description, _) in enumerate(shown)]
    width = max(len("plan"), *map(len, labels))
    busy = f", above {ties.NOISY_SPREAD:.0%}: a busy machine" if ties.noisy(spread) else ""
    lines = [f"The planner's ties: simulated within its profile's spread ({spread:.1%}{busy}) of its choice, so "
             "noise orders them:",
             f"  {'plan':{width}s} {'sim ms':>8s} {'/ chosen':>8s}"]
    for label, (_, ms) in zip(labels, shown):
        lines.append(f"  {label:{width}s} {ms:8.2f} {ms / chosen_ms if chosen_ms > 0 else float('nan'):8.2f}")
    if more > 0:
        lines.append(f"  and {more} more")
    return "\n".join(lines)

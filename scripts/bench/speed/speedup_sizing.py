"""How much the speed benchmark (scripts/bench/speed/speedup.py) measures: which plans, how many timing rounds and
steps, sized from a measured single step to a time budget (pure Python, no TensorFlow).

Plans: without --plans or --full, `single`, `dp<N>`, `straight2-M4`, `straight2-M8` and `planner` (REQUIRED: the
baseline every budget line's measured speedup is over, data parallel, a pipeline at two M and the planner's choice),
then, in the order of EXTRAS, `single-M8` (the runtime's own check of the budget line's slices factor: one worker at
M=8 over M=1), `straight2-M2`, `gpipe2-M8` and `straight2-M8-batched-w`, each only while every plan chosen still gets
MAX_ROUNDS rounds within the budget (plans the flags leave out, e.g. --gpipe=false, are skipped). `--full`: every
plan of scripts/bench/speed/speedup_plans.py and the peers (the bench's default before 2026-12-07, 40 plans on 2
workers).
Rounds: the most between MIN_ROUNDS and MAX_ROUNDS that the budget's time left holds; steps: DEFAULT_STEPS (the
`--rounds=10 --steps=3` of WORKSPACE_NOTES' convention). Explicit --plans, --rounds and --steps win.

The estimate is arithmetic in units of the single step t (the slowest plan, about): per plan, BUILD_STEPS t to build
and trace it (its graph, session, warm-up and traced step), START_STEPS t to start its session for the timing and,
each round, (1 + steps) t (one warm-up step and the timed ones), FINISH_STEPS t for its row; each peer run
PEER_RUN_S plus (warm-up + rounds x steps) t. The chief sizes once from the profile's whole step before building
(plans and rounds), and again from the plans' measured steps after building (rounds); while timing, unless --rounds
was given, it starts no round after the MIN_ROUNDS-th that would end past the budget less after_timing_s.
"""

import dataclasses
from typing import List, Optional, Sequence, Tuple

from scripts.bench.speed import speedup_peers

DEFAULT_BUDGET_MINUTES = 6.0  # a machine 3.5x slower than the development one stays within 10 minutes
MIN_ROUNDS, MAX_ROUNDS, DEFAULT_STEPS = 3, 10, 3
BUILD_STEPS, START_STEPS, FINISH_STEPS = 6.0, 4.0, 1.0
PEER_RUN_S, PEER_WARMUP_STEPS = 30.0, 3
EXTRAS = ("single-M8", "straight2-M2", "gpipe2-M8", "straight2-M8-batched-w")


def required_plans(num_workers: int) -> Tuple[str, ...]:
    return ("single", f"dp{num_workers}", "straight2-M4", "straight2-M8", "planner")


def default_plans(num_workers: int, available: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(the plans always measured, the extras in order) of the default set, among the `available` names."""
    return ([p for p in required_plans(num_workers) if p in available], [p for p in EXTRAS if p in available])


def plan_choice(names: Optional[Sequence[str]], full: bool, num_workers: int) -> Tuple[Optional[List[str]], List[str]]:
    """(the chief's plan names, None for its own choice: every plan with --full, else the default set; the peer kinds
    to run after): those named in --plans, else every peer with --full, none by default."""
    if names:
        return speedup_peers.split_plans(names, num_workers)
    return None, list(speedup_peers.KINDS) if full else []


def estimate_s(num_plans: int, rounds: int, steps: int, step_s: float, built: bool = False,
               peer_runs: int = 0) -> float:
    """Seconds to build and trace `num_plans` plans (unless `built`), time them in `rounds` rounds of `steps` steps,
    write their rows and run `peer_runs` peer runs of rounds x steps steps, for a step of `step_s` seconds."""
    per_plan = (0.0 if built else BUILD_STEPS) + START_STEPS + rounds * (1 + steps) + FINISH_STEPS
    return num_plans * per_plan * step_s + peer_runs * (PEER_RUN_S + (PEER_WARMUP_STEPS + rounds * steps) * step_s)


def after_timing_s(num_plans: int, rounds: int, steps: int, step_s: float, peer_runs: int = 0) -> float:
    """Of estimate_s, what follows the timing rounds: the plans' rows and the peer runs."""
    return estimate_s(num_plans, rounds, steps, step_s, True, peer_runs) - num_plans * (
        START_STEPS + rounds * (1 + steps)) * step_s


def stop_timing(done: int, rounds: int, elapsed_s: float, now: float, deadline: Optional[float]) -> bool:
    """Whether to stop after `done` of `rounds` timing rounds that took `elapsed_s`: at least MIN_ROUNDS done, and
    another round, as long as their mean, would end past `deadline` (None: never)."""
    return (deadline is not None and MIN_ROUNDS <= done < rounds and now + elapsed_s / done > deadline)


@dataclasses.dataclass(frozen=True)
class Sizing:
    plans: List[str]
    rounds: int
    steps: int
    estimate_s: float  # by estimate_s, from now to the end
    left_s: float  # of the budget

    @property
    def over_budget(self) -> bool:
        return self.estimate_s > self.left_s

    def text(self, step_s: float, budget_minutes: float, measured_by: str, plans: bool = True) -> str:
        """One line: what was chosen (the plans' names if `plans`), the estimate and the budget's time left."""
        from scripts.bench.harness import duration_text  # pylint: disable=import-outside-toplevel

        what = f"{len(self.plans)} plans ({', '.join(self.plans)}), " if plans else ""
        over = ("; over the budget by this estimate (what the flags asked for, or the least the default set "
                f"measures: {MIN_ROUNDS} rounds)" if self.over_budget else "")
        return (f"{what}{self.rounds} rounds of {self.steps} steps: ~{duration_text(self.estimate_s)} more by a "
                f"{step_s * 1e3:.0f} ms step ({measured_by}), {duration_text(max(0.0, self.left_s))} left of the "
                f"{budget_minutes:g}-minute budget{over}")


def size_run(step_s: float, left_s: float, required: Sequence[str], extras: Sequence[str] = (),
             rounds: Optional[int] = None, steps: Optional[int] = None, built: bool = False,
             peer_runs: int = 0) -> Sizing:
    """The plans (all of `required`, then those of `extras` in order while every plan still gets MAX_ROUNDS rounds
    within `left_s`), the rounds (the most in MIN_ROUNDS..MAX_ROUNDS within `left_s`, at least MIN_ROUNDS) and
    the steps (DEFAULT_STEPS) for a single step of `step_s` seconds; `rounds` and `steps` when given win (pass
    explicit --plans as `required` without extras)."""
    steps = steps or DEFAULT_STEPS
    plans = list(required)

    def fits(count: int, r: int) -> bool:
        return estimate_s(count, r, steps, step_s, built, peer_runs) <= left_s

    for extra in extras:
        if not fits(len(plans) + 1, rounds or MAX_ROUNDS):
            break
        plans.append(extra)
    if rounds is None:
        rounds = next((r for r in range(MAX_ROUNDS, MIN_ROUNDS - 1, -1) if fits(len(plans), r)), MIN_ROUNDS)
    return Sizing(plans, rounds, steps, estimate_s(len(plans), rounds, steps, step_s, built, peer_runs), left_s)

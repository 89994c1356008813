"""scripts/bench/speed/speedup_sizing.py: which plans, rounds and steps the speed bench measures for a given single
step and time budget (plain numbers, nothing run or timed), and the speed bench's choice between --plans, --full and
the default set (speedup_chief.sized)."""

import types

import pytest

from planner.formats import layer_cost_pb2
from planner.formats.cluster import local_task_cluster
from planner.formats.model_profile import ModelProfile
from scripts.bench.speed import speedup_chief, speedup_peers, speedup_plans
from scripts.bench.speed.speedup_sizing import (EXTRAS, MAX_ROUNDS, MIN_ROUNDS, after_timing_s, default_plans,
                                                estimate_s, plan_choice, required_plans, size_run, stop_timing)

REQUIRED = list(required_plans(2))
FAST_S, SLOW_S = 0.25, 0.9  # the default MLP's single step here and on a machine 3.5x slower
FAST_LEFT_S, SLOW_LEFT_S = 6 * 60 - 70, 6 * 60 - 230  # the budget after each one's setup (launch, profiles, probes)


def test_a_fast_step_gets_every_extra_plan_and_the_most_rounds():
    sizing = size_run(FAST_S, FAST_LEFT_S, REQUIRED, EXTRAS)
    assert sizing.plans == REQUIRED + list(EXTRAS)
    assert (sizing.rounds, sizing.steps) == (MAX_ROUNDS, 3)
    assert sizing.estimate_s == estimate_s(9, MAX_ROUNDS, 3, FAST_S) <= FAST_LEFT_S and not sizing.over_budget


def test_a_slow_step_gets_the_required_plans_and_fewer_rounds_within_the_budget():
    sizing = size_run(SLOW_S, SLOW_LEFT_S, REQUIRED, EXTRAS)
    assert sizing.plans == REQUIRED == ["single", "dp2", "straight2-M4", "straight2-M8", "planner"]
    assert sizing.rounds == 4  # 5 plans x (6 + 4 + 4 x 4 + 1) x 0.9 s = 121.5 s; 5 rounds: 139.5 s
    assert sizing.estimate_s == pytest.approx(121.5) and sizing.estimate_s <= SLOW_LEFT_S
    assert estimate_s(5, 5, 3, SLOW_S) > SLOW_LEFT_S


def test_extras_stop_at_the_first_that_would_cut_the_rounds():
    left = estimate_s(6, MAX_ROUNDS, 3, 0.5) + 1  # room for one extra at the most rounds, not two
    sizing = size_run(0.5, left, REQUIRED, EXTRAS)
    assert sizing.plans == REQUIRED + ["single-M8"] and sizing.rounds == MAX_ROUNDS


def test_no_time_left_still_measures_the_required_plans_at_the_fewest_rounds_and_says_it_is_over():
    sizing = size_run(3.0, 50, REQUIRED, EXTRAS)
    assert sizing.plans == REQUIRED and sizing.rounds == MIN_ROUNDS and sizing.over_budget
    assert "over the budget by this estimate" in sizing.text(3.0, 6, "the profile")


def test_explicit_plans_rounds_and_steps_win():
    sizing = size_run(SLOW_S, 10, ["dp2", "gpipe2-M4"], rounds=2, steps=5)
    assert (sizing.plans, sizing.rounds, sizing.steps) == (["dp2", "gpipe2-M4"], 2, 5)
    assert size_run(FAST_S, FAST_LEFT_S, REQUIRED, EXTRAS, rounds=2).plans == REQUIRED + list(EXTRAS)
    assert size_run(FAST_S, FAST_LEFT_S, REQUIRED, EXTRAS, steps=10).steps == 10


def test_sizing_again_after_building_leaves_the_build_out_and_counts_the_peers():
    assert estimate_s(5, 4, 3, 1.0, built=True) == 5 * (4 + 16 + 1)
    assert estimate_s(5, 4, 3, 1.0, peer_runs=2) == estimate_s(5, 4, 3, 1.0) + 2 * (30 + 3 + 12)
    assert size_run(1.0, estimate_s(5, 7, 3, 1.0, built=True), REQUIRED, built=True).rounds == 7


def test_the_text_names_what_was_chosen_and_the_budget():
    sizing = size_run(FAST_S, FAST_LEFT_S, REQUIRED)
    assert sizing.text(FAST_S, 6, "the profile") == (
        "5 plans (single, dp2, straight2-M4, straight2-M8, planner), 10 rounds of 3 steps: ~1m04s more by a 250 ms "
        "step (the profile), 4m50s left of the 6-minute budget")
    assert sizing.text(FAST_S, 6, "measured", plans=False).startswith("10 rounds of 3 steps: ~1m04s")


def test_the_default_set_skips_plans_the_flags_left_out():
    available = ["single", "single-M8", "dp2", "straight2-M4", "straight2-M8", "straight2-M2", "planner"]
    assert default_plans(2, available) == (REQUIRED, ["single-M8", "straight2-M2"])
    assert default_plans(4, available)[0] == ["single", "straight2-M4", "straight2-M8", "planner"]


def _toy_profile(batch_size=1024, layers=9):
    profile = layer_cost_pb2.LayerCostProfile(model_name="toy", batch_size=batch_size)
    for i in range(layers):
        profile.layers.add(name=f"l{i}", index=i, forward_ms=1.0, backward_ms=2.0, activation_bytes=1e6,
                           parameter_bytes=4e6)
    return ModelProfile.from_proto(profile)


def _flags(**given):
    return types.SimpleNamespace(**{"plans": None, "full": False, "rounds": None, "steps": None, "peer_runs": 0,
                                    **given})


def test_full_measures_the_old_default_set_every_plan_and_the_peers():
    model = _toy_profile()
    plans = speedup_plans.bench_plans(model, local_task_cluster(2, 1), 1024, 2, [1, 2, 4, 8, 16])
    plans.append(speedup_plans.BenchPlan("planner", plans[0].proto))
    assert len(plans) == 40
    full = speedup_chief.sized(_flags(full=True), plans, 2, SLOW_S, 0)
    assert full.plans == [p.name for p in plans] and full.rounds == MIN_ROUNDS and full.over_budget
    assert plan_choice(None, True, 2) == speedup_peers.split_plans(None, 2) == (None, ["mwms", "horovod"])
    default = speedup_chief.sized(_flags(), plans, 2, FAST_S, FAST_LEFT_S)
    assert default.plans == REQUIRED + list(EXTRAS)
    assert plan_choice(None, False, 2) == (None, [])
    named = speedup_chief.sized(_flags(plans=["planner", "dp2"], rounds=2), plans, 2, SLOW_S, 0)
    assert (named.plans, named.rounds) == (["dp2", "planner"], 2)
    assert plan_choice(["dp2", "mwms2"], False, 2) == (["dp2"], ["mwms"])
    with pytest.raises(ValueError, match="no plan named straight9-M4"):
        speedup_chief.sized(_flags(plans=["straight9-M4"]), plans, 2, SLOW_S, 0)


def test_after_timing_is_the_rows_and_the_peers():
    assert after_timing_s(5, 4, 3, 1.0) == pytest.approx(5 * 1.0)
    assert after_timing_s(5, 4, 3, 1.0, peer_runs=2) == pytest.approx(5 + 2 * (30 + 3 + 12))


def test_timing_stops_when_another_round_would_end_past_the_deadline_but_not_before_the_fewest_rounds():
    assert not stop_timing(5, 10, 50.0, now=100.0, deadline=111.0)  # 10 s a round: ends at 110
    assert stop_timing(5, 10, 50.0, now=100.0, deadline=109.0)
    assert not stop_timing(MIN_ROUNDS - 1, 10, 50.0, now=100.0, deadline=0.0)
    assert not stop_timing(10, 10, 50.0, now=100.0, deadline=0.0)  # the last round: nothing to stop
    assert not stop_timing(5, 10, 50.0, now=100.0, deadline=None)  # --rounds given

"""Plans simulated within the profile's spread of the chosen one are reported as ties (planner/planning/ties.py):
on the published BERT-48 profile with a spread set by hand, by the DAPPLE planner's selection by simulation and by
plan_from_profiles; none without a spread."""

import pytest

from planner.formats.cluster import preset_cluster
from planner.formats.model_profile import ModelProfile
from planner.formats.profile import load_profile
from planner.planning import ties
from planner.planning.api import plan, plan_from_profiles
from planner.planning.report import summarize
from tests.shared_profiles import PROFILES

BERT = PROFILES + "bert-48-pbs-2.txt"


def _bert(spread: float):
    profile = load_profile(BERT)
    profile.relative_spread = spread
    return profile


def _by_simulation(spread: float):
    return plan(_bert(spread), preset_cluster("paper_a"), 64, simulate=True, profile_memory="11.4GB",
                select="simulation", micro_batch_sizes=[8, 16], schedules=("dapple",))


def test_candidates_within_the_spread_are_ties_and_the_report_says_so():
    without = _by_simulation(0.0)
    assert not without.ties and without.profile_spread == 0.0 and "ties:" not in summarize(without)
    chosen = _by_simulation(0.05)
    assert (chosen.num_micro_batches, chosen.simulated_iteration_ms) == (without.num_micro_batches,
                                                                        pytest.approx(without.simulated_iteration_ms))
    assert chosen.profile_spread == 0.05 and chosen.ties
    fastest = chosen.simulated_iteration_ms
    assert all(fastest <= t.simulated_iteration_ms <= fastest * 1.05 for t in chosen.ties)
    assert [t.simulated_iteration_ms for t in chosen.ties] == sorted(t.simulated_iteration_ms for t in chosen.ties)
    assert ties.describe(chosen) not in [t.description for t in chosen.ties]
    wider = _by_simulation(0.20)
    assert len(wider.ties) > len(chosen.ties)  # more candidates fall within a wider spread
    report = summarize(chosen)
    assert "  ties: simulated within the profile's spread (5.0%) of this plan's" in report
    assert f"{chosen.ties[0].description} ({chosen.ties[0].simulated_iteration_ms:.2f} ms)" in report


def test_plans_from_several_profiles_take_the_largest_spread():
    profiles = {size: ModelProfile.from_proto(_bert(spread)) for size, spread in ((2, 0.01), (4, 0.08))}
    chosen = plan_from_profiles(profiles, preset_cluster("paper_a"), 64, profile_memory="11.4GB",
                                select="simulation", micro_batch_sizes=[8, 16], schedules=("dapple",))
    assert chosen.profile_spread == 0.08 and chosen.simulated_iteration_ms > 0
    assert all(chosen.simulated_iteration_ms <= t.simulated_iteration_ms <= chosen.simulated_iteration_ms * 1.08
               for t in chosen.ties)


def test_tied_lists_only_plans_within_the_spread():
    others = [("a", 103.0), ("b", 110.0), ("c", 101.0)]
    assert ties.tied(100.0, others, 0.05) == [("c", 101.0), ("a", 103.0)]
    assert ties.tied(100.0, others, 0.0) == []

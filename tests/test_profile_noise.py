"""A profile measured on a busy machine (its whole step's spread over the rounds above 20%) is said so where it
matters: dapple_profile's one warning line (profiler/rounds.py noise_warning), and the planner's report naming the
plans whose order that spread can change, under either selection (planner/planning/ties.py); nothing of it on a
quiet profile."""

import pytest

from planner.formats import layer_cost_pb2, plan_pb2, write_message
from planner.formats.cluster import preset_cluster
from planner.formats.profile import load_profile
from planner.planning import ties
from planner.planning.api import plan
from planner.planning.report import summarize
from profiler.rounds import noise_warning
from tests.programs import run_program
from tests.shared_profiles import PROFILES, requires_profiles

VGG = PROFILES + "vgg-19-pbs-32.txt"
NOISY_NOTE = "above 20%: measured on a busy machine; profile again on a quiet one"


def _profile(batch_size: int, spread: float) -> layer_cost_pb2.LayerCostProfile:
    return layer_cost_pb2.LayerCostProfile(model_name="m", batch_size=batch_size, timing_rounds=5,
                                           relative_spread=spread)


def test_a_spread_above_20_percent_makes_one_warning_line():
    assert noise_warning({32: _profile(32, 1.34)}, runs=2) == (
        "warning: the whole step at batch 32 spread 134% across its 5 rounds (above 20%): the machine was busy, and "
        "the planner will take plans within 134% of each other as ties; profile again on a quiet machine, or with "
        "more --runs per measurement (now 2)")


def test_several_sizes_warn_once_for_the_noisiest():
    warning = noise_warning({8: _profile(8, 0.05), 4: _profile(4, 0.31), 16: _profile(16, 0.25)}, runs=3)
    assert warning.startswith("warning: the whole step at batch 4 spread 31% across its 5 rounds (above 20%)")
    assert warning.endswith("(now 3)") and "\n" not in warning


@pytest.mark.parametrize("spread", [0.0, 0.1, 0.2])
def test_no_warning_at_or_under_20_percent(spread):
    assert noise_warning({32: _profile(32, spread)}, runs=2) == ""
    assert noise_warning({}, runs=2) == ""


def _tied_plan(spread: float, tied_ms) -> plan_pb2.Plan:
    chosen = plan_pb2.Plan(simulated_iteration_ms=100.0)
    ties.record(chosen, spread, [(f"plan {i}", ms) for i, ms in enumerate(tied_ms)])
    return chosen


def test_the_ties_line_names_a_few_and_counts_the_rest():
    assert ties.text(_tied_plan(1.34, [101.0, 150.0, 180.0, 200.0, 230.0])) == (
        f"  ties: simulated within the profile's spread (134.0%, {NOISY_NOTE}) of this plan's 100.00 ms, so their "
        "order is the measurement's noise: plan 0 (101.00 ms); plan 1 (150.00 ms); plan 2 (180.00 ms); and 2 more")
    assert ties.text(_tied_plan(0.05, [101.0])) == (
        "  ties: simulated within the profile's spread (5.0%) of this plan's 100.00 ms, so their order is the "
        "measurement's noise: plan 0 (101.00 ms)")
    assert ties.text(_tied_plan(1.34, [])) == (
        f"  ties: no other plan simulated within the profile's spread (134.0%, {NOISY_NOTE}) of this plan's 100.00 ms")
    assert ties.text(_tied_plan(0.1, [])) == ""


def _vgg(spread: float) -> plan_pb2.Plan:
    profile = load_profile(VGG)
    profile.relative_spread = spread
    return plan(profile, preset_cluster("paper_b"), 256, simulate=True)


# ~2 s: VGG-19 on 16 devices, chosen by L (the default), quiet and noisy
@requires_profiles
def test_a_noisy_profile_names_the_plans_its_spread_cannot_order():
    quiet, noisy = _vgg(0.1), _vgg(1.34)
    assert not quiet.ties and quiet.profile_spread == 0.0 and "ties:" not in summarize(quiet)
    assert [list(s.device_ids) for s in noisy.stages] == [list(s.device_ids) for s in quiet.stages]
    assert noisy.num_micro_batches == quiet.num_micro_batches  # still chosen by L
    assert noisy.profile_spread == pytest.approx(1.34) and len(noisy.ties) > ties.SHOWN
    mine = noisy.simulated_iteration_ms
    assert all(0 < t.simulated_iteration_ms <= mine * 2.34 for t in noisy.ties)
    assert [t.simulated_iteration_ms for t in noisy.ties] == sorted(t.simulated_iteration_ms for t in noisy.ties)
    assert ties.describe(noisy) not in [t.description for t in noisy.ties]
    line = next(line for line in summarize(noisy).splitlines() if line.startswith("  ties:"))
    first = noisy.ties[0]
    assert line.startswith(f"  ties: simulated within the profile's spread (134.0%, {NOISY_NOTE}) of this plan's "
                           f"{mine:.2f} ms, so their order is the measurement's noise: {first.description} "
                           f"({first.simulated_iteration_ms:.2f} ms); ")
    assert line.endswith(f"; and {len(noisy.ties) - ties.SHOWN} more")


# ~3 s: dapple_plan on a noisy copy of the VGG-19 profile
@requires_profiles
def test_dapple_plan_reports_a_noisy_profiles_ties(tmp_path):
    profile = load_profile(VGG)
    profile.relative_spread = 1.34
    path = str(tmp_path / "vgg-noisy.pbtxt")
    write_message(profile, path)
    result = run_program("dapple_plan", f"--profile={path}", "--global_batch_size=256", "--cluster=paper_b")
    assert result.returncode == 0, result.stderr
    assert f"  ties: simulated within the profile's spread (134.0%, {NOISY_NOTE}) of this plan's" in result.stdout
    assert "; and " in result.stdout

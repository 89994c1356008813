"""The objective (formula 2's L) with the simulator as a check, the opt-in selection among the DAPPLE
search's best candidates by simulated time (planner/planning/api.py), the
TopK collector it uses, and the large-cluster approximations of planner/planning/dapple_planner.py."""

import warnings

import pytest

from planner.planning import cost_model as cm
from planner.planning.api import PerSizeTop, SimulationDisagreement, best_estimate, micro_batch_sizes, plan, plan_all
from planner.formats.cluster import preset_cluster
from planner.planning.dapple_planner import TopK, coarsen_cuts, replication_candidates
from planner.planning.plan_eval import Estimate, Options
from planner.formats.model_profile import ModelProfile
from planner.formats.profile import load_profile
from planner.formats.memory_figures import parse_size
from planner.planning.report import summarize
from planner.formats.schedule import schedule_kind
from planner.planning.schedule_choice import weigh_schedules
from planner.formats import plan_pb2
from planner.simulation.sim_adapter import simulate_plan
from tests.shared_profiles import PROFILES



BERT = PROFILES + "bert-48-pbs-2.txt"


def test_latency_is_the_objective_and_simulation_checks_it():
    # The paper's objective (formula 2's L, with the pivot's wait) chooses; the simulator only
    # checks. On BERT-48 / config A they agree within 2.3%: no warning.
    profile = load_profile(BERT)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SimulationDisagreement)
        by_l = plan(profile, preset_cluster("paper_a"), 64, simulate=True, profile_memory="11.4GB",
                    schedules=("dapple",))
    assert by_l.num_micro_batches == 8
    assert by_l.estimated_iteration_ms == pytest.approx(781.8, abs=0.1)
    assert by_l.simulated_iteration_ms == pytest.approx(800.0, abs=0.1)
    # (micro-batches of 8 and 16 only: each size's pool is searched without the other sizes' bound)
    by_sim = plan(profile, preset_cluster("paper_a"), 64, simulate=True, profile_memory="11.4GB", select="simulation",
                  micro_batch_sizes=[8, 16], schedules=("dapple",))
    assert by_sim.num_micro_batches == 8 and by_sim.simulated_iteration_ms == pytest.approx(800.0, abs=0.1)
    # Forced to M=2 on config B, L misses some of the pivot's waits: the check says so, naming Ts.
    with pytest.warns(SimulationDisagreement, match=r"\(\+9\.2%\): the steady Ts phase differs most"):
        forced = plan(profile, preset_cluster("paper_b"), 64, simulate=True, profile_memory="11.4GB",
                      micro_batch_sizes=[32])
    assert [len(s.device_ids) for s in forced.stages] == [4, 4, 8]


def test_the_plan_runs_the_fastest_schedule_that_fits():
    """The chosen stages simulated under DAPPLE's 1F1B, the zero-bubble schedules and interleaved (its variant with
    two stages per device group): BERT-48 8:8, M=8 on config A runs zb-h2 (0.92x of 1F1B's simulated iteration;
    interleaved 0.94x); with less memory zb-h2 no longer fits, zb-h1 (1F1B's peak memory) does."""
    profile = load_profile(BERT)
    chosen = plan(profile, preset_cluster("paper_a"), 64, simulate=True, profile_memory="11.4GB")
    estimates = {schedule_kind(e.schedule): (round(e.simulated_iteration_ms, 1), e.fits)
                 for e in chosen.schedule_estimates}
    assert estimates == {"dapple": (800.0, True), "zb-h1": (741.1, True), "zb-h2": (734.5, True),
                         "interleaved": (755.1, True)}
    assert schedule_kind(chosen.schedule) == "zb-h2" and chosen.simulated_iteration_ms == pytest.approx(734.45, abs=0.01)
    assert [s.warmup_micro_batches for s in chosen.stages] == [2, 1]  # DAPPLE's K_i, zb-h1's bounds
    assert "  zb-h2          734.45 ms (0.92x dapple), peak 9.74 GiB  <- chosen" in summarize(chosen)
    peaks = {schedule_kind(e.schedule): e.peak_memory_bytes for e in chosen.schedule_estimates}
    assert peaks["zb-h1"] <= peaks["dapple"] < peaks["zb-h2"]
    # a device just below zb-h2's peak: zb-h2 does not fit, zb-h1 is chosen
    tight = plan_pb2.Plan()
    tight.CopyFrom(chosen)
    tight.cluster.device_memory_bytes = (peaks["dapple"] + peaks["zb-h2"]) / 2
    weigh_schedules(tight, ModelProfile.from_proto(profile, parse_size("11.4GB")))
    assert [e.fits for e in tight.schedule_estimates] == [True, True, False, False]  # interleaved: 9.26 GiB
    assert schedule_kind(tight.schedule) == "zb-h1"


def test_simulation_selection_weighs_every_schedule_per_candidate():
    """select="simulation" ranks each candidate by its fastest fitting schedule: never slower than ranking them by
    1F1B alone, and the chosen plan runs the schedule it was ranked by."""
    profile = load_profile(BERT)
    options = dict(simulate=True, profile_memory="11.4GB", select="simulation", micro_batch_sizes=[8, 16])
    dapple_only = plan(profile, preset_cluster("paper_a"), 64, schedules=("dapple",), **options)
    weighed = plan(profile, preset_cluster("paper_a"), 64, **options)
    fitting = [e.simulated_iteration_ms for e in weighed.schedule_estimates if e.fits]
    assert weighed.simulated_iteration_ms == pytest.approx(min(fitting))
    assert weighed.simulated_iteration_ms < dapple_only.simulated_iteration_ms == pytest.approx(800.0, abs=0.1)
    assert schedule_kind(weighed.schedule) != "dapple"


def test_simulated_choice_not_worse_than_baselines_vgg_c():
    plans = plan_all(load_profile(PROFILES + "vgg-19-pbs-32.txt"), preset_cluster("paper_c"), 2048,
                     profile_memory="5.6GB", select="simulation", schedules=("dapple",))
    best = plans["dapple"].simulated_iteration_ms
    assert best == pytest.approx(631.2, abs=0.1)  # 15:1, M=4 (L 630.6 ms)
    sims = {k: p.simulated_iteration_ms for k, p in plans.items() if k != "dapple" and not isinstance(p, str)}
    assert set(sims) == {"dp", "dp_overlap", "straight", "pipedream"}  # gpipe (M in flight) does not fit
    assert "fits no gpipe plan" in plans["gpipe"]
    assert min(sims.values()) > best
    assert sims["pipedream"] == pytest.approx(960.9, abs=0.1)  # 15:1 at M=32, its own partition


def test_simulation_pool_holds_every_micro_batch_size():
    # Each micro-batch size keeps its own 8 best plans: a better plan found at an earlier size
    # must not empty the pool of a later one (it did: the bound carried over between sizes).
    model = ModelProfile.from_proto(load_profile(PROFILES + "gnmt-16-pbs-64.txt"), 3.9e9)
    top = PerSizeTop(8)
    best_estimate("dapple", model, cm.Prefix(model), preset_cluster("paper_b"), 1024, Options(),
                  micro_batch_sizes(1024), float("inf"), top)
    # Sizes 1..4: at most that many devices per stage, no plan uses all 16 devices in time.
    assert {m: len(t.plans) for m, t in top.tops.items()} == {
        1: 0, 2: 0, 4: 0, 8: 8, 16: 8, 32: 8, 64: 8, 128: 8, 256: 8, 512: 8, 1024: 8}


def _est(latency, mbs, devs):
    return Estimate(stages=[(0, 1, devs)], micro_batch_size=mbs, num_micro_batches=1, forward=[], backward=[],
                    allreduce=[], allreduce_tail=[], comm=[], latency=latency, warmup=0, steady=0, ending=0,
                    pivot=0, acr=0, policy="A", warmup_counts=[1], device_memory=[], violation=None)


def test_topk_keeps_k_distinct_lowest():
    top = TopK(2, limit=100.0)
    assert top.bound() == 100.0
    top.offer(_est(150.0, 1, (0,)))  # above the limit
    top.offer(_est(50.0, 1, (0,)))
    top.offer(_est(50.0, 1, (0,)))  # the same plan again
    assert [e.latency for e in top.plans] == [50.0] and top.bound() == 100.0
    top.offer(_est(70.0, 2, (0,)))
    top.offer(_est(60.0, 1, (0, 1)))
    assert [e.latency for e in top.plans] == [50.0, 60.0] and top.bound() == 60.0
    bad = _est(10.0, 4, (0,))
    bad.violation = "too big"
    top.offer(bad)
    assert [e.latency for e in top.plans] == [50.0, 60.0]


def test_large_cluster_replication_candidates():
    assert replication_candidates(16, 8) == list(range(1, 16))
    assert replication_candidates(1024, 8) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768]


def test_coarsen_cuts_even_by_compute():
    model = ModelProfile(name="c", names=[f"l{i}" for i in range(9)], descriptions=[""] * 9,
                         forward_ms=[1.0] * 9, backward_ms=[1.0] * 9, activation_bytes=[1.0] * 9,
                         parameter_bytes=[1.0] * 9, inputs=[[i - 1] if i else [] for i in range(9)],
                         last_use=[i + 1 if i < 8 else i for i in range(9)])
    prefix = cm.Prefix(model)
    cuts = list(range(1, 9))
    assert coarsen_cuts(prefix, cuts, 8) == cuts
    assert coarsen_cuts(prefix, cuts, 2) == [3, 6]

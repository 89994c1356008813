"""The paper's Table 4 plan shapes on the shipped profiles (16 devices, the paper's batches),
planned as the CLI does: the DAPPLE search's best candidates chosen by simulated time
(planner/api.py, simulate=True); and the paper's ACR values on the paper's own plans.

Rows this cost model does not reproduce are xfail(strict=True) with the computed plan in the
reason (analytic L of formula 2 / simulated time, for the chosen plan and for the paper's plan),
so they start failing (XPASS) if the model changes to reproduce them.
"""

import functools

import pytest

from planner import cost_model as cm
from planner.api import plan
from planner.cluster import preset_cluster
from planner.plan_eval import Options, evaluate
from planner.profile import ModelProfile, load_profile
from tests.shared_profiles import PROFILES

GBS = {"vgg-19-pbs-32": 2048, "gnmt-16-pbs-64": 1024, "bert-48-pbs-2": 64}


@functools.lru_cache(maxsize=None)
def planned(model, cluster, gbs):
    profile = load_profile(PROFILES + model + ".txt")
    return profile, plan(profile, preset_cluster(cluster), gbs, simulate=True)


def shape(p):
    return [len(s.device_ids) for s in p.stages]


def split(profile, p, is_counted):
    """Counted layers (e.g. weight layers) per stage."""
    out = []
    for s in p.stages:
        out.append(sum(1 for l in profile.layers[s.first_layer:s.last_layer + 1] if is_counted(l)))
    return out


def weight_layer(l):
    return l.parameter_bytes > 0


def lstm_layer(l):
    return "LSTM" in l.description


def encoder_layer(l):
    return l.description.startswith("layer_")


def close(actual, expected):
    return len(actual) == len(expected) and all(abs(a - b) <= 1 for a, b in zip(actual, expected))


@pytest.mark.parametrize("cluster", ["paper_a", "paper_b"])
def test_vgg_dp(cluster):
    profile, p = planned("vgg-19-pbs-32", cluster, 2048)
    assert shape(p) == [16]
    assert p.estimated_iteration_ms == pytest.approx(590.8, abs=0.1)


def test_vgg_config_c_15_1():
    profile, p = planned("vgg-19-pbs-32", "paper_c", 2048)
    assert shape(p) == [15, 1]
    assert p.num_micro_batches == 4
    assert p.estimated_iteration_ms == pytest.approx(613.0, abs=0.1)
    assert p.simulated_iteration_ms == pytest.approx(680.3, abs=0.1)


def test_vgg_config_c_split_13_6():
    # Computed 14:5 weight layers (paper 13:6): the 15:1 concat moves 1/15 of a micro-batch per
    # link, so the split balances compute (the paper's 13:6 itself: best M=32, L 787.0 ms).
    profile, p = planned("vgg-19-pbs-32", "paper_c", 2048)
    assert close(split(profile, p, weight_layer), [13, 6])
    assert split(profile, p, weight_layer) == [14, 5]


def test_gnmt_config_a_8_8():
    profile, p = planned("gnmt-16-pbs-64", "paper_a", 1024)
    assert shape(p) == [8, 8]
    assert close(split(profile, p, lstm_layer), [9, 7])
    assert split(profile, p, lstm_layer) == [10, 6]  # M=16, L 261.0 ms, simulated 276.3 ms


@pytest.mark.xfail(strict=True, reason="computed 1:3:3:4:5 (M=32, L 413.2 ms, simulated 421.0 ms); the paper's "
                   "8:8 split 9:7 is at best L 656.8 / simulated 661.9 ms (M=16): each 8-device stage reduces "
                   "0.58 GB over 25 Gbps (AllReduce 370 and 281 ms); no AllReduce scaling makes it best "
                   "(AllReduce x0.5: 1:3:3:4:5 again, 358.6 ms simulated vs 476.9; x0.25: DP)")
def test_gnmt_config_b_8_8():
    profile, p = planned("gnmt-16-pbs-64", "paper_b", 1024)
    assert shape(p) == [8, 8]


@pytest.mark.xfail(strict=True, reason="computed 1:3:3:4:5 (M=16, L 571.8 ms, simulated 608.6 ms); straight "
                   "plans are bound by LSTM node92 (backward 31.0 ms at batch 64, other decoder LSTMs 8.5 ms): "
                   "the best straight L 709.3 / simulated 717.4 ms (M=64), one LSTM per device L 1033 ms; "
                   "see test_gnmt_profile_with_regular_last_lstm")
def test_gnmt_config_c_straight():
    profile, p = planned("gnmt-16-pbs-64", "paper_c", 1024)
    assert shape(p) == [1] * 16


def test_bert_config_a_8_8():
    profile, p = planned("bert-48-pbs-2", "paper_a", 64)
    assert shape(p) == [8, 8]
    assert close(split(profile, p, encoder_layer), [23, 25])
    # Computed 24:24 (M=8, L 781.8 ms, simulated 800.0 ms); the profile's layers are identical and
    # the embeddings have no backward time; the paper's 23:25: L 806.9 / simulated 816.9 ms.
    assert split(profile, p, encoder_layer) == [24, 24]


@pytest.mark.parametrize("cluster", ["paper_b", "paper_c"])
def test_bert_straight(cluster):
    profile, p = planned("bert-48-pbs-2", cluster, 64)
    assert shape(p) == [1] * 16
    assert sum(split(profile, p, encoder_layer)) == 48


# --- ACR (Table 4's last column) on the paper's own plans -----------------------------------

@functools.lru_cache(maxsize=None)
def model_of(name):
    return ModelProfile.from_proto(load_profile(PROFILES + name + ".txt"))


def paper_plan(name, config, first_stage_layers, devices, is_counted, mbs, **options):
    """2 stages: the first `first_stage_layers` counted layers on devices 0..devices-1."""
    model = model_of(name)
    n = model.num_layers
    counted = [i + 1 for i in range(n) if is_counted(model, i)]
    cut = counted[first_stage_layers - 1]
    stages = [(0, cut, tuple(range(devices))), (cut, n, tuple(range(devices, 16)))]
    return evaluate(model, cm.Prefix(model), preset_cluster(config), stages, GBS[name], mbs, Options(**options))


def straight_plan(name, config, per_stage, is_counted, mbs):
    model = model_of(name)
    n = model.num_layers
    counted = [i + 1 for i in range(n) if is_counted(model, i)]
    edges = [0] + [counted[k - 1] for k in range(per_stage, len(counted), per_stage)] + [n]
    stages = [(edges[i], edges[i + 1], (i,)) for i in range(len(edges) - 1)]
    return evaluate(model, cm.Prefix(model), preset_cluster(config), stages, GBS[name], mbs, Options())


def is_weight(m, i):
    return m.parameter_bytes[i] > 0


def is_lstm(m, i):
    return "LSTM" in m.descriptions[i]


def is_encoder(m, i):
    return m.descriptions[i].startswith("layer_")


def test_acr_bert_matches_the_paper():
    # Paper: A 0.06, B 0.50, C 1.25 (8:8 split 23:25; straight; straight).
    a = paper_plan("bert-48-pbs-2", "paper_a", 23, 8, is_encoder, 8)
    b = straight_plan("bert-48-pbs-2", "paper_b", 3, is_encoder, 8)
    c = straight_plan("bert-48-pbs-2", "paper_c", 3, is_encoder, 8)
    assert a.acr == pytest.approx(0.058, abs=0.001)
    assert b.acr == pytest.approx(0.466, abs=0.001)
    assert c.acr == pytest.approx(2.5 * b.acr)


def test_acr_links_are_per_device_pair():
    # GNMT-16 8:8 split 9:7 has ACR 0.10 on config A (the 8 pairs between two servers) and on
    # config B (8 pairs of servers): each pair has its own link. Ours: 0.198 on both (2x: the cut
    # after RecurrentAttention carries all five of its outputs, 308 KB per sample). With shared
    # NICs config A would be 8x config B.
    a = paper_plan("gnmt-16-pbs-64", "paper_a", 9, 8, is_lstm, 64)
    b = paper_plan("gnmt-16-pbs-64", "paper_b", 9, 8, is_lstm, 64)
    assert a.acr == pytest.approx(b.acr) and a.acr == pytest.approx(0.198, abs=0.001)
    shared = paper_plan("gnmt-16-pbs-64", "paper_a", 9, 8, is_lstm, 64, link_contention=True)
    assert shared.comm[0] == pytest.approx(8 * a.comm[0])
    # VGG-19 15:1 split 13:6: ACR 0.16 on config A (section 6.4) and 0.40 on config C, the ratio of
    # the links' bandwidths (25 vs 10 Gbps); ours 0.110 and 0.274.
    vgg_a = paper_plan("vgg-19-pbs-32", "paper_a", 13, 15, is_weight, 64)
    vgg_c = paper_plan("vgg-19-pbs-32", "paper_c", 13, 15, is_weight, 64)
    assert vgg_a.acr / vgg_c.acr == pytest.approx(10 / 25)
    assert vgg_c.acr == pytest.approx(0.274, abs=0.001)


def test_acr_picks_the_papers_policies():
    # Section 6.4: policy B for GNMT-16 (ACR 0.10), A for BERT-48 (0.06) on config A.
    assert paper_plan("gnmt-16-pbs-64", "paper_a", 9, 8, is_lstm, 64).policy == "B"
    assert paper_plan("bert-48-pbs-2", "paper_a", 23, 8, is_encoder, 8).policy == "A"


def test_gnmt_profile_with_regular_last_lstm():
    # The shipped GNMT-16 profile's last LSTM (node92) has a 31.0 ms backward at batch 64 where
    # the other decoder LSTMs have 8.5 ms. At 8.5 ms config A gives the paper's 8:8 split 9:7, and
    # config C a straight pipeline (15 stages: the 16th device doubles the empty input stage).
    profile = load_profile(PROFILES + "gnmt-16-pbs-64.txt")
    (last,) = [l for l in profile.layers if l.name == "node92"]
    assert last.backward_ms == pytest.approx(30.973)
    last.backward_ms = 8.485
    p = plan(profile, preset_cluster("paper_a"), 1024, simulate=True)
    assert shape(p) == [8, 8] and split(profile, p, lstm_layer) == [9, 7]
    assert p.estimated_iteration_ms == pytest.approx(250.4, abs=0.1)
    p = plan(profile, preset_cluster("paper_c"), 1024, simulate=True)
    weighted = [len(s.device_ids) for s in p.stages if s.parameter_bytes > 0]
    assert weighted == [1] * len(weighted) and len(p.stages) == 15
    assert p.simulated_iteration_ms == pytest.approx(452.8, abs=0.1)

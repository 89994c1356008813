"""Out-of-memory messages of planner/planning/api.py: the per-stage message of a planner's best
infeasible plan, and memory_error's "one stage per device" message for straight and dapple."""

from planner.planning.api import plan_all
from planner.formats.cluster import make_cluster
from planner.formats.profile import load_profile
from tests.shared_profiles import PROFILES

VGG = PROFILES + "vgg-19-pbs-32.txt"


def test_stage_and_straight_memory_messages():
    # 2 devices of 1.5 GiB: VGG's FC1 (1.46 GiB for one sample) fits alone, no 2-stage plan does.
    plans = plan_all(load_profile(VGG), make_cluster("t", 1, 2, 1.5 * 2**30, 1e9, 1e9), 32, simulate=False)
    assert plans["dp"] == ("the model fits no dp plan in memory: stage 0 (layers 0..25) needs 2.96 GiB on "
                           "device 0, 1.46 GiB over its 1.50 GiB")
    frugal = ("even with micro-batches of 1 and one stage per device (2 stages, policy A): stage 1 (layers 9..25) "
              "needs 2.40 GiB on device 1, 0.90 GiB over its 1.50 GiB")
    assert plans["straight"] == "the model fits no straight plan in memory: " + frugal
    assert plans["dapple"] == "the model fits no plan in memory: " + frugal

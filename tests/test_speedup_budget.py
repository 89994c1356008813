"""scripts/bench/speed/speedup_budget.py: the factors between a plan's ideal speedup and the simulated one."""

import pytest

from planner.formats.model_profile import ModelProfile
from scripts.bench.speed.speedup_budget import speedup_budget


def _model(forward, backward, backward_input=()):
    """Two layers with these per-sample times (ms)."""
    return ModelProfile("m", ["a", "b"], ["", ""], list(forward), list(backward), [1.0, 1.0], [1.0, 1.0],
                        [[], [0]], [1, 1], backward_input_ms=list(backward_input))


BATCH = _model([0.2, 0.2], [0.3, 0.3])  # 1.0 ms per sample at the whole batch


def test_pipeline_budget_multiplies_out():
    slices = _model([0.25, 0.25], [0.35, 0.35])  # 1.2 ms per sample in the plan's slices
    budget = speedup_budget(1.6, 2, slices, BATCH, 1.05, simulated_single_ms=100.0, simulated_ms=80.0)
    assert budget.slices == pytest.approx(1.2)
    assert budget.sharing == 1.05
    assert budget.after_compute == pytest.approx(1.6 / 1.2 / 1.05)
    assert budget.simulated == pytest.approx(1.25)
    assert budget.rest == pytest.approx(1.6 / 1.2 / 1.05 / 1.25)
    assert budget.text(1.2) == ("ideal 1.60 / slices 1.20 / sharing 1.05 = after compute 1.27; / transfers, AllReduce, "
                                "imbalance 1.02 = simulated 1.25; measured 1.20, 0.96 of simulated")
    assert budget.text(1.2, [1.0, 1.1, 1.2, 1.3, 1.4]).endswith("of simulated (rounds' middle half 1.05-1.35)")
    assert budget.text(1.2, [1.0, 1.1, 1.2]).endswith("measured 1.20, 0.96 of simulated")  # too few rounds for quartiles


def test_one_device_shares_nothing():
    budget = speedup_budget(1.0, 1, _model([0.3, 0.3], [0.3, 0.3]), BATCH, 1.05, 100.0, 120.0)
    assert (budget.sharing, budget.slices, budget.simulated) == (1.0, pytest.approx(1.2), pytest.approx(1 / 1.2))
    assert budget.rest == pytest.approx(1.0)


def test_stacked_weight_gradients_cost_at_the_stacked_rows():
    slices = _model([0.25, 0.25], [0.35, 0.35], backward_input=[0.15, 0.15])
    stacked = _model([0.2, 0.2], [0.2, 0.2], backward_input=[0.1, 0.1])  # W 0.1 per layer (0.2 in slices)
    budget = speedup_budget(1.0, 1, slices, BATCH, 1.0, 100.0, 100.0, stacked_model=stacked)
    assert budget.slices == pytest.approx(0.5 + 0.3 + 0.2)
    assert speedup_budget(1.0, 1, slices, BATCH, 1.0, 100.0, 100.0).slices == pytest.approx(1.2)


def test_no_simulated_step_is_an_error():
    with pytest.raises(ValueError, match="no speedup budget from simulated 0.0 ms"):
        speedup_budget(1.0, 1, BATCH, BATCH, 1.0, 100.0, 0.0)

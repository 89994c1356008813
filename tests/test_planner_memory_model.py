"""The planner's memory model (planner/planning/memory_model.py) and the kept bytes it counts
(planner/formats/memory_figures.py): from a step memory figure, from measured kept bytes, or the output-bytes lower
bound (with a warning)."""

import warnings

import pytest

from planner.planning import cost_model as cm
from planner.planning.api import MemoryLowerBoundWarning, PlanningError, plan
from planner.formats.cluster import make_cluster, preset_cluster
from planner.formats.memory_figures import MemoryInputError, kept_bytes_per_sample, parse_size, side_file_memory
from planner.planning.memory_model import stage_working_bytes
from planner.formats.model_profile import ModelProfile
from planner.formats.profile import load_profile
from planner.formats import plan_pb2
from tests.shared_profiles import PROFILES

BERT = PROFILES + "bert-48-pbs-2.txt"


def test_parse_size():
    assert parse_size("11.4GB") == pytest.approx(11.4e9)
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("4096") == 4096
    with pytest.raises(MemoryInputError, match=r"cannot read memory size '11\.4XB'"):
        parse_size("11.4XB")


def test_step_memory_spread_over_layers_by_output_bytes():
    # Table 1: BERT-48 11.4 GB at batch 2; weights + gradients 2 x 2.55 GB; the rest is what the
    # step keeps for backward, spread in proportion to each layer's output bytes.
    model = ModelProfile.from_proto(load_profile(BERT), 11.4e9)
    params = sum(model.parameter_bytes)
    assert model.memory_source == "step"
    assert 2 * sum(model.kept_bytes) == pytest.approx(11.4e9 - 2 * params)
    ratio = model.kept_bytes[10] / model.activation_bytes[10]
    assert all(k == pytest.approx(ratio * a) for k, a in zip(model.kept_bytes, model.activation_bytes))


def test_measured_kept_bytes_are_the_weights_of_the_spread():
    kept, source = kept_bytes_per_sample([10, 10], [30, 10], [0, 0], [False, False], 2, None)
    assert source == "measured" and kept == [15, 5]
    kept, source = kept_bytes_per_sample([10, 10], [30, 10], [5, 5], [False, False], 2, 100)
    assert source == "step" and kept == [(100 - 20) * 0.75 / 2, (100 - 20) * 0.25 / 2]


def test_backward_working_bytes_are_held_once_by_the_step_and_by_a_stage():
    # The step peak (100) holds 2 x weights (20), the largest backward's working bytes once (24) and
    # the kept bytes (56), spread 3:1.
    kept, source = kept_bytes_per_sample([10, 10], [30, 10], [5, 5], [False, False], 2, 100,
                                         working_bytes=[24, 8])
    assert source == "step" and kept == [56 * 0.75 / 2, 56 * 0.25 / 2]
    # more working than the step's activations leaves nothing to spread
    assert kept_bytes_per_sample([10], [30], [5], [False], 2, 100, working_bytes=[200])[0] == [0.0]
    # a stage needs one slice of its largest layer's working bytes per sample
    assert stage_working_bytes([12.0, 4.0, 30.0], 0, 2, 8) == 96.0 and stage_working_bytes([], 0, 0, 8) == 0.0


def test_the_profilers_step_peak_is_decomposed_in_time():
    # 3 layers at batch 2: kept shape 4:2:2, parameters 1, 1, 30 (P = 32), layer 0's backward works
    # with 30. During layer i's backward the step holds P, the gradients of layers i..2 (32, 31, 30),
    # c x the kept bytes of layers 0..i (4, 6, 8) and W_i: with a step peak of 100, layer 0's backward
    # binds, c = (100 - 32 - 32 - 30) / 4 = 1.5 (layer 2's backward then holds 32 + 30 + 12 = 74).
    args = ([0, 0, 0], [4, 2, 2], [1, 1, 30], [False] * 3, 2, 100)
    kept, source = kept_bytes_per_sample(*args, working_bytes=[30, 0, 0], measured_step=True)
    assert source == "step" and kept == pytest.approx([1.5 * 4 / 2, 1.5 * 2 / 2, 1.5 * 2 / 2])
    # a figure from outside takes every term as alive at once: (100 - 64 - 30) / 8 = 0.75, half
    kept, _ = kept_bytes_per_sample(*args, working_bytes=[30, 0, 0])
    assert kept == pytest.approx([0.75 * 4 / 2, 0.75 * 2 / 2, 0.75 * 2 / 2])
    # a step peak below P + G_0 + W_0 leaves nothing
    assert kept_bytes_per_sample(*args[:5], 90, working_bytes=[30, 0, 0], measured_step=True)[0] == [0.0] * 3


def test_a_stages_backward_working_bytes_count_beyond_what_its_later_layers_freed():
    # per sample: working 12, 4, 30; kept 5, 20, 1. While layer 0's backward runs, layers 1-2 have
    # freed 21 (12 - 21 < 0), layer 1's: 1 freed (4 - 1 = 3), layer 2's: nothing (30).
    assert stage_working_bytes([12.0, 4.0, 30.0], 0, 3, 8, [5.0, 20.0, 1.0]) == 8 * 30.0
    assert stage_working_bytes([12.0, 4.0, 30.0], 0, 2, 8, [5.0, 20.0, 1.0]) == 8 * 4.0
    assert stage_working_bytes([12.0, 4.0, 30.0], 1, 3, 8, [5.0, 20.0, 1.0]) == 8 * 30.0


def test_step_memory_below_the_weights_is_an_error():
    with pytest.raises(PlanningError, match=r"step memory 1 GB at batch 2 is not more than its weights and gradients"):
        plan(load_profile(BERT), preset_cluster("paper_a"), 64, profile_memory="1GB")


def test_no_memory_input_warns_once_that_memory_is_a_lower_bound():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan(load_profile(BERT), preset_cluster("paper_c"), 64)
    lower = [w for w in caught if issubclass(w.category, MemoryLowerBoundWarning)]
    assert len(lower) == 1 and "are a lower bound" in str(lower[0].message)


def test_memory_input_changes_what_fits():
    # Stage memory = (2 + 2) x params + K x slice x kept bytes: with Table 1's figure one BERT-48
    # sample keeps 3.14 GB, so data parallelism with slices of 2 no longer fits a 15 GiB V100.
    model = ModelProfile.from_proto(load_profile(BERT), 11.4e9)
    prefix = cm.Prefix(model)
    n = model.num_layers
    assert prefix.kept_per_sample(0, n) == pytest.approx((11.4e9 - 2 * sum(model.parameter_bytes)) / 2)
    need = cm.memory_bytes(prefix, 0, n, 2, 1)
    assert need == pytest.approx(4 * sum(model.parameter_bytes) + 11.4e9 - 2 * sum(model.parameter_bytes))
    assert need > 15 * 2**30


def test_side_file(tmp_path):
    profile = tmp_path / "m-pbs-2.txt"
    assert side_file_memory(str(profile)) is None
    (tmp_path / "m-pbs-2.txt.memory").write_text("3.9GB\n")
    assert side_file_memory(str(profile)) == pytest.approx(3.9e9)


def test_recompute_keeps_boundary_inputs_per_micro_batch_and_one_full_micro_batch():
    model = ModelProfile.from_proto(load_profile(BERT), 11.4e9)
    prefix = cm.Prefix(model)
    params = prefix.parameter_bytes(10, 20)
    largest = prefix.largest_layer_parameters(10, 20)
    plain = cm.memory_bytes(prefix, 10, 20, 2, 3, 2.0, num_micro_batches=8)
    rc = cm.memory_bytes(prefix, 10, 20, 2, 3, 2.0, num_micro_batches=8, recompute=True)
    assert plain == pytest.approx(4 * params + largest + 3 * 2 * prefix.kept_per_sample(10, 20))
    assert rc == pytest.approx(4 * params + largest + 3 * 2 * prefix.cut[10] + 2 * prefix.kept_per_sample(10, 20))


def test_recompute_is_chosen_when_nothing_fits_without_it():
    # BERT-48 (Table 1 memory) on 16 single-device servers of 4 GiB: no plan without
    # re-computation is found; with it, 8:2:2:2:2 at M=8, every backward recomputing its forward.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = plan(load_profile(BERT), make_cluster("t", 16, 1, 4 * 2**30, 3.125e9, 3.125e9), 64,
                 profile_memory="11.4GB")
    assert [len(s.device_ids) for s in p.stages] == [8, 2, 2, 2, 2] and p.num_micro_batches == 8
    assert all(s.recompute for s in p.stages)
    assert max(p.device_peak_memory_bytes) <= 4 * 2**30
    model = ModelProfile.from_proto(load_profile(BERT), 11.4e9)
    s = p.stages[1]
    plain = cm.stage_backward_ms(cm.Prefix(model), s.first_layer, s.last_layer + 1, 8, 2)
    assert s.backward_ms == pytest.approx(plain + s.forward_ms - cm.PASS_OVERHEAD_MS)  # + the recomputed forward


def test_a_model_that_fits_keeps_recompute_off_and_reports_show_the_choice():
    from planner.planning.report import shape, comparison_table, summarize

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fits = plan(load_profile(BERT), make_cluster("t", 16, 1, 16 * 2**30, 3.125e9, 3.125e9), 64,
                    profile_memory="11.4GB")
        tight = plan(load_profile(BERT), make_cluster("t", 16, 1, 4 * 2**30, 3.125e9, 3.125e9), 64,
                     profile_memory="11.4GB")
    assert not any(s.recompute for s in fits.stages) and "+RC" not in shape(fits)
    assert shape(tight) == "8:2:2:2:2 +RC"
    assert "8:2:2:2:2 +RC" in comparison_table({"dapple": tight})
    assert summarize(tight).count("re-computes its forward in backward") == 5
    partial = plan_pb2.Plan()
    partial.stages.add(device_ids=[0])
    partial.stages.add(device_ids=[1], recompute=True)
    assert shape(partial) == "straight (2 stages) +RC[1]"


def _cheap_wide_profile(kept_bytes):
    """4 layers, cheap compute (0.05 ms forward at batch 8), 100 MB of parameters and `kept_bytes` kept for backward each."""
    from planner.formats import layer_cost_pb2

    p = layer_cost_pb2.LayerCostProfile(model_name="cheap-wide", batch_size=8, source="test")
    for i in range(4):
        layer = p.layers.add(name=f"l{i}", index=i, forward_ms=0.05, backward_ms=0.1, activation_bytes=1e5,
                             parameter_bytes=1e8, backward_kept_bytes=kept_bytes)
        if i:
            layer.inputs.append(f"l{i - 1}")
    return p


def test_recompute_is_chosen_when_a_larger_micro_batch_it_allows_is_faster():
    # 4 x 1 GiB devices: without RC only micro-batches of 2 fit (M=32, 0.2 ms per pass); with RC
    # micro-batches of 8 do, and the recomputed forwards cost less than the passes saved.
    cluster = make_cluster("t", 4, 1, 2**30, 1e10, 1e10)
    plain = plan(_cheap_wide_profile(4e8), cluster, 64, recompute=False)
    chosen = plan(_cheap_wide_profile(4e8), cluster, 64)
    assert (plain.micro_batch_size, any(s.recompute for s in plain.stages)) == (2, False)
    assert (chosen.micro_batch_size, all(s.recompute for s in chosen.stages)) == (8, True)
    assert chosen.estimated_iteration_ms < 0.5 * plain.estimated_iteration_ms
    assert max(chosen.device_peak_memory_bytes) <= 2**30


def test_only_the_profilers_own_step_is_read_in_time():
    # 4 layers of 100 MB parameters keeping 1 MB each at batch 8, step peak 1 GB (P = 0.4 GB). In time:
    # c = min_i (1e9 - P - G_i) / K_i = min(200, 150, 133.3, 125) = 125 (the last layer's backward), so
    # each layer keeps 125 MB / 8 per sample. A figure from outside (profile_memory, or a side file
    # next to a PipeDream text, which carries no kept bytes): (1e9 - 2 P) / 4 layers / 8.
    own = _cheap_wide_profile(1e6)
    own.step_peak_bytes = 1e9
    assert ModelProfile.from_proto(own).kept_bytes == pytest.approx([125e6 / 8] * 4)
    assert ModelProfile.from_proto(own, 1e9).kept_bytes == pytest.approx([2e8 / 4 / 8] * 4)
    side_file = _cheap_wide_profile(0.0)
    side_file.step_peak_bytes = 1e9
    assert ModelProfile.from_proto(side_file).kept_bytes == pytest.approx([2e8 / 4 / 8] * 4)

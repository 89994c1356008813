"""Profiles measured in interleaved rounds (profiler/rounds.py, profiler/timing.round_ms): every measurement of every
batch size once per round, medians and the whole step's spread recorded; checked on fake timers (fixed numbers in,
medians and spreads out) and on the CLI."""

import itertools
import re

import pytest

import models
import profiler
from planner.formats.profile import load_profile
from profiler import core, rounds, timing
from tests.programs import run_program


def test_each_round_takes_every_measurement_once_in_turn():
    calls = []
    measures = {key: (lambda key=key: calls.append(key) or len(calls)) for key in ("a", "b", "c")}
    seen_after = []
    samples = rounds.measure_in_rounds(measures, 3, lambda r, s: seen_after.append((r, len(s["a"]))))
    assert calls == ["a", "b", "c"] * 3
    assert samples == {"a": [1, 4, 7], "b": [2, 5, 8], "c": [3, 6, 9]}
    assert seen_after == [(1, 1), (2, 2), (3, 3)]
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        rounds.measure_in_rounds(measures, 0)


def test_median_and_spread():
    assert rounds.median_and_spread([10.0, 12.0, 11.0, 30.0, 9.0]) == (11.0, pytest.approx(21.0 / 11.0))
    assert rounds.median_and_spread([5.0]) == (5.0, 0.0)
    assert rounds.median_and_spread([0.0, 0.0]) == (0.0, 0.0)


class _Session:
    def run(self, fetches, feed_dict=None):
        del fetches, feed_dict


def test_a_rounds_measurement_is_the_targets_median_less_the_no_ops_fastest(monkeypatch):
    # each run reads the clock twice; target runs take 5, 9 and 6 ms, the no-op's 2, 1 and 4 (alternating)
    durations = iter([5, 2, 9, 1, 6, 4])
    ticks = itertools.accumulate(d for duration in durations for d in (0, duration))
    monkeypatch.setitem(timing.CLOCKS, "wall", lambda: next(ticks) / 1e3)
    assert timing.round_ms(_Session(), "target", "probe", warmup=1, runs=3) == pytest.approx(6 - 1)
    durations = iter([1, 3])
    ticks = itertools.accumulate(d for duration in durations for d in (0, duration))
    assert timing.round_ms(_Session(), "target", "probe", warmup=0, runs=1) == 0.0  # clamped


def test_profiles_at_several_sizes_are_measured_side_by_side(monkeypatch):
    """A fake measurement returns 100 * round + its position in the round: each profile's times are the medians
    over rounds, its step's rounds and spread recorded; the second size's measurements come after the first's in
    every round, before the next round."""
    counter = itertools.count()
    per_round = {}

    def fake_round_ms(*args, **kwargs):
        del args, kwargs
        i = next(counter)
        return 100.0 * (i // per_round["n"]) + i % per_round["n"]

    monkeypatch.setattr(core, "round_ms", fake_round_ms)
    spec = models.get_model("mlp", "tiny", hidden=[8, 8])
    original = rounds.measure_in_rounds

    def counting(measures, n, after_round=None):
        per_round["n"] = len(measures)
        return original(measures, n, after_round)

    monkeypatch.setattr(rounds, "measure_in_rounds", counting)
    profiles = profiler.profile_specs(spec, [4, 8], rounds=3)
    small, large = profiles[4], profiles[8]
    per_size = per_round["n"] // 2
    for position, profile in ((per_size - 1, small), (2 * per_size - 1, large)):  # each size's step is its last
        assert list(profile.step_ms_rounds) == [position, 100 + position, 200 + position]
        assert profile.step_ms == 100 + position and profile.timing_rounds == 3
        assert profile.relative_spread == pytest.approx(200 / (100 + position))
    assert small.layers[0].forward_ms == 100.0  # the first measurement of every round: its median
    assert large.layers[0].forward_ms == 100.0 + per_size
    assert all(layer.backward_input_ms <= layer.backward_ms for p in profiles.values() for layer in p.layers)


# ~10 s: two sizes of a small MLP, 3 rounds
def test_dapple_profile_measures_several_sizes_side_by_side(tmp_path):
    pattern = str(tmp_path / "mlp-bs{batch_size}.pbtxt")
    result = run_program("dapple_profile", "--model=mlp", "--model_flags=hidden=16:8", "--batch_sizes=8,4",
                         "--rounds=3", "--runs=1", f"--output={pattern}")
    assert result.returncode == 0, result.stderr
    assert len(re.findall(r"^round \d/3: whole step batch 4 [\d.]+ ms, batch 8 [\d.]+ ms$", result.stderr, re.M)) == 3
    spreads = {}
    for size in (4, 8):
        profile = load_profile(pattern.replace("{batch_size}", str(size)))
        assert profile.batch_size == size and profile.timing_rounds == 3 and len(profile.step_ms_rounds) == 3
        assert re.search(rf"^wrote {re.escape(pattern.replace('{batch_size}', str(size)))}: 3 layers, .* whole step "
                         rf"[\d.]+ ms, spread [\d.]+% over 3 rounds", result.stdout, re.M)
        spreads[size] = profile.relative_spread
    noisiest = max(spreads, key=spreads.get)  # the machine decides: a warning exactly when a spread is above 20%
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: the whole step")]
    assert warnings == ([f"warning: the whole step at batch {noisiest} spread {spreads[noisiest]:.0%} across its 3 "
                         f"rounds (above 20%): the machine was busy, and the planner will take plans within "
                         f"{spreads[noisiest]:.0%} of each other as ties; profile again on a quiet machine, or with "
                         f"more --runs per measurement (now 1)"] if spreads[noisiest] > 0.2 else [])
    bad = run_program("dapple_profile", "--model=mlp", "--batch_sizes=8,4", f"--output={tmp_path / 'p.pbtxt'}")
    assert bad.returncode == 1
    assert "with --batch_sizes, --output must contain {batch_size} (one file per size)" in bad.stderr

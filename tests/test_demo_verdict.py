"""dapple_demo's verdict sentence and ties table (scripts/workflows/demo_verdict.py), on hand-made benchmark rows."""

import pytest

from scripts.workflows import demo_verdict

BATCH = 1024


def _row(plan, stages, speedup, ideal=1.0, slices=1.0, simulated=None, single_ms=400.0):
    """A speed benchmark row (scripts/bench/speed/speedup.py --json) with the keys the verdict reads."""
    ms = single_ms / speedup
    return {"plan": plan, "stages": stages, "speedup": speedup, "measured_ms": ms, "samples_per_s": BATCH / ms * 1e3,
            "ideal_speedup": ideal, "slice_slowdown": slices, "simulated_speedup": simulated or speedup,
            "ties": [], "profile_spread": 0.0}


def _rows(planner, m2, m4, planner_stages="0-8@[0, 1], M=1, dapple"):
    return [_row("single", "0-8@[0], M=1, dapple", 1.0),
            _row("planner", planner_stages, planner, ideal=2.0, slices=1.12, simulated=1.7),
            _row("straight2-M2", "0-3@[0] 4-8@[1], M=2, dapple", m2, ideal=4 / 3, slices=1.12),
            _row("straight2-M4", "0-3@[0] 4-8@[1], M=4, dapple", m4, ideal=1.6, slices=1.62)]


def test_the_planners_choice_fastest_names_it_and_why_the_best_pipeline_lost():
    sentence = demo_verdict.verdict(_rows(1.58, 1.27, 0.94))
    assert sentence == (
        "On this machine the planner's choice, data parallel on 2 workers (dp2), was fastest: 1.58x one worker; "
        "the best pipeline, straight2-M2, reached 1.27x: with M=2 its bubble caps it at 1.33x, and its 512-sample "
        "slices cost 1.12x per sample what the whole 1024-sample batch does here.")


def test_a_pipeline_fastest_names_it_ahead_of_the_planners_choice_and_its_simulation():
    sentence = demo_verdict.verdict(_rows(1.10, 1.27, 0.94))
    assert sentence == ("On this machine a pipeline was fastest: straight2-M2, 1.27x one worker, ahead of the "
                        "planner's choice, data parallel on 2 workers (dp2), at 1.10x (simulated 1.70x).")


def test_nothing_beat_one_worker_says_so_with_the_slice_cost():
    sentence = demo_verdict.verdict(_rows(0.95, 0.83, 0.70))
    assert sentence.startswith("On this machine nothing beat one worker: the planner's choice, data parallel on 2 "
                               "workers (dp2), reached 0.95x; the best pipeline, straight2-M2, reached 0.83x")
    assert "its 512-sample slices cost 1.12x per sample what the whole 1024-sample batch does here." in sentence


def test_a_pipeline_chosen_by_the_planner_is_the_planners_win_and_the_other_pipeline_explains_itself():
    rows = _rows(1.30, 1.31, 0.94, planner_stages="0-3@[0] 4-8@[1], M=2, dapple")
    sentence = demo_verdict.verdict(rows)
    assert sentence.startswith("On this machine the planner's choice, a 2-stage pipeline with M=2 (straight2-M2), "
                               "was fastest: 1.30x one worker; the best other pipeline, straight2-M4, reached 0.94x")
    assert "its 256-sample slices cost 1.62x per sample" in sentence


def test_a_pipeline_chosen_by_the_planner_that_lost_says_what_its_slices_cost():
    rows = _rows(0.86, 1.17, 1.19, planner_stages="0-3@[0] 4-8@[1], M=16, zb-h1")
    rows[1].update(ideal_speedup=32 / 17, slice_slowdown=1.05)
    assert demo_verdict.verdict(rows) == (
        "On this machine a pipeline was fastest: straight2-M4, 1.19x one worker, ahead of the planner's choice, a "
        "2-stage pipeline with M=16 (straight2-M16-zb-h1), at 0.86x (simulated 1.70x; with M=16 its bubble caps it "
        "at 1.88x, and its 64-sample slices cost 1.05x per sample what the whole 1024-sample batch does here).")


def test_no_verdict_without_the_single_worker():
    assert demo_verdict.verdict(_rows(1.5, 1.2, 0.9)[1:]) == ""
    assert demo_verdict.verdict([]) == ""


@pytest.mark.parametrize("stages,words", [
    ("0-8@[0, 1], M=1, dapple", "data parallel on 2 workers (dp2)"),
    ("0-3@[0] 4-8@[1], M=4, zb-h1", "a 2-stage pipeline with M=4 (straight2-M4-zb-h1)"),
    ("0-3@[0] 4-8@[1], M=8, gpipe", "a 2-stage pipeline with M=8 (gpipe2-M8)"),
    ("0-3@[0, 1] 4-8@[2], M=4, dapple", "a 2-stage pipeline with M=4, stages on 2:1 workers (0-3@[0, 1] 4-8@[2], "
                                        "M=4, dapple)"),
])
def test_plan_words(stages, words):
    assert demo_verdict.plan_words(_row("planner", stages, 1.0)) == words


def _with_ties(count):
    rows = _rows(1.58, 1.27, 0.94)
    rows[1]["ties"] = [["DP over layers 0-8, M=1, dapple", 100.0]] + [
        [f"straight (2 stages) over layers 0-3,4-8, M={2 ** i}, dapple", 100.0 + i] for i in range(1, count + 1)]
    rows[1]["profile_spread"] = 0.123
    return rows


def test_ties_table_lists_the_chosen_first_then_ratios_to_it():
    lines = demo_verdict.ties_table(_with_ties(2)).splitlines()
    assert lines[0] == ("The planner's ties: simulated within its profile's spread (12.3%) of its choice, so noise "
                        "orders them:")
    assert lines[1].split() == ["plan", "sim", "ms", "/", "chosen"]
    assert lines[2].split()[-4:] == ["dapple", "(chosen)", "100.00", "1.00"]
    assert lines[3].startswith("  straight (2 stages) over layers 0-3,4-8, M=2, dapple") and lines[3].endswith(
        "101.00     1.01")
    assert len(lines) == 5


def test_ties_table_shows_at_most_five_plans_and_counts_the_rest():
    lines = demo_verdict.ties_table(_with_ties(8)).splitlines()
    plan_lines = [line for line in lines[2:] if "over layers" in line]
    assert len(plan_lines) == demo_verdict.MAX_TIES_ROWS == 5
    assert lines[-1] == "  and 4 more"


def test_no_ties_table_without_ties():
    assert demo_verdict.ties_table(_rows(1.58, 1.27, 0.94)) == ""
    assert demo_verdict.ties_table([]) == ""


def _plan_with_ties(count):
    from planner.formats import plan_pb2
    from planner.planning import ties

    plan = plan_pb2.Plan(num_micro_batches=1, simulated_iteration_ms=0.58, schedule=plan_pb2.DAPPLE)
    plan.stages.add(first_layer=0, last_layer=2, device_ids=[0, 1, 2, 3])
    ties.record(plan, 8.0, [(f"2:2 over layers 0-0,1-2, M={m}, dapple", 1.0 + m) for m in range(1, count + 1)])
    return plan


def test_the_plan_steps_report_shows_its_ties_as_a_table_not_a_line():
    from planner.planning import ties
    from scripts.workflows.demo import _with_ties_table

    plan = _plan_with_ties(9)
    report = _with_ties_table(f"dapple plan ...\n{ties.text(plan)}", plan)
    lines = report.splitlines()
    assert ties.text(plan) not in lines and lines[0] == "dapple plan ..."
    assert lines[1] == ("The planner's ties: simulated within its profile's spread (800.0%, above 20%: a busy "
                        "machine) of its choice, so noise orders them:")
    assert lines[3].split() == ["DP", "over", "layers", "0-2,", "M=1,", "dapple", "(chosen)", "0.58", "1.00"]
    assert len([line for line in lines if " over layers " in line]) == 5 and lines[-1] == "  and 5 more"
    assert _with_ties_table("dapple plan ...", _plan_with_ties(0)) == "dapple plan ..."

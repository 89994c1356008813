"""scripts/bench/harness.py (what the benchmarks share) and dapple_launch's thread settings
(dapple_tf/cluster/roles.py), without TensorFlow sessions."""

import json
import sys

import pytest

from scripts.bench import harness


def test_write_rows_writes_json_and_says_so(tmp_path):
    said = []
    harness.write_rows(str(tmp_path / "rows.json"), [{"M": 2}], log=said.append)
    assert json.loads((tmp_path / "rows.json").read_text()) == [{"M": 2}]
    assert said == [f"wrote {tmp_path / 'rows.json'}"]
    harness.write_rows("", [{"M": 2}], log=said.append)  # no path: nothing written, nothing said
    assert len(said) == 1


def test_profile_path_names_a_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="pass --profiles=FOLDER"):
        harness.profile_path("bert-48-pbs-2", str(tmp_path))
    (tmp_path / "bert-48-pbs-2.txt").write_text("")
    assert harness.profile_path("gnmt-16-pbs-64", str(tmp_path)) == str(tmp_path / "gnmt-16-pbs-64.txt")


def test_launch_command_runs_the_chief_under_dapple_launch():
    chief = harness.module_command("scripts.bench.runtime.cluster", "--as_chief")
    command = harness.launch_command("local:3x2", chief, "--grace=30")
    assert command == [sys.executable, "-m", "scripts.dapple_launch", "--cluster=local:3x2", "--noper_host",
                       "--grace=30", "--",
                       sys.executable, "-m", "scripts.bench.runtime.cluster", "--as_chief"]


def test_stream_command_shows_what_is_kept_and_returns_every_line(capsys):
    code, lines = harness.stream_command(
        [sys.executable, "-c", "import sys; print('[chief] a'); print('b'); sys.exit(3)"],
        lambda line: line[len("[chief] "):] if line.startswith("[chief] ") else None)
    assert code == 3
    assert lines == ["[chief] a\n", "b\n"]
    assert capsys.readouterr().out == "a\n"


def test_worker_threads_default_to_the_cores_and_refuse_negative_counts():
    from dapple_tf.cluster.roles import worker_threads
    from dapple_tf.cluster.servers import WorkerThreads

    assert worker_threads(2) == WorkerThreads.for_cores(2)
    assert worker_threads(2, intra_op=1) == WorkerThreads(1, WorkerThreads.for_cores(2).inter_op)
    with pytest.raises(ValueError, match="thread counts must be >= 0"):
        worker_threads(2, inter_op=-1)


def test_duration_text():
    assert [harness.duration_text(s) for s in (0, 7.6, 59.4, 60, 100, 3599, 3600, 3725)] == [
        "0s", "8s", "59s", "1m00s", "1m40s", "59m59s", "1h00m", "1h02m"]


def test_progress_text_estimates_what_is_left_from_the_time_per_unit_done():
    assert harness.progress_text(0, 8, "plans built", 3.0) == "[0/8 plans built]"
    assert harness.progress_text(3, 8, "plans built", 30.0) == "[3/8 plans built, 30s so far, ~50s left]"
    assert (harness.progress_text(2, 10, "rounds", 25.0, then="then the peers ~1m") ==
            "[2/10 rounds, 25s so far, ~1m40s left, then the peers ~1m]")
    assert harness.progress_text(10, 10, "rounds", 125.0, then="then the peers ~1m") == "[10/10 rounds in 2m05s]"


def test_progress_logs_a_line_per_advance_with_its_estimate():
    now, said = [100.0], []
    progress = harness.Progress(4, "cases", log=said.append, clock=lambda: now[0])
    assert progress.left_s() is None and progress.text() == "[0/4 cases]"
    now[0] = 112.0
    assert progress.advance("case 1/4  ok") == "case 1/4  ok [1/4 cases, 12s so far, ~36s left]"
    now[0] = 130.0
    progress.advance(count=2)
    assert progress.left_s() == pytest.approx(10.0)  # 30 s for 3 cases, 1 left
    now[0] = 140.0
    progress.advance()
    assert said[1:] == ["  [3/4 cases, 30s so far, ~10s left]", "  [4/4 cases in 40s]"]


def test_progress_every_s_holds_lines_back_but_the_last():
    now, said = [0.0], []
    progress = harness.Progress(5, "rounds", log=said.append, clock=lambda: now[0], every_s=10.0)
    for t in (4.0, 8.0, 12.0, 14.0, 16.0):
        now[0] = t
        progress.advance()
    assert said == ["  [3/5 rounds, 12s so far, ~8s left]", "  [5/5 rounds in 16s]"]

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
    chief = harness.module_command("scripts.bench.cluster", "--as_chief")
    command = harness.launch_command("local:3x2", chief, "--grace=30")
    assert command == [sys.executable, "-m", "scripts.dapple_launch", "--cluster=local:3x2", "--noper_host",
                       "--grace=30", "--",
                       sys.executable, "-m", "scripts.bench.cluster", "--as_chief"]


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

"""dapple_tf.cluster.watchdog: when a probed task counts as lost, and what the watchdog does then."""

import time

from dapple_tf.cluster import watchdog
from dapple_tf.cluster.servers import TFCluster

CLUSTER = TFCluster(("127.0.0.1:1001", "127.0.0.1:1002"))


def _with_answers(monkeypatch, answers):
    """probe_task answers from a list per address (None: alive), one answer per probe."""
    queues = {address: list(values) for address, values in answers.items()}
    monkeypatch.setattr(watchdog, "probe_task", lambda address, timeout_s: queues[address].pop(0))


def test_a_gone_process_is_lost_at_the_second_failed_probe(monkeypatch):
    _with_answers(monkeypatch, {"127.0.0.1:1001": [None, None, None],
                                "127.0.0.1:1002": ["unreachable (Connection refused)"] * 2 + [None]})
    dog = watchdog.TaskWatchdog(CLUSTER, str, patience_s=30)
    assert dog.lost(0.0) == {}
    assert dog.lost(2.0) == {1: "unreachable (Connection refused)"}
    assert dog.lost(4.0) == {}  # answers again: forgotten


def test_a_task_that_does_not_answer_is_lost_after_the_patience(monkeypatch):
    slow = "not answering within 3 s (stopped or overloaded)"
    _with_answers(monkeypatch, {"127.0.0.1:1001": [slow] * 3, "127.0.0.1:1002": [None] * 3})
    dog = watchdog.TaskWatchdog(CLUSTER, str, patience_s=10)
    assert dog.lost(0.0) == {} and dog.lost(6.0) == {}
    assert dog.lost(10.0) == {0: slow}


def test_the_watchdog_reports_and_exits(monkeypatch, capsys):
    _with_answers(monkeypatch, {"127.0.0.1:1001": [None] * 10, "127.0.0.1:1002": ["unreachable (x)"] * 10})
    exits = []
    with watchdog.TaskWatchdog(CLUSTER, lambda lost: f"lost {sorted(lost)}", interval_s=0.01, exit=exits.append):
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:
            time.sleep(0.01)
    assert exits == [1]
    assert "error: lost [1]" in capsys.readouterr().err

"""dapple_tf.cluster.chief_lease: what a worker learns about its chief, and how fast."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from dapple_tf.cluster.chief_lease import ChiefLease, watch_chief
from dapple_tf.cluster.servers import ClusterError, free_ports


def _address():
    return f"127.0.0.1:{free_ports(1)[0]}"


def _watch_in_thread(address, **kwargs):
    result = {}

    def watch():
        started = time.monotonic()
        result["outcome"] = watch_chief(address, **kwargs)
        result["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread, result


@pytest.mark.parametrize("code, exit_code, reason", [(0, 0, "finished"), (3, 1, "ended with exit code 3")])
def test_workers_learn_how_the_chief_ended(code, exit_code, reason):
    address = _address()
    with ChiefLease(address, interval_s=0.1) as lease:
        watchers = [_watch_in_thread(address, connect_timeout_s=5, silence_s=5) for _ in range(2)]
        time.sleep(0.5)  # both connected and beaten to
        lease.release(code)
    for thread, result in watchers:
        thread.join(5)
        assert result["outcome"].exit_code == exit_code
        assert result["outcome"].reason == f"the chief ({address}) {reason}"


def test_a_worker_waits_for_a_chief_that_comes_up_later():
    address = _address()
    thread, result = _watch_in_thread(address, connect_timeout_s=10, silence_s=5, poll_s=0.1)
    time.sleep(1.0)
    with ChiefLease(address, interval_s=0.1):
        time.sleep(0.3)
    thread.join(5)
    assert result["outcome"].exit_code == 0


def test_a_chief_that_never_comes_up_ends_the_worker_after_the_wait():
    address = _address()
    outcome = watch_chief(address, connect_timeout_s=0.5, silence_s=5, poll_s=0.1)
    assert outcome.exit_code == 1
    assert outcome.reason.startswith(f"the chief ({address}) did not come up within 0.5 s (")


def test_a_silent_chief_is_lost_after_the_silence_timeout():
    host, port = "127.0.0.1", free_ports(1)[0]
    with socket.socket() as listener:  # accepts, never writes: a stopped chief
        listener.bind((host, port))
        listener.listen(1)
        thread, result = _watch_in_thread(f"{host}:{port}", connect_timeout_s=5, silence_s=0.5)
        thread.join(5)
    assert result["outcome"].exit_code == 1
    assert result["outcome"].reason == f"the chief ({host}:{port}) sent nothing for 0.5 s (stopped or unreachable)"
    assert result["seconds"] < 2


def test_a_killed_chief_process_is_seen_at_once():
    address = _address()
    chief = subprocess.Popen([sys.executable, "-c", (
        "import time; from dapple_tf.cluster.chief_lease import ChiefLease\n"
        f"lease = ChiefLease({address!r}, interval_s=10).__enter__(); print('up', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        assert chief.stdout.readline().strip() == "up"
        thread, result = _watch_in_thread(address, connect_timeout_s=5, silence_s=30)
        time.sleep(0.5)
        os.kill(chief.pid, signal.SIGKILL)
        thread.join(5)
    finally:
        chief.kill()
        chief.wait()
    assert result["outcome"].exit_code == 1
    assert result["outcome"].reason == f"the chief ({address}) went away: its process ended without finishing"
    assert result["seconds"] < 3  # not the 30 s silence timeout


def test_a_chief_port_in_use_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen(1)
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(ClusterError, match=rf"^the chief \({address}\): port \d+ is in use on this host"):
            ChiefLease(address)

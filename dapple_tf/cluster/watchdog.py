"""Ends the chief when a cluster task is lost, whichever task it is.

A step blocked on a dead session target (worker task 0: the master and the collective group leader)
waits for a timeout that the dead master would have enforced, so nothing ends it. `TaskWatchdog`
probes every task (`cluster.probe_task`: TCP connect, then a GetStatus RPC with a deadline) every
`interval_s` while training runs. A task whose process is gone (unreachable, unavailable) is lost
after two failed probes in a row; one that accepts connections but does not answer (stopped,
overloaded) after `patience_s` of failed probes. Then the watchdog prints the error (which task, its
address, how to resume) to stderr and ends the process with exit code 1: the only way out of a
session.run blocked in C++.
"""

import os
import sys
import threading
import time
from typing import Callable, Dict

from dapple_tf.cluster.servers import TFCluster, probe_task


class TaskWatchdog:
    """Use as a context manager around the training loop; see the module docstring."""

    def __init__(self, cluster: TFCluster, describe: Callable[[Dict[int, str]], str], interval_s: float = 2.0,
                 patience_s: float = 30.0, probe_timeout_s: float = 3.0, exit=os._exit):  # pylint: disable=protected-access
        self.cluster, self.describe = cluster, describe
        self.interval_s, self.patience_s, self.probe_timeout_s = interval_s, patience_s, probe_timeout_s
        self._exit = exit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dapple_task_watchdog", daemon=True)
        self._failing_since: Dict[int, float] = {}
        self._failures: Dict[int, int] = {}

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=self.probe_timeout_s * len(self.cluster.workers) + self.interval_s)
        return False

    def stop(self) -> None:
        """From now on no lost task ends the process (tasks that finished training may leave)."""
        self._stop.set()

    def lost(self, now: float) -> Dict[int, str]:
        """Probes every task once; returns the tasks now considered lost, with why."""
        lost = {}
        for i, address in enumerate(self.cluster.workers):
            why = probe_task(address, timeout_s=self.probe_timeout_s)
            if why is None:
                self._failing_since.pop(i, None)
                self._failures.pop(i, None)
                continue
            since = self._failing_since.setdefault(i, now)
            self._failures[i] = self._failures.get(i, 0) + 1
            gone = not why.startswith("not answering")
            if (gone and self._failures[i] >= 2) or now - since >= self.patience_s:
                lost[i] = why
        return lost

    def _watch(self):
        while not self._stop.wait(self.interval_s):
            lost = self.lost(time.monotonic())
            if lost and not self._stop.is_set():
                print(f"error: {self.describe(lost)}", file=sys.stderr, flush=True)
                self._exit(1)
                return

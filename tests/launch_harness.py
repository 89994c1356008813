"""dapple_launch run in the background by tests: its output lines as they come, the processes it named."""

import os
import queue
import subprocess
import sys
import threading
import time

from tests.programs import ROOT


class Launch:
    """dapple_launch in the background, its output lines in a queue."""

    def __init__(self, *args, tf_config=None):
        env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
        if tf_config:
            env["TF_CONFIG"] = tf_config
        self.popen = subprocess.Popen([sys.executable, "-m", "scripts.dapple_launch", *args], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines, self._queue = [], queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.popen.stdout:
            self._queue.put(line.rstrip("\n"))

    def wait_for(self, predicate, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=1)
            except queue.Empty:
                continue
            self.lines.append(line)
            if predicate(line):
                return line
        raise AssertionError("not seen in time; output:\n" + "\n".join(self.lines[-40:]))

    def finish(self, timeout):
        code = self.popen.wait(timeout)
        time.sleep(0.5)
        while not self._queue.empty():
            self.lines.append(self._queue.get())
        return code, "\n".join(self.lines)


def running_pids(output, wait_s=5.0):
    """The processes named "(pid N" in the output that are still running after `wait_s` (a process killed
    by PR_SET_PDEATHSIG takes a moment to go), with what `ps` says about them."""
    pids = [int(part.split(")")[0].split(",")[0]) for part in output.split("(pid ")[1:]]
    deadline = time.monotonic() + wait_s
    while True:
        running = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                running.append(pid)
            except ProcessLookupError:
                pass
        if not running or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if not running:
        return []
    ps = subprocess.run(["ps", "-o", "pid,stat,args", "-p", ",".join(map(str, running))], capture_output=True, text=True)
    return [ps.stdout]


def pid_of(line):
    return int(line.split("(pid ")[1].split(")")[0].split(",")[0])

"""Child processes of the random equivalence harness that end with it, however it ends: each is started with
Linux's parent-death signal (SIGKILL when the harness dies, even by SIGKILL) and in a process group of its own
that the harness kills on exit. The harness's load (CPU-burning processes beside the cases) and its worker.
"""

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import List, Optional

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child, between fork and exec
    os.setpgid(0, 0)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (AttributeError, OSError):  # not Linux: the harness's own cleanup still kills the group
        pass


def start(command: List[str], **popen) -> subprocess.Popen:
    return subprocess.Popen(command, preexec_fn=_die_with_parent, **popen)  # pylint: disable=subprocess-popen-preexec-fn


def stop(process: Optional[subprocess.Popen]) -> None:
    """Kills the process and its group, and reaps it."""
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


class Load:
    """`count` processes each spinning a CPU core, while the context is open."""

    def __init__(self, count: int):
        self.count = count
        self._processes: List[subprocess.Popen] = []

    def __enter__(self):
        self._processes = [start([sys.executable, "-c", "while True: pass"]) for _ in range(self.count)]
        return self

    def __exit__(self, *exc):
        for process in self._processes:
            stop(process)
        self._processes = []


class Worker:
    """A fuzz_worker process: `run(case_json, timeout)` -> its result dict (restarted after a timeout, a crash,
    or, with `fresh=True`, before the case: cluster cases start servers that live as long as their process)."""

    def __init__(self, env: dict):
        self._env = env
        self._process: Optional[subprocess.Popen] = None

    def _start(self) -> None:
        self._process = start([sys.executable, "-m", "scripts.bench.fuzz.fuzz_worker"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=self._env)
        ready = self._read(300)
        if ready is None or not ready.get("ready"):
            raise RuntimeError("the fuzz worker did not start")

    def _read(self, timeout_s: float) -> Optional[dict]:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._process.stdout], [], [], left)[0]:
                return None
            line = self._process.stdout.readline()
            if not line:
                return None
            return json.loads(line)

    def run(self, case_json: str, timeout_s: float, fresh: bool = False) -> dict:
        if fresh or self._process is None or self._process.poll() is not None:
            self.close()
            self._start()
        self._process.stdin.write(case_json + "\n")
        self._process.stdin.flush()
        result = self._read(timeout_s)
        if result is None:
            code = self._process.poll()
            self.close()
            return {"error": f"no result within {timeout_s:.0f} s (a hang)" if code is None else
                    f"the worker died (exit code {code})"}
        return result

    def close(self) -> None:
        stop(self._process)
        self._process = None

"""A local TF cluster for dapple_launch: worker processes on loopback, the chief, logs, teardown.

`run_local(num_tasks, devices_per_task, command)` starts `num_tasks` worker servers (each its own
process, `dapple_launch --tf_config`, with `devices_per_task` virtual CPU devices; with
`cores_per_worker`, each pinned to its own cores with thread pools sized for them:
dapple_tf.cluster.servers.WorkerThreads), then the chief
command with its TF_CONFIG; it streams every process's output with a task prefix, and tears all of
them down when the chief ends, when a worker dies (after giving the chief `grace_s` to fail by
itself), on SIGINT/SIGTERM, or if this process is killed (the children get SIGKILL through
PR_SET_PDEATHSIG).

TensorFlow's gRPC server always listens on every interface (0.0.0.0, hard-coded in its
grpc_server_lib.cc), so the local cluster runs in a private network namespace whose only
interface is loopback (`isolated_network`): nothing outside this machine's namespace can reach it.
"""

import ctypes
import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import List, Optional, Sequence, Tuple

NETNS_ENV = "DAPPLE_LAUNCH_NETNS"
PROGRAMS = ("dapple_train", "dapple_profile", "dapple_plan", "dapple_simulate", "dapple_demo")
_PR_SET_PDEATHSIG = 1
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


class LaunchError(ValueError):
    """The local cluster could not be started."""


def command_line(command: Sequence[str]) -> List[str]:
    """Runs this repository's programs with this Python (`python -m scripts.NAME`), others as given."""
    if not command:
        raise LaunchError("no command to run: put it after `--`, e.g. -- dapple_train --model=mlp ...")
    name = os.path.basename(command[0])
    if name in PROGRAMS:
        return [sys.executable, "-m", f"scripts.{name}", *command[1:]]
    if shutil.which(command[0]) is None:
        raise LaunchError(f"{command[0]!r} is not a program on PATH")
    return list(command)


def reexec_in_private_network(argv: Sequence[str]) -> None:
    """Re-runs this program inside a new network namespace (only loopback); returns if already inside."""
    if os.environ.get(NETNS_ENV):
        _loopback_up()
        return
    unshare = ["unshare", "--net"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--net"]
    probe = subprocess.run([*unshare, "true"], capture_output=True, text=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        why = "unshare(1) is not installed" if probe is None else probe.stderr.strip()
        raise LaunchError(
            f"cannot give the local cluster a private network ({why}). TF's gRPC servers listen on every "
            "interface and have no authentication; pass --isolate_network=false to run them on this host's "
            "network anyway (only on a trusted network)"
        )
    os.environ[NETNS_ENV] = "1"
    os.execvp(unshare[0], [*unshare, "--", sys.executable, "-m", "scripts.dapple_launch", *argv])


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, request))[1]
        if not flags & _IFF_UP:
            fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def run_child(args: Sequence[str], role: str = "chief") -> int:
    """Runs a command that dies with this process, passes SIGINT/SIGTERM on to it, and returns its exit code
    (128 + N when signal N ended it)."""
    child = subprocess.Popen(list(args), preexec_fn=_die_with_parent)
    print(f"dapple_launch: {role} command (pid {child.pid}): {' '.join(args)}", flush=True)

    def forward(signum, frame):
        del frame
        if child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - code if code < 0 else code


def default_cores_per_worker(num_tasks: int) -> int:
    """Each worker its own share of this machine's cores; 0 (unpinned) when there are more workers than cores."""
    from dapple_tf.cluster.servers import usable_cores

    return len(usable_cores()) // num_tasks


class _Process:
    """A child process whose output lines are printed with a prefix."""

    _print_lock = threading.Lock()

    def __init__(self, label: str, args: List[str], env: dict, cores: Sequence[int] = ()):
        self.label = label

        def prepare():
            os.setsid()
            _die_with_parent()
            if cores:
                os.sched_setaffinity(0, set(cores))

        self.popen = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, preexec_fn=prepare)
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self):
        for raw in self.popen.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            with self._print_lock:
                print(f"[{self.label}] {line}", flush=True)

    def poll(self) -> Optional[int]:
        return self.popen.poll()

    def stop(self, wait_s: float = 5.0) -> None:
        """SIGTERM to its process group, SIGKILL after `wait_s`; then its output is drained."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.popen.poll() is not None:
                break
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.popen.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
        self.popen.wait()
        self._reader.join(timeout=2)


def describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def worker_placement(num_tasks: int, cores_per_worker: int, log=print) -> List[Tuple[int, ...]]:
    """The cores each worker task is pinned to (empty: unpinned), with a warning when workers share cores."""
    from dapple_tf.cluster.servers import usable_cores, worker_cores

    if cores_per_worker <= 0:
        return [()] * num_tasks
    if not hasattr(os, "sched_setaffinity"):
        log("dapple_launch: this platform has no CPU affinity (os.sched_setaffinity): workers run unpinned")
        return [()] * num_tasks
    available = len(usable_cores())
    if num_tasks * cores_per_worker > available:
        log(f"dapple_launch: warning: {num_tasks} workers x {cores_per_worker} cores > the {available} cores this "
            "process may use: workers share cores, so their step times are not those of separate devices")
    return [worker_cores(i, cores_per_worker) for i in range(num_tasks)]


def _supervise(cluster, chief: Optional["_Process"], workers: List["_Process"], stopping: list, grace_s: float,
               log) -> int:
    """Waits for the job to end: the chief (with no chief, per-host training: every worker task), a signal (in
    `stopping`), or a worker's failure and the others not stopping within `grace_s` of it (their watchdogs end them
    within seconds); returns dapple_launch's exit code."""
    failed_at = None
    while True:
        codes = [w.poll() for w in workers]
        code = chief.poll() if chief else None
        if code is not None:
            if code < 0:
                log(f"dapple_launch: the chief ({cluster.chief}) {describe_exit(code)}")
            return 1 if failed_at is not None or code < 0 else code
        if chief is None and all(c is not None for c in codes):
            return 1 if any(codes) else 0
        if stopping:
            log(f"dapple_launch: {signal.Signals(stopping[0]).name}: stopping every task")
            return 128 + stopping[0]
        dead = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]  # 0: finished (its chief, or its command)
        if dead and failed_at is None:
            for i, c in dead:
                log(f"dapple_launch: worker task {i} ({cluster.workers[i]}) {describe_exit(c)}")
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            who = "the chief" if chief else "the other tasks"
            log(f"dapple_launch: {who} did not stop within {grace_s:g} s of the failure: stopping every task")
            return 1
        time.sleep(0.1)


def run_local(num_tasks: int, devices_per_task: int, command: Sequence[str], grace_s: float = 10.0,
              log=print, cores_per_worker: int = 0, threads=None, per_host: bool = False) -> int:
    """Runs the local cluster and the chief command (`per_host`: the command in every worker task, and no chief);
    returns the exit code for dapple_launch.

    cores_per_worker > 0 pins worker i to its own cores (dapple_tf.cluster.servers.worker_cores); threads (a
    dapple_tf.cluster.servers.WorkerThreads) sizes each worker's thread pools (default: WorkerThreads.for_cores).
    """
    from dapple_tf.cluster.servers import TFCluster, WorkerThreads, free_ports

    placement = worker_placement(num_tasks, cores_per_worker, log)
    threads = threads or WorkerThreads.for_cores(min(len(set(cores)) for cores in placement))

    command_line(command)  # a bad command fails before anything starts
    *ports, chief_port = free_ports(num_tasks + 1)
    cluster = TFCluster(tuple(f"127.0.0.1:{p}" for p in ports), chief=None if per_host else f"127.0.0.1:{chief_port}")
    chief_args = [sys.executable, "-m", "scripts.dapple_launch", "--tf_config", "--", *command]
    base_env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPU_ALLOCATOR_USE_BFC="true")
    base_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    workers: List[_Process] = []
    chief: Optional[_Process] = None
    stopping = []

    def on_signal(signum, frame):
        del frame
        stopping.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for i in range(num_tasks):
            env = dict(base_env, TF_CONFIG=cluster.tf_config("worker", i))
            args = [sys.executable, "-m", "scripts.dapple_launch", "--tf_config", f"--virtual_devices={devices_per_task}",
                    f"--intra_op_threads={threads.intra_op}", f"--inter_op_threads={threads.inter_op}"]
            args += ["--", *command] if per_host else []
            workers.append(_Process(f"worker {i}", args, env, placement[i]))
            pinned = f", cores {list(placement[i])}" if placement[i] else ""
            log(f"dapple_launch: worker task {i} at {cluster.workers[i]} (pid {workers[-1].popen.pid}, "
                f"{devices_per_task} virtual CPU devices{pinned}, threads intra {threads.intra_op} "
                f"inter {threads.inter_op})")
        if per_host:
            log(f"dapple_launch: every worker task runs: {' '.join(command)}")
            return _supervise(cluster, None, workers, stopping, grace_s, log)
        chief = _Process("chief", chief_args, dict(base_env, TF_CONFIG=cluster.tf_config("chief", 0)))
        log(f"dapple_launch: chief (pid {chief.popen.pid}): {' '.join(command)}")
        return _supervise(cluster, chief, workers, stopping, grace_s, log)
    finally:
        if chief and chief.poll() is not None:  # workers end with their chief (its lease): give them a moment
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and any(w.poll() is None for w in workers):
                time.sleep(0.05)
        for process in ([chief] if chief else []) + workers:
            process.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)

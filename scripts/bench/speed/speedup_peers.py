"""The speedup benchmark's peers: what a user would run instead of dapple_tf for data parallelism on N workers.

Rows `mwms<N>` (tf.distribute.MultiWorkerMirroredStrategy) and `horovod<N>` (Horovod, TF1 graph mode), each run by
scripts/bench/speed/peer_worker.py in N processes pinned to the cores dapple_launch gives its N workers, with the same
thread pools, model, optimizer and global batch, after the benchmark's own plans (their cluster stopped). Each
is also run on one worker (`mwms1`, `horovod1`), so a row shows its speedup over the benchmark's `single` row
(one dapple_tf worker; None when it was not run) and over its own one-worker run. A run ends when every process
has exited, when one fails (the others are stopped then: a rank waiting in a collective would wait for ever) or at
TIMEOUT_S. Every process is started with the parent-death signal in a process group of its own
(scripts/bench/fuzz/fuzz_processes.py) and stopped at the end; horovodrun first gets SIGTERM, on which it stops its
ranks (they run in a session of their own, out of its group's reach).
"""

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from scripts.bench import harness
from scripts.bench.fuzz import fuzz_processes

KINDS = ("mwms", "horovod")
TIMEOUT_S = 600
STOP_GRACE_S = 10


@dataclasses.dataclass
class PeerSettings:
    model: str
    config: str
    model_flags: str
    global_batch_size: int
    optimizer: str
    cores_per_worker: int
    intra_op_threads: int
    inter_op_threads: int
    steps: int


def split_plans(names: Optional[Sequence[str]], num_workers: int) -> Tuple[Optional[List[str]], List[str]]:
    """(the benchmark's own plan names, or None for all of them; the peer kinds asked for): every peer when
    `names` is empty, else those named `<kind><num_workers>`."""
    peers = {f"{kind}{num_workers}": kind for kind in KINDS}
    if not names:
        return None, list(KINDS)
    return [n for n in names if n not in peers], [peers[n] for n in names if n in peers]


def unavailable(kind: str) -> Optional[str]:
    """Why `kind` cannot run here, or None."""
    if kind == "horovod" and (importlib.util.find_spec("horovod") is None or not os.path.exists(_horovodrun())):
        return "horovod is not installed in this environment (the primary one has it: make env)"
    return None


def _horovodrun() -> str:
    return os.path.join(os.path.dirname(sys.executable), "horovodrun")


def _worker_args(settings: PeerSettings, kind: str, num_workers: int) -> List[str]:
    from dapple_tf.cluster.servers import worker_cores  # pylint: disable=import-outside-toplevel

    cores = "/".join(",".join(str(c) for c in worker_cores(i, settings.cores_per_worker)) for i in range(num_workers))
    return [f"--kind={kind}", f"--cores={cores}", f"--model={settings.model}", f"--config={settings.config}",
            f"--model_flags={settings.model_flags}", f"--global_batch_size={settings.global_batch_size}",
            f"--optimizer={settings.optimizer}", f"--intra_op_threads={settings.intra_op_threads}",
            f"--inter_op_threads={settings.inter_op_threads}", f"--steps={settings.steps}"]


def _commands(settings: PeerSettings, kind: str, num_workers: int) -> List[Tuple[List[str], Dict[str, str]]]:
    """(command, environment) of each process to start."""
    worker = harness.module_command("scripts.bench.speed.peer_worker", *_worker_args(settings, kind, num_workers))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if kind == "horovod":
        return [([_horovodrun(), "-np", str(num_workers), "--gloo", "-H", f"localhost:{num_workers}"] + worker, env)]
    from dapple_tf.cluster.servers import free_ports  # pylint: disable=import-outside-toplevel

    addresses = [f"localhost:{p}" for p in free_ports(num_workers)]
    return [(worker + [f"--rank={rank}"],
             dict(env, TF_CONFIG=json.dumps({"cluster": {"worker": addresses}, "task": {"type": "worker", "index": rank}})))
            for rank in range(num_workers)]


def measure(settings: PeerSettings, kind: str, num_workers: int) -> float:
    """Median step seconds of `kind` on `num_workers` pinned processes; RuntimeError with their output on failure."""
    with tempfile.TemporaryDirectory(prefix="bench_peer_") as folder:
        processes, logs = [], []
        try:
            for i, (command, env) in enumerate(_commands(settings, kind, num_workers)):
                logs.append(os.path.join(folder, f"{i}.log"))
                with open(logs[-1], "w", encoding="utf-8") as out:
                    processes.append(fuzz_processes.start(command, env=env, stdout=out, stderr=subprocess.STDOUT))
            codes = _wait(processes, TIMEOUT_S)
        finally:
            for p in processes:
                _stop(p)
        text = "".join(open(log, encoding="utf-8").read() for log in logs)
    found = re.search(r"STEP_S (\S+)", text)  # horovodrun prefixes its processes' lines with [rank]<stdout>:
    if found and codes is not None and not any(codes):
        return float(found.group(1))
    what = f"no result within {TIMEOUT_S} s" if codes is None else f"exit codes {codes} (None: stopped)"
    raise RuntimeError(f"{kind} on {num_workers} worker(s) failed ({what}):\n{text[-3000:]}")


def _wait(processes: Sequence[subprocess.Popen], timeout_s: float) -> Optional[List[Optional[int]]]:
    """The exit codes once every process has exited or one has failed (None for those still running), or None
    after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [p.poll() for p in processes]
        if all(c is not None for c in codes) or any(c for c in codes):
            return codes
        time.sleep(0.2)
    return None


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM first (horovodrun then stops its ranks), SIGKILL to the group after STOP_GRACE_S."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    fuzz_processes.stop(process)


def rows(settings: PeerSettings, kinds: Sequence[str], num_workers: int, single_ms: Optional[float]) -> List[dict]:
    """The peers' rows (printed as they come, with the progress of the runs): for each kind, its run on one worker and
    on `num_workers`."""
    out = []
    progress = harness.Progress(2 * sum(unavailable(kind) is None for kind in kinds), "peer runs")
    print(f"peers: data parallel on the same pinned cores, threads, model and global batch "
          f"(scripts/bench/speed/speedup_peers.py); speedup over `single` above and over the peer's own one worker",
          flush=True)
    print(f"{'plan':24s} {'samples/s':>10s} {'ms':>8s} {'speedup':>8s} {'over own 1':>10s}", flush=True)
    for kind in kinds:
        reason = unavailable(kind)
        if reason:
            print(f"{kind + str(num_workers):24s} skipped: {reason}", flush=True)
            continue
        own_ms = None
        for n in (1, num_workers):
            ms = measure(settings, kind, n) * 1e3
            own_ms = own_ms or ms
            row = {"plan": f"{kind}{n}", "peer": kind, "workers": n, "measured_ms": ms,
                   "samples_per_s": settings.global_batch_size / ms * 1e3,
                   "speedup": single_ms / ms if single_ms else None, "speedup_over_own_one": own_ms / ms}
            out.append(row)
            speedup = "-" if row["speedup"] is None else f"{row['speedup']:.2f}"
            progress.advance(f"{row['plan']:24s} {row['samples_per_s']:10.0f} {ms:8.1f} {speedup:>8s} "
                             f"{row['speedup_over_own_one']:10.2f}")
    return out

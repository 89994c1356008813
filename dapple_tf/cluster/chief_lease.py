"""Workers that end with their chief: a heartbeat from the chief's process to every worker task.

The chief runs no TF server, so nothing in TensorFlow tells a worker that its chief is gone: a worker
whose chief died would serve for ever (an orphan holding its port and devices). When TF_CONFIG names
the chief's address ("cluster": {"chief": ["host:port"]}, as Kubeflow writes it), the process that
runs the chief holds a `ChiefLease`: it listens there and sends every connected worker one line per
`interval_s` ("alive"), then "done CODE" when the chief command ends. Each worker runs `watch_chief`:
it connects (retrying until `connect_timeout_s`), reads the lines and returns the outcome:
- "done 0": the chief finished; the worker exits 0.
- "done CODE", the connection closed without "done" (the chief's process was killed: its kernel
  closes the socket), or nothing for `silence_s` (its machine stopped or the network broke): the
  worker exits non-zero naming the chief.
So a lost chief ends every worker within seconds, and a restart policy that restarts failed tasks
restarts them all together (recovery needs every task restarted: WORKSPACE_NOTES.md, "Cluster runtime").
"""

import dataclasses
import select
import socket
import threading
import time
from typing import List

from dapple_tf.cluster.servers import ClusterError, parse_address

ALIVE, DONE = "alive", "done"


@dataclasses.dataclass(frozen=True)
class ChiefOutcome:
    """What a worker learned about its chief: the exit code the worker should end with, and why."""

    exit_code: int
    reason: str


class ChiefLease:
    """The chief side: listen at the chief's address and beat to every worker; a context manager.

    `release(code)` (or leaving the context, with code 1 on an exception) tells the workers how the
    chief ended.
    """

    def __init__(self, address: str, interval_s: float = 1.0):
        self.address, self.interval_s = address, interval_s
        _, port = parse_address(address, "the chief")
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind(("", port))
        except OSError as e:
            self._listener.close()
            raise ClusterError(f"the chief ({address}): port {port} is in use on this host ({e.strerror})") from None
        self._listener.listen(64)
        self._workers: List[socket.socket] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="dapple_chief_lease", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, exc_type, *exc):
        self.release(1 if exc_type else 0)
        return False

    def _beat(self):
        next_beat = 0.0
        while not self._stop.is_set():
            readable, _, _ = select.select([self._listener], [], [], max(0.0, min(0.2, next_beat - time.monotonic())))
            with self._lock:
                if readable and not self._stop.is_set():
                    connection, _ = self._listener.accept()
                    self._workers.append(connection)
                    self._send(connection, ALIVE)
                if time.monotonic() >= next_beat:
                    for connection in list(self._workers):
                        self._send(connection, ALIVE)
                    next_beat = time.monotonic() + self.interval_s

    def _send(self, connection: socket.socket, line: str) -> None:
        try:
            connection.sendall(f"{line}\n".encode())
        except OSError:  # that worker is gone; the chief's own watchdog reports lost workers
            self._workers.remove(connection)
            connection.close()

    def release(self, exit_code: int) -> None:
        """Tells every worker the chief ended with `exit_code`, and stops listening."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._lock:
            for connection in list(self._workers):
                self._send(connection, f"{DONE} {exit_code}")
                if connection in self._workers:
                    connection.close()
            self._workers.clear()
            self._listener.close()


def watch_chief(address: str, connect_timeout_s: float = 600.0, silence_s: float = 30.0,
                poll_s: float = 0.5) -> ChiefOutcome:
    """The worker side: blocks until the chief ends or is lost; see the module docstring."""
    host, port = parse_address(address, "the chief")
    deadline = time.monotonic() + connect_timeout_s
    while True:
        try:
            connection = socket.create_connection((host, port), timeout=max(0.1, min(3.0, connect_timeout_s)))
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                return ChiefOutcome(1, f"the chief ({address}) did not come up within {connect_timeout_s:g} s "
                                       f"({e.strerror or e})")
            time.sleep(poll_s)
    with connection:
        connection.settimeout(silence_s)
        return _read_beats(connection, address, silence_s)


def _read_beats(connection: socket.socket, address: str, silence_s: float) -> ChiefOutcome:
    pending = b""
    while True:
        try:
            data = connection.recv(4096)
        except socket.timeout:
            return ChiefOutcome(1, f"the chief ({address}) sent nothing for {silence_s:g} s (stopped or unreachable)")
        except OSError as e:
            return ChiefOutcome(1, f"the chief ({address}) went away ({e.strerror or e})")
        if not data:
            return ChiefOutcome(1, f"the chief ({address}) went away: its process ended without finishing")
        pending += data
        *lines, pending = pending.split(b"\n")
        outcome = next((_outcome(line.decode(errors="replace"), address) for line in lines
                        if line.startswith(DONE.encode())), None)
        if outcome:
            return outcome


def _outcome(line: str, address: str) -> ChiefOutcome:
    code = line.split()[1] if len(line.split()) > 1 else "?"
    if code == "0":
        return ChiefOutcome(0, f"the chief ({address}) finished")
    return ChiefOutcome(1, f"the chief ({address}) ended with exit code {code}")

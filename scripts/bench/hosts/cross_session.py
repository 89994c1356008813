"""How a tensor crosses from one task's session to another's: the candidates for per-host graphs (issue 46).

    python -m scripts.bench.hosts.cross_session                     # 2 local workers, 64 KiB and 4 MiB, 8 per step
    python -m scripts.bench.hosts.cross_session --sizes_kib=512 --per_step=16 --steps=30

With one graph per host, a stage boundary between hosts joins two independent sessions. This starts two pinned
worker processes (dapple_launch's local cluster, 1 core each) and, as the chief, times `--per_step` transfers of a
`--sizes_kib` tensor from task 0 to task 1 per step, `--steps` steps, each way of doing it:
- in-graph: today's runtime, one session whose graph holds both sides (TF's own send/receive pair);
- collective: two sessions, one per task, each running its own graph: `collective_ops.broadcast_send` on task 0 and
  `broadcast_recv` on task 1, a group of two per pair, an instance key per transfer (as MultiWorkerMirroredStrategy's
  between-graph collectives run);
- queue: two sessions; a FIFOQueue with a shared name on task 1's device, task 0's graph enqueues, task 1's dequeues
  (as SyncReplicasOptimizer's workers share token queues).
The two sessions of a way run at once, each in a thread of the chief; a step's time is the slower thread's. Prints
each way's milliseconds per transfer and its ratio to in-graph.
"""

import statistics
import threading
import time

from absl import flags

from scripts.bench import harness
from scripts.cli import reject_arguments, run_main

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes_kib", ["64", "4096"], "Tensor sizes, KiB.")
flags.DEFINE_integer("per_step", 8, "Transfers per step (the micro-batches of a stage boundary).")
flags.DEFINE_integer("steps", 20, "Timed steps per way (after 3 warm-up steps); the median is kept.")
flags.DEFINE_boolean("as_chief", False, "Internal: run as the chief under dapple_launch.")

GROUP_KEY = 46


def _in_graph(tf, cluster, config, elements: int):
    graph = tf.Graph()
    with graph.as_default():
        with tf.device(cluster.device(0, "CPU", 0)):
            source = tf.Variable(tf.ones([elements]), name="source")
            values = [source.read_value() + float(i) for i in range(FLAGS.per_step)]
        with tf.device(cluster.device(1, "CPU", 0)):
            done = tf.add_n([tf.reduce_sum(v) for v in values])
    session = tf.compat.v1.Session(cluster.target, graph=graph, config=config)
    session.run(source.initializer)
    return [(session, done)]


def _collective(tf, cluster, config, elements: int, first_key: int):
    from tensorflow.python.ops import collective_ops

    sender, receiver = tf.Graph(), tf.Graph()
    with sender.as_default(), tf.device(cluster.device(0, "CPU", 0)):
        source = tf.Variable(tf.ones([elements]), name="source")
        sent, previous = [], None
        for i in range(FLAGS.per_step):
            with tf.control_dependencies([previous] if previous is not None else []):
                previous = collective_ops.broadcast_send(source.read_value() + float(i), [elements], tf.float32,
                                                         group_size=2, group_key=GROUP_KEY, instance_key=first_key + i)
            sent.append(previous)
        send_done = tf.group(*sent)
    with receiver.as_default(), tf.device(cluster.device(1, "CPU", 0)):
        received = [tf.reduce_sum(collective_ops.broadcast_recv([elements], tf.float32, group_size=2,
                                                                group_key=GROUP_KEY, instance_key=first_key + i))
                    for i in range(FLAGS.per_step)]
        receive_done = tf.add_n(received)
    sessions = [tf.compat.v1.Session(f"grpc://{cluster.workers[0]}", graph=sender, config=config),
                tf.compat.v1.Session(f"grpc://{cluster.workers[1]}", graph=receiver, config=config)]
    sessions[0].run(source.initializer)
    return [(sessions[0], send_done), (sessions[1], receive_done)]


def _queue(tf, cluster, config, elements: int, name: str):
    def queue():
        with tf.device(cluster.device(1, "CPU", 0)):
            return tf.queue.FIFOQueue(FLAGS.per_step, [tf.float32], shapes=[[elements]], shared_name=name)

    sender, receiver = tf.Graph(), tf.Graph()
    with sender.as_default():
        with tf.device(cluster.device(0, "CPU", 0)):
            source = tf.Variable(tf.ones([elements]), name="source")
            values = [source.read_value() + float(i) for i in range(FLAGS.per_step)]
        q, previous = queue(), None
        for value in values:
            with tf.control_dependencies([previous] if previous is not None else []):
                previous = q.enqueue([value])
        send_done = previous
    with receiver.as_default():
        q = queue()
        with tf.device(cluster.device(1, "CPU", 0)):
            receive_done = tf.add_n([tf.reduce_sum(q.dequeue()) for _ in range(FLAGS.per_step)])
    sessions = [tf.compat.v1.Session(f"grpc://{cluster.workers[0]}", graph=sender, config=config),
                tf.compat.v1.Session(f"grpc://{cluster.workers[1]}", graph=receiver, config=config)]
    sessions[0].run(source.initializer)
    return [(sessions[0], send_done), (sessions[1], receive_done)]


def _step_ms(runs) -> float:
    """The median over --steps of one step of every (session, fetch) at once, each in a thread: the slowest."""
    def one_step():
        durations = [0.0] * len(runs)

        def run(i, session, fetch):
            start = time.perf_counter()
            session.run(fetch)
            durations[i] = time.perf_counter() - start

        threads = [threading.Thread(target=run, args=(i, s, f)) for i, (s, f) in enumerate(runs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return max(durations) * 1e3

    for _ in range(3):
        one_step()
    return statistics.median(one_step() for _ in range(FLAGS.steps))


def chief() -> int:
    import tensorflow as tf

    from dapple_tf.cluster.servers import TFCluster, session_config, wait_for_workers

    cluster = TFCluster.from_tf_config()
    wait_for_workers(cluster, 120)
    config = session_config(120)
    print(f"{FLAGS.per_step} transfers per step from task 0 to task 1, median of {FLAGS.steps} steps")
    print(f"{'KiB':>6} {'way':<11} {'ms per step':>12} {'ms per transfer':>16} {'vs in-graph':>12}")
    progress = harness.Progress(3 * len(FLAGS.sizes_kib), "ways x sizes")
    for k, kib in enumerate(FLAGS.sizes_kib):
        elements = int(kib) * 256
        base = None
        for way in ("in-graph", "collective", "queue"):
            if way == "in-graph":
                runs = _in_graph(tf, cluster, config, elements)
            elif way == "collective":
                runs = _collective(tf, cluster, config, elements, 1000 * (k + 1))  # keys of one shape each
            else:
                runs = _queue(tf, cluster, config, elements, f"cross_session_{kib}")
            ms = _step_ms(runs)
            base = base or ms
            print(f"{int(kib):>6} {way:<11} {ms:>12.2f} {ms / FLAGS.per_step:>16.3f} {ms / base:>11.2f}x", flush=True)
            for session, _ in runs:
                session.close()
            progress.advance()
    return 0


def main(argv):
    reject_arguments(argv)
    if FLAGS.as_chief:
        return chief()
    passed = [f"--sizes_kib={','.join(FLAGS.sizes_kib)}", f"--per_step={FLAGS.per_step}", f"--steps={FLAGS.steps}",
              "--as_chief"]
    launch = harness.launch_command("local:2x1", harness.module_command("scripts.bench.hosts.cross_session", *passed),
                                    "--cores_per_worker=1", "--grace=30")
    code, _ = harness.stream_command(launch, lambda line: print(line, flush=True))
    return code


if __name__ == "__main__":
    run_main(main)

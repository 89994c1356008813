"""dapple_launch: run dapple_train (or any chief command) on a TensorFlow cluster.

Three ways:
  dapple_launch --cluster=local:3x2 -- dapple_train --model=mlp --global_batch_size=24 --steps=6 --model_dir=m
      starts 3 worker servers on loopback (separate processes, 2 virtual CPU devices each, in a private
      network namespace), runs the command as the chief against them with TF_CONFIG set, prefixes every
      line with its task, and stops every process when the chief ends, a worker dies, or on Ctrl-C.
  dapple_launch --tf_config [-- COMMAND]
      runs this host's role from TF_CONFIG: a worker serves until its chief ends; the chief runs COMMAND
      and, when TF_CONFIG names its address ("cluster": {"chief": ["host:port"]}), tells the workers
      there that it is alive, so that they exit when it ends or dies (dapple_tf/cluster/chief_lease.py).
  dapple_launch --emit=k8s|slurm --cluster=FILE --image=IMAGE -- dapple_train ...
      writes a Kubernetes manifest (pods + headless Service + NetworkPolicy, or --k8s_kind=tfjob) or a
      Slurm batch script that starts the same roles (--cluster: dapple_plan's cluster file or preset)
      and starts them all again when a task fails (--max_restarts; job_specs.py says how).

Exit code: the chief's; non-zero when a task failed, with how to resume (run the same command again:
dapple_train continues from the latest checkpoint in its --model_dir). TF's gRPC runtime has no
authentication: run real clusters on a private network.
"""

import os
import sys
import threading

from absl import flags

from scripts.cli import run_main

FLAGS = flags.FLAGS
flags.DEFINE_string("cluster", None, "local:TASKSxDEVICES to start a local cluster; with --emit, the cluster "
                    "description (dapple_plan's --cluster: a preset or a file).")
flags.DEFINE_boolean("tf_config", False, "Run this host's role from TF_CONFIG (worker: serve; chief: run COMMAND).")
flags.DEFINE_integer("virtual_devices", 0, "With --tf_config on a worker: split its CPU into this many devices.")
flags.DEFINE_enum("emit", None, ["k8s", "slurm"], "Write a job spec instead of running.")
flags.DEFINE_enum("k8s_kind", "pods", ["pods", "tfjob"], "With --emit=k8s: plain pods + Service, or a Kubeflow TFJob.")
flags.DEFINE_string("image", None, "With --emit=k8s: the container image with dapple_tf installed.")
flags.DEFINE_string("name", "dapple", "With --emit: the job's name.")
flags.DEFINE_integer("port", 2222, "With --emit: the workers' gRPC port.")
flags.DEFINE_integer("max_restarts", 3, "With --emit: how often a failed job is started again (Slurm, TFJob); "
                     "plain Kubernetes pods restart until the chief succeeds.")
flags.DEFINE_string("output", None, "With --emit: where to write the spec (default: stdout).")
flags.DEFINE_boolean("isolate_network", True, "Local clusters run in a private network namespace (loopback only).")
flags.DEFINE_float("grace", 10, "After a worker dies, how long the chief gets to stop by itself (s): its watchdog "
                   "ends it within seconds of a task's process ending.")
flags.DEFINE_float("failure_timeout", 30, "With --tf_config on a worker: exit when the chief sent nothing for this "
                   "long (s); a chief whose process ended is seen at once.")
flags.DEFINE_float("chief_wait_timeout", 600, "With --tf_config on a worker: exit when the chief has not come up "
                   "within this long (s).")
flags.DEFINE_integer("cores_per_worker", None, "Local cluster: pin each worker to this many cores of its own (0: "
                     "unpinned; default: this machine's cores / tasks, unpinned when there are more tasks than cores).")
flags.DEFINE_integer("intra_op_threads", None, "Worker thread pool for one kernel's parallelism (default: its cores; "
                     "unpinned: TF's default).")
flags.DEFINE_integer("inter_op_threads", None, "Worker thread pool running independent ops (default: its cores + 1, "
                     "so receiving and sending overlap compute; unpinned: TF's default).")

RESUME_HINT = ("dapple_launch: training did not finish; to resume from the last checkpoint, run the same command "
               "again (dapple_train continues from the latest checkpoint in its --model_dir)")


def pinned_cores() -> int:
    """The cores this process may run on when it was pinned to fewer than the machine has, else 0."""
    if not hasattr(os, "sched_getaffinity"):
        return 0
    mine = len(os.sched_getaffinity(0))
    return mine if mine < (os.cpu_count() or mine) else 0


def worker_threads(cores: int):
    """WorkerThreads from --intra_op_threads/--inter_op_threads, defaulting to those for `cores`."""
    from dapple_tf.cluster.servers import WorkerThreads

    default = WorkerThreads.for_cores(cores)
    intra = default.intra_op if FLAGS.intra_op_threads is None else FLAGS.intra_op_threads
    inter = default.inter_op if FLAGS.inter_op_threads is None else FLAGS.inter_op_threads
    if intra < 0 or inter < 0:
        raise ValueError(f"thread counts must be >= 0, got intra {intra}, inter {inter}")
    return WorkerThreads(intra, inter)


def serve_or_run(command):
    """--tf_config: a worker starts its server and waits; the chief runs the command."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from dapple_tf.cluster.servers import TFCluster

    cluster = TFCluster.from_tf_config()
    if cluster.task_type == "chief":
        return run_chief(cluster, command)
    if command:
        raise ValueError(f"a worker task runs no command, got: {' '.join(command)}")
    return serve(cluster)


def run_chief(cluster, command):
    """Runs the chief command; with the chief's address in TF_CONFIG, holds the lease the workers watch."""
    from dapple_tf.cluster.chief_lease import ChiefLease
    from dapple_tf.cluster.launch_local import command_line, run_child

    args = command_line(command)
    if not cluster.chief:
        print('dapple_launch: TF_CONFIG names no chief address ("cluster": {"chief": ["host:port"]}): the workers '
              "will not end when this chief does", file=sys.stderr, flush=True)
        os.execvp(args[0], args)
    with ChiefLease(cluster.chief) as lease:
        print(f"dapple_launch: the chief's workers watch it at {cluster.chief}", flush=True)
        code = run_child(args)
        lease.release(code)
    return code


def serve(cluster):
    """A worker: starts its server and serves until its chief ends (or for ever, with no chief address)."""
    from dapple_tf.cluster.servers import start_server, usable_cores

    threads = worker_threads(pinned_cores())
    server = start_server(cluster, FLAGS.virtual_devices or None, threads)
    cores = list(usable_cores())
    where = f"{cluster.describe_task(cluster.task_index)}"
    print(f"worker task {cluster.task_index} serving at {cluster.workers[cluster.task_index]} "
          f"(target {server.target}; cores {cores}, threads intra {threads.intra_op} inter {threads.inter_op})",
          flush=True)
    if cluster.chief:
        threading.Thread(target=end_with_chief, args=(cluster.chief, where), daemon=True).start()
    else:
        print(f"{where}: TF_CONFIG names no chief address: serving until stopped", flush=True)
    server.join()
    return 0


def end_with_chief(chief, where):
    """Ends this worker's process when its chief ends or is lost (the server's join cannot be interrupted)."""
    from dapple_tf.cluster.chief_lease import watch_chief

    outcome = watch_chief(chief, connect_timeout_s=FLAGS.chief_wait_timeout, silence_s=FLAGS.failure_timeout)
    print(f"{where}: {outcome.reason}: exiting", file=sys.stdout if outcome.exit_code == 0 else sys.stderr,
          flush=True)
    os._exit(outcome.exit_code)  # pylint: disable=protected-access


def emit(command):
    from planner.formats.cluster import load_cluster
    from dapple_tf.cluster import job_specs

    if not FLAGS.cluster:
        raise ValueError("--emit needs --cluster (a cluster file or preset: its servers become worker tasks)")
    if not command:
        raise ValueError("--emit needs the chief's command after `--`, e.g. -- dapple_train --model=bert ...")
    cluster = load_cluster(FLAGS.cluster)
    cpu = cluster.device_kind.upper() == "CPU"
    gpus = 0 if cpu else cluster.devices_per_server
    cpu_devices = cluster.devices_per_server if cpu else 0
    if FLAGS.emit == "k8s":
        if not FLAGS.image:
            raise ValueError("--emit=k8s needs --image (a container image with dapple_tf installed)")
        text = job_specs.kubernetes(FLAGS.name, FLAGS.image, cluster.num_servers, gpus, command, FLAGS.port,
                                    FLAGS.k8s_kind, cpu_devices, FLAGS.max_restarts)
    else:
        text = job_specs.slurm(FLAGS.name, cluster.num_servers, gpus, command, FLAGS.port, cpu_devices,
                               FLAGS.max_restarts)
    if FLAGS.output:
        with open(FLAGS.output, "w") as f:
            f.write(text)
        print(f"wrote {FLAGS.output}: {cluster.num_servers} worker tasks and a chief")
    else:
        sys.stdout.write(text)
    return 0


def main(argv):
    command = argv[1:]
    modes = sum([bool(FLAGS.tf_config), bool(FLAGS.emit), bool(FLAGS.cluster and not FLAGS.emit)])
    if modes != 1:
        raise ValueError("choose one: --cluster=local:TxD (a local cluster), --tf_config (this host's role) "
                         "or --emit=k8s|slurm --cluster=FILE")
    if FLAGS.tf_config:
        return serve_or_run(command)
    if FLAGS.emit:
        return emit(command)
    from planner.formats.cluster import parse_local_tasks
    from dapple_tf.cluster import launch_local

    tasks, devices = parse_local_tasks(FLAGS.cluster)
    launch_local.command_line(command)  # a bad command fails before anything starts
    if FLAGS.isolate_network:
        launch_local.reexec_in_private_network(sys.argv[1:])
    from dapple_tf.cluster.servers import usable_cores

    cores = launch_local.default_cores_per_worker(tasks) if FLAGS.cores_per_worker is None else FLAGS.cores_per_worker
    code = launch_local.run_local(tasks, devices, command, grace_s=FLAGS.grace, cores_per_worker=cores,
                                  threads=worker_threads(min(cores, len(usable_cores()))))
    if code:
        print(RESUME_HINT, file=sys.stderr, flush=True)
    return code


def run():
    run_main(main)


if __name__ == "__main__":
    run()

"""dapple_launch: run dapple_train (or another training command) on a TensorFlow cluster.

Ways:
  dapple_launch --cluster=local:3x2 -- dapple_train --model=mlp --global_batch_size=24 --steps=6 --model_dir=m
      starts 3 worker servers on loopback (separate processes, 2 virtual CPU devices each, in a private
      network namespace) and runs the command in every worker task with TF_CONFIG set: each task starts
      its own server and builds only its own part of the training graph (per-host graphs; without --plan,
      task 0 plans for all); prefixes every line with its task, and stops every process when a task ends
      with an error, dies, or on Ctrl-C.
  dapple_launch --cluster=local:3x2 --noper_host -- dapple_train ...
      runs the command once, as the chief, against the workers instead: one graph for the whole cluster.
  dapple_launch --tf_config [-- COMMAND]
      runs this host's role from TF_CONFIG: a worker serves until its chief ends, or, given COMMAND, runs it
      (per-host training); the chief runs COMMAND
      and, when TF_CONFIG names its address ("cluster": {"chief": ["host:port"]}), tells the workers
      there that it is alive, so that they exit when it ends or dies (dapple_tf/cluster/chief_lease.py).
  dapple_launch --emit=k8s|slurm --cluster=FILE --image=IMAGE -- dapple_train ...
      writes a Kubernetes manifest (pods + headless Service + NetworkPolicy, or --k8s_kind=tfjob) or a
      Slurm batch script that starts the same roles (--cluster: dapple_plan's cluster file or preset)
      and starts them all again when a task fails (--max_restarts; job_specs.py says how).

Exit code: the chief's (per host: non-zero when a task failed), with how to resume when training did
not finish (run the same command again: dapple_train continues from the latest checkpoint in its
--model_dir). TF's gRPC runtime has no
authentication: run real clusters on a private network.
"""

import os
import sys

from absl import flags

from scripts.cli import run_main

FLAGS = flags.FLAGS
flags.DEFINE_string("cluster", None, "local:TASKSxDEVICES to start a local cluster; with --emit, the cluster "
                    "description (dapple_plan's --cluster: a preset or a file).")
flags.DEFINE_boolean("tf_config", False, "Run this host's role from TF_CONFIG (worker: serve, or run COMMAND per host; chief: "
                     "run COMMAND).")
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
flags.DEFINE_boolean("per_host", True, "Local cluster or --emit: run the command in every worker task (each builds "
                     "only its own part of the training graph: per-host graphs); --noper_host: in one chief instead, "
                     "which builds the whole cluster's graph (a command that is only a chief's needs it).")
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


def main(argv):
    command = argv[1:]
    modes = sum([bool(FLAGS.tf_config), bool(FLAGS.emit), bool(FLAGS.cluster and not FLAGS.emit)])
    if modes != 1:
        raise ValueError("choose one: --cluster=local:TxD (a local cluster), --tf_config (this host's role) "
                         "or --emit=k8s|slurm --cluster=FILE")
    if FLAGS.tf_config:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from dapple_tf.cluster import roles

    if FLAGS.tf_config:
        return roles.serve_or_run(command, roles.WorkerSettings(
            virtual_devices=FLAGS.virtual_devices, intra_op_threads=FLAGS.intra_op_threads,
            inter_op_threads=FLAGS.inter_op_threads, chief_wait_timeout_s=FLAGS.chief_wait_timeout,
            failure_timeout_s=FLAGS.failure_timeout))
    if FLAGS.emit:
        spec = roles.JobSpecSettings(kind=FLAGS.emit, name=FLAGS.name, image=FLAGS.image, port=FLAGS.port,
                                     k8s_kind=FLAGS.k8s_kind, max_restarts=FLAGS.max_restarts, per_host=FLAGS.per_host)
        return roles.emit_spec(FLAGS.cluster, command, spec, FLAGS.output)
    return roles.launch_local_cluster(FLAGS.cluster, command, sys.argv[1:], isolate_network=FLAGS.isolate_network,
                                      grace_s=FLAGS.grace, cores_per_worker=FLAGS.cores_per_worker,
                                      intra_op_threads=FLAGS.intra_op_threads,
                                      inter_op_threads=FLAGS.inter_op_threads, per_host=FLAGS.per_host)


def run():
    run_main(main)


if __name__ == "__main__":
    run()

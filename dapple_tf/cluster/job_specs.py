"""Cluster job specs for dapple_launch --emit: Kubernetes manifests and Slurm batch scripts.

Every spec starts the same roles as a local launch: one worker task per server of the cluster
description (`dapple_launch --tf_config`, a TF server that joins and waits) and one chief
(`dapple_launch --tf_config -- COMMAND`, the client that builds and runs the pipelined graph),
each with its TF_CONFIG. TF's gRPC has no authentication: the Kubernetes specs add a
NetworkPolicy that admits only the job's own pods; Slurm jobs must run on a private network.
The chief and worker task 0 must see the same --model_dir (checkpoints are written by task 0).

TF_CONFIG names the chief's address too: the chief's process beats to the workers there, so that
workers end when their chief does (dapple_tf/cluster/chief_lease.py). Recovery is a restart of every task,
then the chief resumes from the latest checkpoint; each spec restarts a failed job that way:
- Kubernetes pods: restartPolicy OnFailure. A lost worker ends the chief (its watchdog) and a lost
  chief ends the workers (the lease), so every task fails and is restarted by the kubelet (with its
  back-off), until the chief succeeds; delete the pods to stop retrying.
- Kubeflow TFJob: restartPolicy OnFailure for every replica, at most `max_restarts` restarts
  (runPolicy.backoffLimit).
- Slurm: the batch script starts the workers and the chief again after a failure, at most
  `max_restarts` times, on the same nodes.
"""

import json
import shlex
from typing import List, Optional, Sequence

import yaml

K8S_KINDS = ("pods", "tfjob")


def _container(name: str, image: str, args: List[str], port: int, gpus: int, env=None) -> dict:
    container = {"name": name, "image": image, "command": args, "ports": [{"containerPort": port, "name": "grpc"}]}
    if env:
        container["env"] = env
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    return container


def _tf_config(workers: List[str], chief: Optional[str], role: str, index: int) -> str:
    cluster = {"worker": workers, **({"chief": [chief]} if chief else {})}
    return json.dumps({"cluster": cluster, "task": {"type": role, "index": index}})


def _launch_args(role: str, command: Sequence[str], cpu_devices: int, per_host: bool = False) -> List[str]:
    args = ["dapple_launch", "--tf_config"]
    if role == "worker" and cpu_devices:
        args.append(f"--virtual_devices={cpu_devices}")
    return args + (["--", *command] if role == "chief" or per_host else [])


def kubernetes(name: str, image: str, num_workers: int, gpus_per_worker: int, command: Sequence[str],
               port: int = 2222, kind: str = "pods", cpu_devices: int = 0, max_restarts: int = 3,
               per_host: bool = False) -> str:
    """A multi-document YAML manifest: pods + headless Service + NetworkPolicy, or a Kubeflow TFJob (`per_host`:
    every worker runs the command, and there is no chief)."""
    labels = {"app": name}
    policy = {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": f"{name}-only-job"},
        "spec": {"podSelector": {"matchLabels": labels}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"podSelector": {"matchLabels": labels}}]}]},
    }
    if kind == "tfjob":
        def replica(role, count):
            return {"replicas": count, "restartPolicy": "OnFailure", "template": {
                "metadata": {"labels": dict(labels, role=role)},
                "spec": {"containers": [_container("tensorflow", image,
                                                   _launch_args(role, command, cpu_devices, per_host),
                                                   port, gpus_per_worker if role == "worker" else 0)]}}}
        replicas = {**({} if per_host else {"Chief": replica("chief", 1)}), "Worker": replica("worker", num_workers)}
        job = {"apiVersion": "kubeflow.org/v1", "kind": "TFJob", "metadata": {"name": name},
               "spec": {"runPolicy": {"backoffLimit": max_restarts}, "tfReplicaSpecs": replicas}}
        return yaml.safe_dump_all([job, policy], sort_keys=False)
    if kind != "pods":
        raise ValueError(f"unknown Kubernetes kind {kind!r}; expected one of {K8S_KINDS}")
    workers = [f"{name}-worker-{i}.{name}:{port}" for i in range(num_workers)]
    chief = None if per_host else f"{name}-chief.{name}:{port}"
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
               "spec": {"clusterIP": "None", "selector": labels, "ports": [{"name": "grpc", "port": port}]}}

    def pod(pod_name, role, index):
        tf_config = _tf_config(workers, chief, role, index)
        gpus = gpus_per_worker if role == "worker" else 0
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod_name, "labels": dict(labels, role=role, task=str(index))},
                "spec": {"hostname": pod_name, "subdomain": name, "restartPolicy": "OnFailure",
                         "containers": [_container(role, image, _launch_args(role, command, cpu_devices, per_host),
                                                   port, gpus, env=[{"name": "TF_CONFIG", "value": tf_config}])]}}
    pods = [pod(f"{name}-worker-{i}", "worker", i) for i in range(num_workers)]
    pods += [] if per_host else [pod(f"{name}-chief", "chief", 0)]
    return yaml.safe_dump_all([service, policy] + pods, sort_keys=False)


def slurm(name: str, num_workers: int, gpus_per_worker: int, command: Sequence[str], port: int = 2222,
          cpu_devices: int = 0, max_restarts: int = 3, per_host: bool = False) -> str:
    """A batch script: a worker task per node (srun), the chief on the first node (its lease at port + 1), or with
    `per_host` the command in every worker task and no chief; TF_CONFIG from the node list; the whole job started
    again after a failure, `max_restarts` times."""
    gres = f"#SBATCH --gres=gpu:{gpus_per_worker}\n" if gpus_per_worker else ""
    worker = " ".join(shlex.quote(a) for a in _launch_args("worker", command, cpu_devices, per_host))
    chief = " ".join(shlex.quote(a) for a in _launch_args("chief", command, cpu_devices))
    srun = (f"srun --nodes={num_workers} --ntasks={num_workers} --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c \\\n"
            f"    'TF_CONFIG=\"{{\\\"cluster\\\": $DAPPLE_CLUSTER, \\\"task\\\": {{\\\"type\\\": \\\"worker\\\", "
            f"\\\"index\\\": $SLURM_PROCID}}}}\" exec {worker}'")
    if per_host:
        where = "every worker task runs the command (per-host training), worker task i on node i"
        cluster = 'export DAPPLE_CLUSTER="{\\"worker\\": $WORKERS}"'
        attempt = f"""  CODE=0
  {srun} || CODE=$?
  if [ "$CODE" -eq 0 ]; then exit 0; fi
  echo "dapple: attempt $ATTEMPT failed (exit code $CODE)" >&2"""
    else:
        where = "worker task i runs on node i; the chief runs here, on the first node"
        cluster = ('export DAPPLE_CLUSTER="{\\"worker\\": $WORKERS, \\"chief\\": [\\"${NODES[0]}:$((PORT + 1))\\"]}"')
        attempt = f"""  {srun} &
  WORKERS_PID=$!
  CODE=0
  TF_CONFIG="{{\\"cluster\\": $DAPPLE_CLUSTER, \\"task\\": {{\\"type\\": \\"chief\\", \\"index\\": 0}}}}" {chief} || CODE=$?
  # the workers end with their chief; stop any that never reached it
  for _ in $(seq 150); do kill -0 $WORKERS_PID 2>/dev/null || break; sleep 0.1; done
  kill $WORKERS_PID 2>/dev/null || true
  wait $WORKERS_PID || true
  if [ "$CODE" -eq 0 ]; then exit 0; fi
  echo "dapple: attempt $ATTEMPT failed (chief exit code $CODE)" >&2"""
    return f"""#!/bin/bash
#SBATCH --job-name={name}
#SBATCH --nodes={num_workers}
#SBATCH --ntasks-per-node=1
{gres}# dapple_launch --emit=slurm: {where}.
# A failed attempt (any task lost) is started again on the same nodes, at most {max_restarts} times; training
# resumes from the latest checkpoint in its --model_dir.
# TF's gRPC has no authentication: run this job on a private network only.
set -euo pipefail
PORT={port}
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if [ "${{#NODES[@]}}" -ne {num_workers} ]; then echo "expected {num_workers} nodes, got ${{#NODES[@]}}" >&2; exit 1; fi
WORKERS=$(printf '"%s:'"$PORT"'",' "${{NODES[@]}}"); WORKERS="[${{WORKERS%,}}]"
WORKERS_PID=
trap 'if [ -n "$WORKERS_PID" ]; then kill $WORKERS_PID 2>/dev/null || true; fi' EXIT
{cluster}
for ATTEMPT in $(seq 0 {max_restarts}); do
{attempt}
done
exit "$CODE"
"""

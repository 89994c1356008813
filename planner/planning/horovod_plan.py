"""Plans for the Horovod backend: one server's plan, run by each of P processes.

Under horovodrun every process builds the same pipeline over its own server's devices and gradients
are averaged across processes, so the plan is a plan for one server at the per-process batch,
stamped with the number of processes: its cluster has `num_servers = P` servers like the first
(servers 1.. named "/job:horovod/replica:0/task:s/device:..." for the record), its stages use
server 0's local devices only, and `global_batch_size` is one process's batch. Plans whose stages
span servers (unequal replication across servers) stay on the gRPC runtime.
"""

from planner.formats import plan_pb2


class HorovodPlanError(ValueError):
    pass


def per_process_plan(server_plan: plan_pb2.Plan, num_processes: int) -> plan_pb2.Plan:
    """`server_plan` (planned for one server at the per-process batch) stamped for `num_processes`."""
    cluster = server_plan.cluster
    if num_processes < 1:
        raise HorovodPlanError(f"--num_processes must be >= 1, got {num_processes}")
    if cluster.num_servers != 1:
        raise HorovodPlanError(
            f"a Horovod plan is planned for one server (each process runs it on its own devices), but cluster "
            f"{cluster.name!r} has {cluster.num_servers} servers: plan with --cluster=local or a one-server cluster"
        )
    local_names = list(cluster.device_names)
    if any(not name.startswith("/device:") for name in local_names):
        raise HorovodPlanError(f"a Horovod plan needs local device names (/device:TYPE:i), got {local_names[:2]}")
    plan = plan_pb2.Plan()
    plan.CopyFrom(server_plan)
    plan.cluster.name = f"horovod:{num_processes}x({cluster.name})"
    plan.cluster.num_servers = num_processes
    for server in range(1, num_processes):
        plan.cluster.device_names.extend(f"/job:horovod/replica:0/task:{server}{name}" for name in local_names)
    return plan


def num_processes(plan: plan_pb2.Plan) -> int:
    """How many Horovod processes `plan` is for; a clear error if its stages are not one server's."""
    cluster = plan.cluster
    per_server = cluster.devices_per_server or len(cluster.device_names)
    outside = sorted({d for stage in plan.stages for d in stage.device_ids if d >= per_server})
    if outside:
        raise HorovodPlanError(
            f"the plan's stages use devices {outside} beyond the first server's {per_server}: it spans servers, "
            "which the Horovod backend cannot run (use the gRPC runtime, or dapple_plan --backend=horovod)"
        )
    return max(1, cluster.num_servers)

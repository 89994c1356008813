"""The short name of a plan's shape ("8:8", "DP", "straight (4 stages)", ...), for the planner's report and its
ties (report.py, ties.py)."""

from planner.formats import plan_pb2


def shape(plan: plan_pb2.Plan) -> str:
    """"8:8", "DP", "straight (4 stages)", "2 device groups x 2 stages (8:8)" (interleaved); "+RC" when every
    stage re-computes, "+RC[0,2]" when some do."""
    reps = [len(s.device_ids) for s in plan.stages]
    groups = len({tuple(s.device_ids) for s in plan.stages})
    if groups < len(reps):
        shape = f"{groups} device groups x {len(reps) // groups} stages ({':'.join(map(str, reps[:groups]))})"
    elif len(reps) == 1:
        shape = "DP" if reps[0] > 1 else "single device"
    elif all(r == 1 for r in reps):
        shape = f"straight ({len(reps)} stages)"
    else:
        shape = ":".join(str(r) for r in reps)
    rc = [i for i, s in enumerate(plan.stages) if s.recompute]
    if rc:
        shape += " +RC" if len(rc) == len(reps) else " +RC[" + ",".join(map(str, rc)) + "]"
    return shape

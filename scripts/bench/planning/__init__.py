"""The planner and the simulator: planning time, the schedules simulated on the published profiles, and formula 2's
L against the simulator."""

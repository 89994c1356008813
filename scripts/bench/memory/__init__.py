"""Memory: the runtime's peaks of GPipe vs DAPPLE and re-computation (Table 5), the same simulated, and the
planner's memory estimate against the runtime's allocator peak."""

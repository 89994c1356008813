"""Numbers the runtime (dapple_tf) and the planner's cost model must agree on, kept with the data formats."""

# Gradients are all-reduced in buckets of about this size, in the order the last backward produces them
# (dapple_tf/rewrite/update/gradients.py); the cost model's AllReduce tail after the last backward assumes the same
# buckets.
ALLREDUCE_BUCKET_BYTES = 25 * 2**20

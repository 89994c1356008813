"""What the runtime's mechanisms cost, in one process or on a local cluster: graph build and time to the first step,
steady step of clones vs stage functions, observing training calls, AllReduce buckets, sync batch norm, weight
products over micro-batches, gRPC cluster and Horovod overheads."""

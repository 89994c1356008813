"""Per-host graphs (issue 46): one graph for the cluster vs one per host (scale, A/B of dapple_train), a tensor
across two sessions, the CPU a launch's processes use, and per-host graphs run in threads (the fuzz harness and
tests use it)."""

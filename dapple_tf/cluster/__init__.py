"""The cluster runtime: TF_CONFIG and servers, dapple_launch's roles, the local launcher and job specs,
failure handling (the chief's lease, the watchdog), and the link probe.
"""

"""The cluster runtime: TF_CONFIG and servers, the local launcher and job specs, failure handling
(the chief's lease, the watchdog), and the link probe.
"""

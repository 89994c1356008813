"""Benchmarks: each module is one absl program (python -m scripts.bench.<name>); they share the
harness in scripts/bench/harness.py.
"""

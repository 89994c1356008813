"""Benchmarks: each module with a main is one absl program, run as `python -m scripts.bench.<folder>.<name>`, sharing
scripts/bench/harness.py (session configs, virtual CPUs, plans, timing, subprocesses, progress lines, `--json` rows).
Folders by concern: speed/ (the speed benchmark on pinned workers and its peers), runtime/ (what the runtime's
mechanisms cost), hosts/ (per-host graphs), fuzz/ (random equivalence with one device), memory/ (peak memory,
runtime and planner) and planning/ (planner and simulator).
"""

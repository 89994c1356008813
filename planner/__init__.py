"""The DAPPLE planner: profiles and clusters in, parallelization plans out.

Pure Python: nothing in this package imports TensorFlow (tests/test_imports.py checks).
"""

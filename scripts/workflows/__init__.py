"""What the end-to-end programs do, as importable steps: dapple_train's run (train.py: model, inputs, profile,
plan, cluster, Trainer) and dapple_demo's (demo.py). They use every package (profiler, planner, dapple_tf,
models), so they live here, above them all; the programs in scripts/ only read flags and call them."""

"""dapple_tf: DAPPLE pipelined data-parallel training for TensorFlow (profiler, planner, graph runtime)."""

from setuptools import find_packages, setup

CONSOLE_SCRIPTS = [
    "dapple_profile = scripts.dapple_profile:run",
    "dapple_plan = scripts.dapple_plan:run",
    "dapple_simulate = scripts.dapple_simulate:run",
    "dapple_train = scripts.dapple_train:run",
    "dapple_launch = scripts.dapple_launch:run",
    "dapple_demo = scripts.dapple_demo:run",
]

setup(
    name="dapple_tf",
    version="0.1.0",
    description=__doc__,
    python_requires=">=3.9",
    packages=find_packages(include=["dapple_tf*", "planner*", "profiler*", "models*", "scripts*"]),
    package_data={"planner.formats": ["*.proto"]},
    install_requires=[
        # TensorFlow is deliberately not listed: tensorflow-cpu, tensorflow or a GPU build all
        # provide it, and requirements/*.txt pin the one each environment uses.
        "numpy",
        "protobuf>=4.21",
        "absl-py",
        "matplotlib",
        "pyyaml",  # dapple_launch --emit=k8s
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "scikit-learn"],
        "horovod": ["horovod==0.28.1", "tensorflow-estimator"],
        "demo": ["scikit-learn"],
    },
    entry_points={"console_scripts": CONSOLE_SCRIPTS},
)

"""Regenerates planner/formats/*_pb2.py from the .proto sources.

The sources and the generated modules live together in planner/formats/ (planner is the bottom of
the dependency chain and reads both schemas).

Generated with protoc 25.x (grpcio-tools 1.62.3): that gencode runs on protobuf 4.25 (TF 2.15)
and on the newest runtime (TF 2.21 ships protobuf 7). Run:
    python scripts/gen_protos.py            # rewrite the modules
    python scripts/gen_protos.py --check    # exit 1 if they are out of date
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = {
    "layer_cost": os.path.join(ROOT, "planner", "formats", "layer_cost.proto"),
    "plan": os.path.join(ROOT, "planner", "formats", "plan.proto"),
}
OUT_DIR = os.path.join(ROOT, "planner", "formats")


def generate(out_dir):
    """Compiles every source into out_dir/<name>_pb2.py; returns the written paths."""
    with tempfile.TemporaryDirectory() as staging:
        package_dir = os.path.join(staging, "planner", "formats")
        os.makedirs(package_dir)
        for name, src in SOURCES.items():
            shutil.copy(src, os.path.join(package_dir, name + ".proto"))
        protos = [os.path.join("planner", "formats", n + ".proto") for n in SOURCES]
        subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", "-I", staging, "--python_out", staging] + protos,
            check=True,
        )
        written = []
        for name in SOURCES:
            target = os.path.join(out_dir, name + "_pb2.py")
            shutil.copy(os.path.join(package_dir, name + "_pb2.py"), target)
            written.append(target)
        return written


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    if not args.check:
        for path in generate(OUT_DIR):
            print("wrote", os.path.relpath(path, ROOT))
        return 0
    with tempfile.TemporaryDirectory() as fresh:
        stale = []
        for path in generate(fresh):
            committed = os.path.join(OUT_DIR, os.path.basename(path))
            with open(path, "rb") as a, open(committed, "rb") as b:
                if a.read() != b.read():
                    stale.append(os.path.relpath(committed, ROOT))
    if stale:
        print("out of date with their .proto (run python scripts/gen_protos.py):", ", ".join(stale))
        return 1
    print("generated protobuf modules are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())

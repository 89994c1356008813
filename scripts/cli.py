"""Shared plumbing for the absl command-line programs.

Bad input (ValueError, OSError) prints one `error: ...` line and exits 1; `--help` exits 0
(absl itself exits 1 after printing help).
"""

import os
import sys

from absl import app

HELP_FLAGS = ("-h", "-?", "--help", "--helpshort", "--helpfull")
TF_LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL"


def quiet_tensorflow(argv=None) -> None:
    """Keeps TensorFlow's own log lines (CPU features, graph passes, a profiler session per traced step) out of
    a program's output unless `--verbosity`/`-v` (absl's flag) asks for INFO (0) or more, or the environment
    sets TF_CPP_MIN_LOG_LEVEL. Call before TensorFlow is imported: it reads the level once, at its first line."""
    if TF_LOG_LEVEL not in os.environ:
        os.environ[TF_LOG_LEVEL] = "0" if requested_verbosity(sys.argv[1:] if argv is None else argv) >= 0 else "2"


def requested_verbosity(args) -> int:
    """The absl verbosity `args` ask for (-1, absl's default: warnings and up)."""
    level = -1
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in ("--verbosity", "-verbosity", "-v", "--v"):
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            try:
                level = int(value)
            except ValueError:
                pass  # absl names the bad value when it parses the flags
    return level


def run_main(main):
    """Runs an absl `main(argv)` with the error and help handling above."""

    def guarded(argv):
        try:
            return main(argv)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1

    try:
        app.run(guarded)
    except SystemExit as e:
        if e.code == 1 and any(arg in HELP_FLAGS for arg in sys.argv[1:]):
            sys.exit(0)
        raise


def reject_arguments(argv) -> None:
    """ValueError naming the positional arguments after the program's name (the programs take none)."""
    if len(argv) > 1:
        raise ValueError(f"unexpected arguments: {' '.join(argv[1:])}")


def split_cpu(num_devices: int):
    """Splits the process's CPU into `num_devices` virtual devices (/device:CPU:0..n-1); call it
    before TensorFlow initialises its devices."""
    from dapple_tf.cluster.servers import split_cpu as split  # pylint: disable=import-outside-toplevel

    split(num_devices)


def shared_profiles(folder=None) -> str:
    """The folder of DAPPLE's published profiles: `folder` if given, else `../shared/profiles` beside this
    checkout; a clear error when it is missing."""
    folder = folder or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared",
                                    "profiles")
    if not os.path.isfile(os.path.join(folder, "bert-48-pbs-2.txt")):
        raise ValueError(f"no published profiles at {os.path.abspath(folder)} (bert-48-pbs-2.txt, gnmt-16-pbs-64.txt): "
                         "pass --profiles=FOLDER")
    return os.path.abspath(folder)

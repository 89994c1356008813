"""Shared plumbing for the absl command-line programs.

Bad input (ValueError, OSError) prints one `error: ...` line and exits 1; `--help` exits 0
(absl itself exits 1 after printing help).
"""

import sys

from absl import app

HELP_FLAGS = ("-h", "-?", "--help", "--helpshort", "--helpfull")


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

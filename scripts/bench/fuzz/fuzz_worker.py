"""The random equivalence harness's worker process: reads cases (one JSON object per line) from stdin, runs each
(fuzz_case.run) and writes one JSON line per result to stdout, until stdin closes.

    python -m scripts.bench.fuzz.fuzz_worker < cases.jsonl      # started by scripts.bench.fuzz.fuzz
"""

import json
import os
import sys
import traceback


def error_line(error: Exception) -> str:
    """The line of `error`'s message that says what went wrong: a TensorFlow error opens with "Graph execution
    error:" and the stack of the op's definition, then gives its message."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    said = [line for line in lines if not line[0].isspace() and line.strip() != "Graph execution error:"
            and not line.startswith("Detected at node")]
    return (said or lines or [""])[0]


def main() -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")  # results only: TF and Python warnings go to stderr
    sys.stdout = sys.stderr
    from scripts.bench.fuzz import fuzz_case, fuzz_grammar  # pylint: disable=import-outside-toplevel

    fuzz_case.prepare()
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            result = fuzz_case.run(fuzz_grammar.Case.from_json(line))
        except fuzz_case.HarnessError as e:  # the harness's own fault: the run stops (fuzz.py)
            result = {"error": f"the harness itself failed: {error_line(e)}"[:500], "harness": True,
                      "traceback": traceback.format_exc()[-3000:]}
        except Exception as e:  # pylint: disable=broad-except  # the harness reports it as the case's failure
            result = {"error": f"{type(e).__name__}: {error_line(e)}"[:500],
                      "traceback": traceback.format_exc()[-3000:]}
        out.write(json.dumps(result) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

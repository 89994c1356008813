"""Several runs of the speed benchmark side by side: how far its figures move from run to run.

    python -m scripts.bench.speed.speedup --rounds=10 --steps=3 --json=run1.json     # (three times)
    python -m scripts.bench.speed.speedup_runs run1.json run2.json run3.json

Prints, per plan, the bound after compute (ideal / slices / sharing: what profiles and the sharing probe give)
and measured / simulated in each run, the bound's range over the runs ((largest - smallest) / smallest) and the
measured speedup over the bound; then how many plans have measured / simulated within 10% and within 15% in every
run, and the plans whose bound moved by more than 5%. Reads only the --json rows (no TensorFlow).
"""

import json
from typing import Dict, List

from absl import flags

from scripts.cli import run_main

FLAGS = flags.FLAGS


def load(paths: List[str]) -> List[Dict[str, dict]]:
    runs = []
    for path in paths:
        with open(path) as f:
            rows = json.load(f)
        runs.append({row["plan"]: row for row in rows if "speedup_after_compute" in row})
    return runs


def report(runs: List[Dict[str, dict]]) -> str:
    plans = [p for p in runs[0] if all(p in run for run in runs)]
    n = len(runs)
    lines = [f"{'plan':<24} {'bound after compute':>{8 * n}} {'range':>6}  {'measured / simulated':>{7 * n}}  "
             f"{'measured / bound':>{7 * n}}"]
    within10 = within15 = 0
    moved = []
    for plan in plans:
        bounds = [run[plan]["speedup_after_compute"] for run in runs]
        ratios = [run[plan]["measured_over_simulated"] for run in runs]
        of_bound = [run[plan]["speedup"] / run[plan]["speedup_after_compute"] for run in runs]
        spread = max(bounds) / min(bounds) - 1
        within10 += all(abs(r - 1) <= 0.10 for r in ratios)
        within15 += all(abs(r - 1) <= 0.15 for r in ratios)
        if spread > 0.05:
            moved.append(f"{plan} ({spread:.1%})")
        lines.append(f"{plan:<24} {''.join(f'{b:8.2f}' for b in bounds)} {spread:6.1%}  "
                     f"{''.join(f'{r:7.2f}' for r in ratios)}  {''.join(f'{r:7.2f}' for r in of_bound)}")
    lines.append(f"measured / simulated within 10% in every run: {within10} of {len(plans)} plans "
                 f"({within10 / len(plans):.0%}); within 15%: {within15} ({within15 / len(plans):.0%})")
    lines.append(f"bound after compute moved by more than 5% between runs: {', '.join(moved) or 'none'}")
    return "\n".join(lines)


def main(argv):
    paths = argv[1:]
    if not paths:
        raise ValueError("give the --json files of one or more runs of scripts.bench.speed.speedup")
    print(report(load(paths)))
    return 0


if __name__ == "__main__":
    run_main(main)

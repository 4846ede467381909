"""A/B activation: an older checkout (BEFORE_SRC: its src/ directory, e.g. from ``git archive 4be5fe3 src``) vs this
one, interleaved fresh processes on the same machine and load. Usage: python bench/ab_activation.py REPEATS."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import ACTIVATION  # noqa: E402

BASE_ENV = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_DP_MTP_FIX")}
ARMS = {
    "before": {**BASE_ENV, "PYTHONPATH": os.environ.get("BEFORE_SRC", "/tmp/dsa-old/src")},
    "after": BASE_ENV,
}


def main() -> None:
    out: dict = {}
    for mode in ("warm", "dsa-warm"):
        for i in range(int(sys.argv[1])):
            order = list(ARMS.items()) if i % 2 == 0 else list(reversed(ARMS.items()))
            for arm, env in order:
                proc = subprocess.run([sys.executable, "-c", textwrap.dedent(ACTIVATION), mode], env=env,
                                      capture_output=True, text=True, timeout=300, cwd="/tmp")  # fmt: skip
                run = json.loads(proc.stdout.strip().splitlines()[-1])
                entry = out.setdefault(mode, {}).setdefault(arm, {"runs_ms": [], "statuses": run["statuses"]})
                entry["runs_ms"].append(round(run["ms"], 1))
    for arms in out.values():
        for entry in arms.values():
            entry["median_ms"] = statistics.median(entry["runs_ms"])
        arms["ratio_after_over_before"] = round(arms["after"]["median_ms"] / arms["before"]["median_ms"], 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

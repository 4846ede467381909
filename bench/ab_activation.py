"""A/B activation: an older checkout (BEFORE_SRC: its src/ directory, e.g. from ``git archive 4be5fe3 src``) vs this
one, interleaved fresh processes on the same machine and load.

Usage: BEFORE_SRC=DIR python bench/ab_activation.py REPEATS (REPEATS 0: only check the two arms). Exits with an error,
before measuring, when the "before" arm would import the same package as the "after" arm (BEFORE_SRC missing, or
without the package): that run would be an A/A reported as an A/B."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import ACTIVATION, compile_as_installed  # noqa: E402

DEFAULT_BEFORE_SRC = "/tmp/dsa-old/src"
BASE_ENV = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_DP_MTP_FIX")}
# Where a fresh process of an arm imports the plugin from (cwd /tmp, as the measured processes run).
WHERE = "import os, sglang_dp_mtp_fix; print(os.path.realpath(sglang_dp_mtp_fix.__file__))"


def arms(before_src: str) -> dict[str, dict[str, str]]:
    return {"before": {**BASE_ENV, "PYTHONPATH": before_src}, "after": BASE_ENV}


def imported_from(env: dict[str, str]) -> str:
    proc = subprocess.run([sys.executable, "-c", WHERE], env=env, capture_output=True, text=True, timeout=120,
                          cwd="/tmp")  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"ab_activation: the plugin cannot be imported in an arm:\n{proc.stderr}")
    return proc.stdout.strip().splitlines()[-1]


def check_arms(before_src: str, env: dict[str, dict[str, str]]) -> tuple[str, str]:
    """Exits unless the before arm imports the plugin from ``before_src`` and the after arm from elsewhere; returns
    the two ``__init__.py`` paths."""
    if not os.path.isdir(before_src):
        raise SystemExit(f"ab_activation: BEFORE_SRC={before_src} does not exist (the older checkout's src/ directory)")
    before, after = imported_from(env["before"]), imported_from(env["after"])
    inside = before.startswith(os.path.realpath(before_src) + os.sep)
    if before == after or not inside:
        raise SystemExit(
            f"ab_activation: the before arm imports {before}, not a package under BEFORE_SRC={before_src} (the after "
            f"arm imports {after}): that would measure A/A"
        )
    return before, after


def main() -> None:
    before_src = os.environ.get("BEFORE_SRC", DEFAULT_BEFORE_SRC)
    env = arms(before_src)
    for init in check_arms(before_src, env):
        compile_as_installed(os.path.dirname(init))
    out: dict = {}
    for mode in ("warm", "dsa-warm"):
        for i in range(int(sys.argv[1])):
            order = list(env.items()) if i % 2 == 0 else list(reversed(env.items()))
            for arm, arm_env in order:
                proc = subprocess.run([sys.executable, "-c", textwrap.dedent(ACTIVATION), mode], env=arm_env,
                                      capture_output=True, text=True, timeout=300, cwd="/tmp")  # fmt: skip
                run = json.loads(proc.stdout.strip().splitlines()[-1])
                entry = out.setdefault(mode, {}).setdefault(arm, {"runs_ms": [], "statuses": run["statuses"]})
                entry["runs_ms"].append(round(run["ms"], 1))
    for arm_results in out.values():
        for entry in arm_results.values():
            entry["median_ms"] = statistics.median(entry["runs_ms"])
        arm_results["ratio_after_over_before"] = round(
            arm_results["after"]["median_ms"] / arm_results["before"]["median_ms"], 3
        )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

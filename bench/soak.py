"""Soak: a real CPU server under sustained PD-decode traffic with forced eager rounds, >= 2,019 decode batches per rank.

The launch tier's server (``tests/launch``: tp 2 / dp 2 with DP attention, PD decode with the fake transfer backend,
NEXTN MTP, dummy weights, its named stand-ins, SGLang's ``--enable-metrics``) with the test-only vote probe
(``tests/launch/probes/launch_vote_probe``) forcing, in ``--rate`` of the MLP-sync rounds, one rank drawn at random
to need a rank-consistent eager draft (what a seedless PD arrival of a DSA model needs; point 4 of the probe's
header). Traffic and checks: ``tools/soaklib.py`` (1-16 in flight on both DP ranks, varied ``max_new_tokens``,
arrivals while others decode, a malformed request every ~100). Checked: every request returned exactly its asked
tokens (none errored or timed out); both ranks took the same draft path every round (from the probe's per-round
records); the plugin's counters on ``/metrics`` equal the probe's counts; scheduler RSS at start vs end.

Arms: ``on`` (the plugin applied) and ``off`` (``SGLANG_DP_MTP_FIX=off``, the same trigger: the control; on CPU no
graph exists, so the would-be split of stock costs nothing here: it is the cost baseline), one after the other.

    nice -n 10 <venv>/bin/python bench/soak.py [--batches 2019] [--plugin both|on|off]   -> results/soak-<release>.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))  # the launch helpers, shared with the launch tier

import soaklib  # noqa: E402
from launchlib import METRICS, SGLANG_VERSION, base_env, gaps_pythonpath, start_server  # noqa: E402

PLUGINS = "dp_mtp_fix,launch_cpu_gaps,launch_vote_probe"


def run_arm(arm: str, tmp: Path, path: str, args: argparse.Namespace) -> dict:
    records = tmp / f"{arm}-records"
    records.mkdir()
    extra = {"SGLANG_DP_MTP_FIX": "off"} if arm == "off" else {}
    env = base_env(path, SGLANG_PLUGINS=PLUGINS, LAUNCH_VOTE_PROBE_DIR=str(records),
                   **soaklib.force_env(args.rate, args.seed), **extra)  # fmt: skip
    t0 = time.monotonic()
    server = start_server(f"soak-{arm}", tmp, env, METRICS)
    try:
        if not server.wait_ready():
            raise SystemExit(f"{arm}: server never became ready; log tail:\n{server.log[-3000:]}")
        ready_s = round(time.monotonic() - t0, 1)
        pids = {r["rank"]: r["pid"] for r in soaklib.read_records(records) if r["kind"] == "meta"}
        load_start = os.getloadavg()
        traffic = soaklib.drive(server.port, records, pids, args.batches, seed=args.seed,
                                malformed_every=args.malformed_every, max_wall=args.max_wall,
                                progress=lambda line: print(f"[{arm}] {line}", flush=True))  # fmt: skip
        time.sleep(1.0)  # the last records flush
        metrics_end = server.scrape_metrics()
        load_end = os.getloadavg()
        alive = server.alive()
        log = server.log
    finally:
        server.stop()
    arm_s = round(time.monotonic() - t0, 1)
    figures, failures = soaklib.analyse(soaklib.read_records(records), traffic, arm == "on", metrics_end)
    if not alive:
        failures.append("the server was not alive at the end")
    if "Traceback" in log:
        failures.append("a Traceback in the server log")
    report = [
        line.split("] ", 1)[-1] for line in log.splitlines() if "sglang-dp-mtp-fix 0" in line and " DP0 TP0]" in line
    ]
    return {
        "ready_s": ready_s,
        "arm_wall_s": arm_s,  # launch to stop (the traffic alone: wall_s)
        "load_avg_at_start": load_start,
        "load_avg_at_end": load_end,
        "report_line_rank0": report[:1],
        **figures,
        "failures": failures,
    }


def machine() -> dict:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        info = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in lscpu.splitlines() if ":" in line)}
    except (OSError, subprocess.SubprocessError):
        info = {}
    return {
        "cpu_model": info.get("Model name", platform.processor()),
        "cpus": os.cpu_count(),
        "cores_per_socket": info.get("Core(s) per socket"),
        "threads_per_core": info.get("Thread(s) per core"),
        "hypervisor": info.get("Hypervisor vendor"),
        "python": platform.python_version(),
        "nice": os.nice(0),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=2019, help="decode batches per DP rank, at least")
    ap.add_argument("--plugin", choices=("both", "on", "off"), default="both")
    ap.add_argument("--rate", type=float, default=0.1, help="share of MLP-sync rounds forced eager on a random rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--malformed-every", type=int, default=100)
    ap.add_argument(
        "--max-wall",
        type=float,
        default=3 * 3600,
        help="seconds of traffic per arm at most (a stop before --batches is reported as a failed check)",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    path = soaklib.probe_pythonpath(gaps_pythonpath(tmp / "entry-points"), tmp / "probe-entry-point")
    out = args.out or HERE / "results" / f"soak-{SGLANG_VERSION}.json"
    arms = ("on", "off") if args.plugin == "both" else (args.plugin,)
    result: dict = {
        "sglang_version": SGLANG_VERSION,
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "what": "real CPU launch (tp 2, dp 2, DP attention, PD decode with the fake transfer, NEXTN MTP, dummy "
        "weights), the vote probe forcing an eager draft on a random rank in a share of the rounds; mixed traffic "
        "until every DP rank ran the asked decode batches",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "arms": {},
    }
    if len(arms) == 1 and out.exists():  # one arm at a time (a long soak each): keep the other arm's result
        before = json.loads(out.read_text())
        if before.get("sglang_version") == SGLANG_VERSION:
            result["arms"] = {k: v for k, v in before["arms"].items() if k not in arms}
    t0 = time.monotonic()
    for arm in arms:
        result["arms"][arm] = run_arm(arm, tmp, path, args)
        result["wall_s"] = round(time.monotonic() - t0, 1)
        out.write_text(json.dumps(result, indent=1) + "\n")  # written after each arm: a long run keeps what it has
        a = result["arms"][arm]
        print(json.dumps({arm: {k: a[k] for k in ("decode_batches_per_rank", "forced_eager_share", "rounds",
                                                   "rounds_ranks_disagree", "requests_ok", "requests", "scheduler_rss",
                                                   "wall_s", "failures")}}), flush=True)  # fmt: skip
    print(f"wrote {out}")
    if any(a["failures"] for a in result["arms"].values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()

"""Real-launch decode cost: the plugin on vs off in real SGLang servers on CPU, side by side in one run, as a ratio.

The launch tier's server (``tests/launch``: DP attention tp 2 / dp 2, PD decode with the fake transfer backend, NEXTN
MTP, dummy weights, its named stand-ins) is started twice: the plugin applied (``auto``) and ``SGLANG_DP_MTP_FIX=off``.
Requests then alternate between the two, one at a time, in interleaved blocks (arm order flipped every block), so both
arms see the same machine. Only the arm being measured runs: the other server's whole process group is paused
(SIGSTOP) and resumed (SIGCONT) for its own block. An idle SGLang scheduler does not sleep (``--sleep-on-idle`` is off
by default) and with DP attention its loop runs the MLP-sync all-gather even with no batch, so a running idle server
would take a share of a 2-core machine from the measured one (the first run of this bench, both servers running under
load, read 1.77x with block ratios 1.25-3.07). Per request: wall time over its generated tokens (greedy, ``ignore_eos``,
``--max-new-tokens`` each): the decode iterations dominate it. The plugin changes no token (launch tier b), so both
arms run the same iterations. Output: medians per arm, their ratio, per-block ratios.

    python bench/launch_ratio.py [--blocks 8] [--per-block 6] [--new-tokens 48]   (in a venv of one release)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))  # the launch helpers, shared with the launch tier

from launchlib import SGLANG_VERSION, Server, base_env, gaps_pythonpath, start_server  # noqa: E402


def per_token_ms(server: Server, room: int, new_tokens: int) -> float:
    t0 = time.perf_counter()
    out = server.generate([1, 5, 6, 7, 8], room, max_new_tokens=new_tokens)
    assert out["meta_info"]["completion_tokens"] == new_tokens, out
    return (time.perf_counter() - t0) * 1e3 / new_tokens


def pause(server: Server) -> None:
    os.killpg(server.proc.pid, signal.SIGSTOP)


def resume(server: Server) -> None:
    os.killpg(server.proc.pid, signal.SIGCONT)
    time.sleep(0.5)  # let its loop come back before the clock starts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--per-block", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=48)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="launch-ratio-"))
    gaps = gaps_pythonpath(tmp / "entry-points")
    envs = {"plugin": base_env(gaps), "off": base_env(gaps, SGLANG_DP_MTP_FIX="off")}
    servers: dict[str, Server] = {}
    t_start = time.time()
    load_at_start = os.getloadavg()
    try:
        room = 5000
        for arm, env in envs.items():  # one after the other, the first paused: only one server ever runs
            servers[arm] = start_server(arm, tmp, env)
            if not servers[arm].wait_ready():
                raise SystemExit(f"{arm}: server never became ready; log tail:\n{servers[arm].log[-3000:]}")
            for _ in range(2):  # warm-up: first requests pay one-off costs
                per_token_ms(servers[arm], room := room + 1, args.new_tokens)
            pause(servers[arm])
        samples: dict[str, list[float]] = {arm: [] for arm in servers}
        block_ratios = []
        for block in range(args.blocks):
            order = ("plugin", "off") if block % 2 == 0 else ("off", "plugin")
            got = {}
            for arm in order:
                resume(servers[arm])
                got[arm] = [
                    per_token_ms(servers[arm], room := room + 1, args.new_tokens) for _ in range(args.per_block)
                ]
                pause(servers[arm])
                samples[arm].extend(got[arm])
            block_ratios.append(round(statistics.median(got["plugin"]) / statistics.median(got["off"]), 4))
        statuses = {
            arm: [line for line in s.log.splitlines() if "sglang-dp-mtp-fix 0" in line and " DP0 TP0]" in line][:1]
            for arm, s in servers.items()
        }
    finally:
        for s in servers.values():
            try:
                os.killpg(s.proc.pid, signal.SIGCONT)  # a stopped group acts on SIGTERM only once continued
            except ProcessLookupError:
                pass
            s.stop()
    med = {arm: statistics.median(v) for arm, v in samples.items()}
    result = {
        "sglang_version": SGLANG_VERSION,
        "date": time.strftime("%Y-%m-%d"),
        "machine": {
            "cpu": _cpu(),
            "cores": os.cpu_count(),
            "load_avg_at_start": load_at_start,
            "load_avg_at_end": os.getloadavg(),
        },
        "design": "one server running at a time, the other's process group paused (SIGSTOP) during the block",
        "what": "ms per generated token of a greedy request, one at a time, plugin applied vs SGLANG_DP_MTP_FIX=off",
        "new_tokens": args.new_tokens,
        "median_ms_per_token": med,
        "ratio": round(med["plugin"] / med["off"], 4),
        "block_ratios": block_ratios,
        "block_ratio_median": round(statistics.median(block_ratios), 4),
        # How well this run resolves the ratio: 90 % bootstrap interval of the median ratio (requests resampled
        # within each arm), so a figure near the goal is read against the machine's noise, not as exact.
        "ratio_ci90": bootstrap_ratio_ci(samples["plugin"], samples["off"]),
        "samples_ms_per_token": {arm: [round(v, 2) for v in vals] for arm, vals in samples.items()},
        "samples_per_arm": len(samples["plugin"]),
        "report_lines": statuses,
        "wall_s": round(time.time() - t_start, 1),
    }
    out = HERE / "results" / f"launch-ratio-{SGLANG_VERSION}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("median_ms_per_token", "ratio", "ratio_ci90", "block_ratios", "wall_s")}))
    print(f"wrote {out}")


def bootstrap_ratio_ci(plugin: list[float], off: list[float], rounds: int = 2000) -> list[float]:
    rng = random.Random(0)
    ratios = sorted(
        statistics.median(rng.choices(plugin, k=len(plugin))) / statistics.median(rng.choices(off, k=len(off)))
        for _ in range(rounds)
    )
    return [round(ratios[int(rounds * 0.05)], 4), round(ratios[int(rounds * 0.95)], 4)]


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()

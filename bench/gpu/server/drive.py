#!/usr/bin/env python3
"""GPU server tier driver (on demand; never CI): real ``python -m sglang.launch_server`` servers on ONE GPU.

Called by run.sh on the device machine: ``python3 drive.py STAGE [STAGE ...]``, stages in order, within
``DRIVE_BUDGET_S``. Results: ``$OUT/summary-<release>.json`` (every figure; the soak also one file per arm), node
logs under ``DRIVE_LOGS``. NODES (2, 4, 8) DP ranks, one "node" each on the one GPU (tier/servers.py).

Stages (one module each under tier/):
  hang  the seed's hang, stock vs patched, same flags and trigger on both arms (tier/hang.py)
  soak  sustained open-loop PD-decode traffic past SOAK_BATCHES decode batches per rank, stock beside patched
        (tier/soak.py)
  trim  DSA tier: the plugin's DSA patches at work in a real server, both DSA decode backends (tier/trim.py)
  ab    decode cost, plugin on vs off (and the recorder, and --tp 1) in interleaved rounds (tier/ab.py)
  pd    a real prefill and KV transfer (mooncake over TCP) in front of the DP decode, prefill with and without
        MTP, stock and patched decodes, every served token judged (tier/pd.py)
DRIVE_CPU=1 runs the driver against CPU launches (the launch tier's stand-ins) to check it here before device time.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tier import conf  # noqa: E402 - the tier package sits beside this script
from tier.ab import stage_ab  # noqa: E402
from tier.hang import stage_hang  # noqa: E402
from tier.pd import stage_pd  # noqa: E402
from tier.soak import stage_soak  # noqa: E402
from tier.trim import stage_trim  # noqa: E402

STAGES = {"hang": stage_hang, "soak": stage_soak, "trim": stage_trim, "ab": stage_ab, "pd": stage_pd}


def main() -> None:
    conf.refuse_without_multicast_off()
    os.makedirs(conf.LOGS, exist_ok=True)
    conf.SUMMARY.update(nodes=conf.NODES, per_rank=conf.PER_RANK, tier=conf.TIER, backend=conf.DSA_KV)
    for stage in sys.argv[1:] or ["hang"]:
        if stage not in STAGES:
            sys.exit(f"unknown stage {stage!r}; stages: {' '.join(STAGES)}")
        if conf.left() < 90:
            conf.say(f"budget: {conf.left():.0f}s left, not running {stage}")
            conf.SUMMARY.setdefault("not_run", []).append(stage)
            continue
        try:
            STAGES[stage]()
        except Exception:  # noqa: BLE001 - keep what the other stages and arms found
            conf.SUMMARY.setdefault("driver_errors", []).append(traceback.format_exc())
            conf.say(f"{stage}: driver error\n{traceback.format_exc()}")
        conf.write_summary()
    conf.SUMMARY["elapsed_s"] = round(time.monotonic() - conf.T0, 1)
    conf.write_summary()
    conf.say("done")


if __name__ == "__main__":
    main()

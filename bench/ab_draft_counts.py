"""A/B of draft_token_counts' per-round wrapper: an older patch module (BEFORE: a file, e.g. from
``git show ad537b0:src/sglang_dp_mtp_fix/patches/draft_token_counts.py``) vs this checkout's, each wrapped around
SGLang's raw ``_update_gather_batch`` in one process, with an A/A pair (this checkout's twice) and the raw function.

Usage: BEFORE=FILE python bench/ab_draft_counts.py [--out PATH]. Interleaved blocks (order rotated), thread CPU of one
call, GC off inside a block; headline: the fastest block median per arm. Two deployments: equal backends (none/none,
the common one) and deepep/none (the draft's answer read each round). REAL: ``_update_gather_batch``, ServerArgs
published, SGLang's ``require_mlp_tp_gather``. STAND-IN: the gathered sync info (``GatheredSyncInfoStandIn``)."""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import time
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).resolve().parent
BLOCKS, ROUNDS, WARM = 60, 300, 50


def _wrappers(before_file: str) -> dict[str, Any]:
    from sglang.srt.managers.scheduler_components import dp_attn
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from sglang_dp_mtp_fix.patches import draft_token_counts as after
    from sglang_dp_mtp_fix.patches.draft_graph_vote import FORWARD_INIT, UPDATE_BATCH

    spec = importlib.util.spec_from_file_location("draft_token_counts_before", before_file)
    if spec is None or spec.loader is None:
        raise SystemExit(f"BEFORE={before_file}: not a Python file")
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)
    raw = dp_attn._update_gather_batch
    resolved = {
        UPDATE_BATCH: SimpleNamespace(raw=raw),
        FORWARD_INIT: SimpleNamespace(raw=ForwardBatch.__dict__["init_new"]),
    }
    return {
        "raw": raw,
        "before": before.DraftTokenCounts().replacements(resolved, None)[UPDATE_BATCH],
        "after": after.DraftTokenCounts().replacements(resolved, None)[UPDATE_BATCH],
        "after_again": after.DraftTokenCounts().replacements(resolved, None)[UPDATE_BATCH],
    }


def measure(target: str, draft: str, before_file: str) -> dict[str, Any]:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_dp_mtp_fix.harness.draft_counts import GatheredSyncInfoStandIn, gather_answers, server_args

    target_gathers, _ = gather_answers(server_args(target, draft))
    arms = _wrappers(before_file)
    for attr in ("draft_global_num_tokens", "draft_global_num_tokens_for_logprob"):
        setattr(ScheduleBatch, attr, None)  # the class defaults the patch adds when applied
    batch = ScheduleBatch(reqs=[], forward_mode=ForwardMode.DECODE)
    info = GatheredSyncInfoStandIn(2, [2, 12])
    names = list(arms)
    medians: dict[str, list[float]] = {name: [] for name in names}
    for block in range(BLOCKS):
        for name in names[block % len(names) :] + names[: block % len(names)]:
            fn = arms[name]
            for _ in range(WARM):
                fn(batch, info, target_gathers)
            samples = []
            gc.disable()
            for _ in range(ROUNDS):
                t0 = time.thread_time_ns()
                fn(batch, info, target_gathers)
                samples.append(time.thread_time_ns() - t0)
            gc.enable()
            medians[name].append(statistics.median(samples) / 1e3)
    fastest = {name: round(min(v), 3) for name, v in medians.items()}
    return {
        "backends": [target, draft],
        "fastest_block_median_us": fastest,
        "after_minus_before_us": round(fastest["after"] - fastest["before"], 3),
        "aa_us": round(fastest["after_again"] - fastest["after"], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    before_file = os.environ.get("BEFORE")
    if not before_file or not os.path.isfile(before_file):
        raise SystemExit("BEFORE=FILE (the older draft_token_counts.py) is required")
    release = version("sglang")
    result = {
        "sglang_version": release,
        "date": time.strftime("%Y-%m-%d"),
        "load_avg_before": list(os.getloadavg()),
        "blocks": BLOCKS,
        "rounds": ROUNDS,
        "deployments": [measure(t, d, before_file) for t, d in (("none", "none"), ("deepep", "none"))],
        "load_avg_after": list(os.getloadavg()),
    }
    out = args.out or HERE / "results" / f"draft-counts-ab-{release}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

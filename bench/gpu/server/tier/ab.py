"""Stage ``ab``: decode cost, plugin applied (A) vs SGLANG_DP_MTP_FIX=off (B), no trigger, plus T: the same flags
with ``--tp 1`` (no DP, no NCCL): the share of the socket transport. Up side by side, measured one at a time in
rounds A B T B A T A B T ... (AB_ROUNDS rounds of A and of B). AB_RECORDER=1 adds R: A with the flight recorder on."""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

from tier.conf import LOGS, MODEL, MTP, PD, SUMMARY, TIER, left, say
from tier.evidence import log_evidence
from tier.servers import Server, start_all
from tier.traffic import workload


def ab_model_flags() -> list[str]:
    """DSA tier: the A/B model has MTP IndexShare off (``AB_INDEX_SHARE=1`` keeps it). With it on, stock hangs at the
    first seedless PD arrival beside a replaying peer (stage hang; seen in the A/B warm-up of 2026-12-03), so the B arm
    could not be timed; with it off SGLang never seeds, stock has no seedless eager fallback to take, and the plugin's
    vote and wrappers still run every round. A later --model-path wins over BASE's."""
    if TIER != "dsa" or os.environ.get("AB_INDEX_SHARE", "0") == "1":
        return []
    path = os.path.join(LOGS, "model-ab")
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(MODEL):
        with open(os.path.join(MODEL, name)) as src, open(os.path.join(path, name), "w") as dst:
            dst.write(src.read())
    with open(os.path.join(MODEL, "config.json")) as f:
        config = json.load(f)
    config["index_share_for_mtp_iteration"] = False
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    SUMMARY["ab_model"] = {"path": path, "index_share_for_mtp_iteration": False}
    return ["--model-path", path]


def stage_ab() -> None:
    tokens, per_rank = int(os.environ.get("AB_TOKENS", "32")), int(os.environ.get("AB_PER_RANK", "4"))
    waves, solo = int(os.environ.get("AB_WAVES", "3")), int(os.environ.get("AB_SOLO", "4"))
    rounds = int(os.environ.get("AB_ROUNDS", "6"))
    flags = MTP + PD + ab_model_flags()
    servers = {"A": Server("ab-A", flags, {}), "B": Server("ab-B", flags, {"SGLANG_DP_MTP_FIX": "off"})}
    if os.environ.get("AB_RECORDER") == "1":  # R: A with the flight recorder on (its cost in a real round)
        recorder = os.path.join(LOGS, "ab-R-recorder")
        os.makedirs(recorder, exist_ok=True)
        servers["R"] = Server("ab-R", flags, {"SGLANG_DP_MTP_FIX_RECORDER_DIR": recorder})
    if os.environ.get("AB_TP1", "1") == "1":
        servers["T"] = Server("ab-T", flags, {}, dp=False)
    say("ab servers: " + " ".join(s.name for s in servers.values()))
    start_all(list(servers.values()))
    up = [k for k, s in servers.items() if s.ready_s is not None]
    res: dict[str, Any] = {"ready_s": {k: s.ready_s for k, s in servers.items()}, "workload": {
        "tokens": tokens, "per_rank": per_rank, "waves": waves, "solo": solo}, "rounds": []}  # fmt: skip
    if {"A", "B"} <= set(up):
        for k in up:  # warm-up: every server answers once (first requests pay one-time costs)
            workload(servers[k], 8, 1, 1, 1)
        order = [k for k in ("A", "B", "R", "T") if k in up]
        pattern = order + order[::-1]  # each arm as often first as last within a pair of passes
        per = 0.0
        for arm in pattern * rounds:  # each arm `rounds` times, interleaved
            if sum(1 for r in res["rounds"] if r["arm"] == arm) >= rounds:
                continue
            if left() < per + 40:
                say(f"ab: {left():.0f}s left, stop after {len(res['rounds'])} rounds")
                break
            t = time.monotonic()
            r = workload(servers[arm], tokens, per_rank, waves, solo)
            per = max(per, time.monotonic() - t)
            res["rounds"].append({"arm": arm, **r})
            say(f"ab round {len(res['rounds'])} {arm}: conc {r['conc_ms_tok']:.3f} solo {r['solo_ms_tok']:.3f} "
                f"ms/token, wave {r['wave_s']:.3f}s {r['bad'] or ''}")  # fmt: skip
        agg: dict[str, Any] = {}
        for arm in up:
            rs = [r for r in res["rounds"] if r["arm"] == arm]
            if not rs:
                continue
            agg[arm] = {"rounds": len(rs), "bad": sum(len(r["bad"]) for r in rs)}
            for kind in ("conc", "solo"):
                per_round = [r[f"{kind}_ms_tok"] for r in rs]
                pooled = 1000 * statistics.median([x for r in rs for x in r[kind]]) / tokens
                agg[arm][kind] = {"pooled_ms_tok": round(pooled, 3), "round_medians": [round(x, 3) for x in per_round],
                                  "spread_pct": round(100 * (max(per_round) - min(per_round)) / pooled, 3)}  # fmt: skip
        if "A" in agg and "B" in agg:
            agg["A_over_B"] = {k: round(agg["A"][k]["pooled_ms_tok"] / agg["B"][k]["pooled_ms_tok"], 4)
                               for k in ("conc", "solo")}  # fmt: skip
            a_rounds = [r["conc_ms_tok"] for r in res["rounds"] if r["arm"] == "A"]
            b_rounds = [r["conc_ms_tok"] for r in res["rounds"] if r["arm"] == "B"]
            agg["A_over_B_per_round_conc"] = [round(a / b, 4) for a, b in zip(a_rounds, b_rounds, strict=False)]
        if "R" in agg and "A" in agg:
            agg["R_over_A"] = {k: round(agg["R"][k]["pooled_ms_tok"] / agg["A"][k]["pooled_ms_tok"], 4)
                               for k in ("conc", "solo")}  # fmt: skip
        if "T" in agg and "B" in agg:
            agg["B_over_T"] = {k: round(agg["B"][k]["pooled_ms_tok"] / agg["T"][k]["pooled_ms_tok"], 3)
                               for k in ("conc", "solo")}  # fmt: skip
        res["summary"] = agg
        say("ab summary: " + json.dumps(agg))
    res["logs"] = {k: log_evidence(s) for k, s in servers.items()}
    for s in servers.values():
        s.kill()
    SUMMARY["ab"] = res

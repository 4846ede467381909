"""Stage ``trim`` (DSA tier): the plugin's DSA patches doing their work in a real server, bf16 KV (flashmla_sparse)
and FP8 KV (flashmla_kv), patched arm only (stock would hang at the first split, stage ``hang``)."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tier.conf import HANG_FLAGS, MTP, PD, RANKS, SUMMARY, TIER, attention_flags, left, say, write_summary
from tier.evidence import analyze, log_evidence, read_records, stuck_evidence
from tier.hang import trigger_env
from tier.servers import Server, start_all
from tier.traffic import generate, served

TRIM_PROMPT = [1, 9, 17, 33, 41, 57, 6, 7]


def dsa_evidence(records: str, since: float) -> dict[str, Any]:
    """The observer's DSA records after ``since``: padded eager decode calls (dsa_decode_trim's case) and eager
    indexer calls on idle ranks (dsa_idle_index's case), per rank."""
    recs = [r for r in read_records(records) if r.get("t", 0) >= since]
    padded = [r for r in recs if r["kind"] == "dsa-decode-padded"]
    idle = [r for r in recs if r["kind"] == "dsa-idle-index"]
    return {
        "padded_decode_calls": {rk: sum(1 for r in padded if r["rank"] == rk) for rk in RANKS},
        "padded_rows_zero": all(r["pad_zero"] and r["out_rows"] == r["physical"] for r in padded),
        "padded_shapes": sorted({f"{r['planned']}->{r['physical']}" for r in padded}),
        "padded_impl": sorted({r["impl"] for r in padded}),
        "forward_decode": sorted({r["forward_decode"] for r in padded}),
        "idle_index_calls": {rk: sum(1 for r in idle if r["rank"] == rk) for rk in RANKS},
        "idle_all_invalid": all(r["all_invalid"] is not False for r in idle),
        "idle_rows": sorted({r["rows"] for r in idle}), "idle_steps": sorted({r["step"] for r in idle})[:12],
        "observer_errors": [r for r in recs if r["kind"] == "observer-error"][:3],
    }  # fmt: skip


def trim_case(s: Server, records: str, n: int) -> dict[str, Any]:
    """One request S (TRIM_PROMPT, greedy, DP rank 1) served alone, then beside three arrivals on rank 0 and two more
    while S decodes, then alone again. Every PD arrival is seedless for its first draft step, so each arrival makes
    the group run an eager draft round; beside rank 0's rows, S's rank is DP-padded (MAX_LEN) in those rounds and its
    DSA decode is trimmed. Greedy tokens and their logprobs must not depend on it."""
    res: dict[str, Any] = {}

    def greedy(out: dict[str, Any]) -> list[Any]:
        """The tokens with their logprobs: a degenerate greedy cycle of a dummy-weight model still shows a change in
        the numbers."""
        logprobs = out.get("meta_info", {}).get("output_token_logprobs") or []
        return [list(out.get("output_ids") or []), [lp[0] for lp in logprobs]]

    def solo(tag: str) -> list[Any]:
        t = time.time()
        out = generate(s, f"trim-{tag}", 1, n, 120, TRIM_PROMPT, logprobs=True)
        res[f"{tag}_dsa"] = dsa_evidence(records, t)
        res[f"{tag}_problem"] = served(out, n, 1)
        return greedy(out)

    alone = solo("alone")
    t = time.time()
    with ThreadPoolExecutor(6) as pool:
        mine = pool.submit(generate, s, "trim-beside", 1, n, 120, TRIM_PROMPT, True)
        peers = [pool.submit(generate, s, f"trim-peer-{k}", 0, n) for k in range(3)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not mine.done():  # S decoding with a seed: then two late arrivals
            steps = [r for r in read_records(records) if r["kind"] == "draft" and "trim-beside" in r.get("rids", [])]
            if sum(1 for r in steps if r["seed"] is not None) >= 3:
                break
            time.sleep(0.05)
        peers += [pool.submit(generate, s, f"trim-late-{k}", 0, 8) for k in range(2)]
        beside = greedy(mine.result())
        peer_problems = [served(f.result(), w, 0) for f, w in zip(peers, [n, n, n, 8, 8], strict=True)]
    res["beside_dsa"] = dsa_evidence(records, t)
    res["peer_problems"] = [p for p in peer_problems if p]
    again = solo("again")
    res.update(tokens=n, alone=alone, beside=beside, again=again, identical=alone == beside == again)
    return res


def stage_trim() -> None:
    """DSA tier: the plugin's DSA patches doing their work in a real server, bf16 KV (flashmla_sparse) and FP8 KV
    (flashmla_kv), patched arm only (stock would hang at the first split, stage hang)."""
    kvs = os.environ.get("TRIM_KV", "bf16 fp8").split()
    n = int(os.environ.get("TRIM_TOKENS", "24"))
    arms = {kv: trigger_env(f"trim-{kv}", stock=False, init_comms=False) for kv in kvs}
    servers = {kv: Server(f"trim-{kv}", MTP + PD + HANG_FLAGS, arms[kv][0], kv=kv) for kv in kvs}
    start_all(list(servers.values()))
    result: dict[str, Any] = {}
    for kv, s in servers.items():
        records = arms[kv][1]
        rec: dict[str, Any] = {"ready_s": s.ready_s, "flags": attention_flags(TIER, kv)}
        result[kv] = rec
        try:
            if s.ready_s is not None and left() > 60:
                rec.update(trim_case(s, records, n))
        except Exception as exc:  # noqa: BLE001 - keep the evidence
            rec["error"] = repr(exc)[:500]
            rec["stuck"] = stuck_evidence(s, records)
        rec["records"] = analyze(records)
        rec["logs"] = log_evidence(s)
        s.kill()
        SUMMARY["trim"] = result
        write_summary()
        brief = {k: rec.get(k) for k in ("ready_s", "identical", "peer_problems", "error")}
        say(f"trim {kv}: {json.dumps(brief)}")
        for tag in ("alone", "beside", "again"):
            if f"{tag}_dsa" in rec:
                say(f"  {tag}: {json.dumps(rec[f'{tag}_dsa'])}")
        say(f"  tokens alone {rec.get('alone')}\n  tokens beside {rec.get('beside')}")
        a = rec["records"]
        say(f"  draft steps {a['draft_steps']} paths {a['paths']} seedless {a['seedless_steps'][:10]}")
        say(f"  split {a['split_steps'][:8]}")
    SUMMARY["trim"] = result

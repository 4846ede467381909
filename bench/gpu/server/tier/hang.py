"""Stage ``hang``: the seed's hang, stock vs patched, same flags and trigger (trigger/seedless_trigger) on both arms.

HANG_SETS (default "first steady"): "first" = the split is the group's first eager collective (torch's NCCL
communicator does not exist yet); "steady" = SEEDLESS_TRIGGER_INIT_COMMS=1 creates it at start-up, so the split
leaves the ranks in two existing communicators. All servers start side by side; then per set the arms run in
HANG_ARMS order; an arm still pending after HANG_WAIT_S (60) gets the evidence (records, each rank's stack, log
tails, watchdog lines), then SIGKILL before the next arm. HANG_STREAM="waves:per_rank:tokens" sends a patched arm
that served the hang requests a stream of waves over every rank.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tier.conf import (
    CPU,
    HANG_FLAGS,
    HANG_WAIT_S,
    LOGS,
    MTP,
    NODES,
    PD,
    SUMMARY,
    TIER,
    left,
    refuse_stuck_arm_before_another,
    say,
    write_summary,
)
from tier.evidence import analyze, log_evidence, read_records, stacks_text, stuck_evidence
from tier.servers import TRIGGER_PATH, Server, gpu_memory, retire, start_all
from tier.traffic import generate, served, workload


def trigger_env(name: str, stock: bool, init_comms: bool) -> tuple[dict[str, str], str]:
    records = os.path.join(LOGS, f"{name}-records")
    os.makedirs(records, exist_ok=True)
    env = {"SGLANG_PLUGINS": "dp_mtp_fix,seedless_trigger", "SEEDLESS_TRIGGER_DIR": records,
           "SGLANG_DP_MTP_FIX_STATS": "5", "PYTHONPATH": TRIGGER_PATH}  # fmt: skip
    if CPU:
        env["SEEDLESS_TRIGGER_CPU_VOTE"] = "1"
    if TIER == "dsa":  # the model's own config seeds: no trigger in SGLang's path, the plugin only records
        env.update(SEEDLESS_TRIGGER_OBSERVE_ONLY="1", SEEDLESS_TRIGGER_DSA="1")
    if init_comms:
        env["SEEDLESS_TRIGGER_INIT_COMMS"] = "1"
    if stock:
        env["SGLANG_DP_MTP_FIX"] = "off"
    return env, records


def hang_requests(s: Server, records: str, wait_s: float) -> dict[str, Any]:
    """The same requests on every arm, each phase once the previous one's condition holds, all within wait_s:
    1 "run-1" (150 tokens) on DP rank 1, rank 0 idle: a seedless arrival beside an idle peer (the first draft step
      of the server); done once run-1 decoded 3 draft steps with a seed
    2 "one-0" (12) on rank 0 while rank 1 decodes run-1: a seedless arrival beside a busy peer
    3 after run-1 ended: "tri-0-0..2" (16 each) at once on rank 0, rank 1 idle (3 seedless rows on one rank)."""
    pool = ThreadPoolExecutor(5)
    futs: dict[str, tuple[Future[dict[str, Any]], int, int]] = {}
    t0 = time.monotonic()

    def send(rid: str, rank: int, n: int) -> None:
        futs[rid] = (pool.submit(generate, s, rid, rank, n, wait_s + 30), rank, n)

    def run1_seeded() -> bool:
        mine = [r for r in read_records(records) if r["kind"] == "draft" and "run-1" in r.get("rids", [])]
        return sum(1 for r in mine if r["seed"] is not None) >= 3

    tri = [f"tri-0-{k}" for k in range(3)]
    phases: list[tuple[str, list[tuple[str, int, int]], Callable[[], bool]]] = [
        ("1", [("run-1", 1, 150)], run1_seeded),
        ("2", [("one-0", 0, 12)], lambda: futs["one-0"][0].done()),
        ("2-end", [], lambda: futs["run-1"][0].done()),
        ("3", [(rid, 0, 16) for rid in tri], lambda: all(futs[r][0].done() for r in tri)),
    ]
    res: dict[str, Any] = {"phases": {}}
    for name, reqs, cond in phases:
        for rid, rank, n in reqs:
            send(rid, rank, n)
        done = False
        while time.monotonic() - t0 < wait_s and not (done := cond()):
            if any(not n.alive() for n in s.all_nodes()):
                break
            time.sleep(0.1)
        res["phases"][name] = round(time.monotonic() - t0, 2) if done else "stuck"
        if not done:
            break
    res["waited_s"] = round(time.monotonic() - t0, 1)
    outcome: dict[str, Any] = {}
    for rid, (f, rank, n) in futs.items():
        if not f.done():
            outcome[rid] = "pending"
        elif f.exception() is not None:
            outcome[rid] = f"error: {f.exception()!r}"[:300]
        else:
            o = f.result()
            outcome[rid] = {"tokens": len(o.get("output_ids") or []), "asked": n, "problem": served(o, n, rank),
                            "dp_rank": o.get("meta_info", {}).get("dp_rank")}  # fmt: skip
    res["requests"] = outcome
    res["served_all"] = len(outcome) == 5 and all(isinstance(v, dict) and not v["problem"] for v in outcome.values())
    pool.shutdown(wait=False, cancel_futures=True)
    return res


def stage_hang() -> None:
    sets = os.environ.get("HANG_SETS", "first steady").split()
    # HANG_ARMS="stock patched" drives stock first; one arm alone where the other is already on record
    order = os.environ.get("HANG_ARMS", "patched stock").split()
    if not order or set(order) - {"patched", "stock"}:
        sys.exit(f"HANG_ARMS must name patched and/or stock, got {order!r}")
    arms = [(st, arm) for st in sets for arm in order]
    refuse_stuck_arm_before_another([arm for _, arm in arms])
    envs = {(st, arm): trigger_env(f"{st}-{arm}", arm == "stock", st == "steady") for st, arm in arms}
    servers = {a: Server(f"{a[0]}-{a[1]}", MTP + PD + HANG_FLAGS, envs[a][0]) for a in arms}
    say("hang servers:", *(a.name for a in servers.values()), "\nflags:", *next(iter(servers.values())).flags)
    start_all(list(servers.values()))
    SUMMARY["gpu_after_ready"] = gpu_memory()
    result: dict[str, Any] = {}
    later: list[Server] = []
    for st, arm in arms:
        s, records = servers[(st, arm)], envs[(st, arm)][1]
        rec: dict[str, Any] = {"ready_s": s.ready_s, "port": s.port}
        result[f"{st}-{arm}"] = rec
        if s.ready_s is None:
            rec["not_ready"] = True
        elif left() < HANG_WAIT_S + 30:
            rec["not_run"] = f"{left():.0f}s of budget left"
        else:
            say(f"{s.name}: trigger (bound {HANG_WAIT_S:.0f}s)")
            rec.update(hang_requests(s, records, HANG_WAIT_S))
            if not rec["served_all"]:
                rec["stuck"] = stuck_evidence(s, records)
            elif arm == "patched" and os.environ.get("HANG_STREAM"):
                rec["stream"] = stream(s)
        rec["records"] = analyze(records)
        t_last = rec["records"]["t_last_step"]
        rec["s_since_last_draft_step"] = round(time.time() - t_last, 1) if t_last else None
        rec["logs"] = log_evidence(s)
        retire(s, later)  # time-sliced, a hung arm's kernels would share the GPU with the next arm
        SUMMARY["hang"] = result
        write_summary()
        say(f"{s.name}: " + json.dumps({k: rec.get(k) for k in ("served_all", "phases", "requests", "waited_s",
                                                                 "s_since_last_draft_step")}))  # fmt: skip
        a = rec["records"]
        say(f"{s.name}: steps {a['draft_steps']} paths {a['paths']} seedless {a['seedless_steps'][:8]} "
            f"eager {a['eager_steps'][:8]} split {a['split_steps'][:8]}")  # fmt: skip
        for step, p in list(a["seedless_step_records"].items())[:4]:
            say(f"  seedless step {step}: {json.dumps(p)}")
        for node, ev in rec["logs"].items():
            say(
                f"  {node}: plugin {ev['plugin'][:2]}\n    captures {len(ev['captures'])} "
                f"decode {ev['decode_cuda_graph']} nccl comms {len(ev['nccl_comms'])} errors {ev['errors'][:4]}"
            )
        if "stuck" in rec:
            say(stacks_text(rec["stuck"]))
            say(f"  watchdog {json.dumps(rec['stuck']['watchdog'])[:1500]}")
    for s in later:
        s.kill()
    SUMMARY["hang"] = result


def stream(s: Server) -> dict[str, Any]:
    """HANG_STREAM="waves:per_rank:tokens": waves of requests on every DP rank at once, then one alone."""
    waves, per_rank, tokens = (int(x) for x in os.environ["HANG_STREAM"].split(":"))
    t = time.monotonic()
    try:
        w = workload(s, tokens, per_rank, waves, 1)
    except Exception as exc:  # noqa: BLE001 - keep the evidence
        return {"error": repr(exc)[:300]}
    out = {"asked": waves * per_rank * NODES + 1, "bad": w["bad"], "tokens": tokens, "wave_s": round(w["wave_s"], 2),
           "conc_ms_tok": round(w["conc_ms_tok"], 2), "solo_ms_tok": round(w["solo_ms_tok"], 2),
           "wall_s": round(time.monotonic() - t, 1)}  # fmt: skip
    say(f"{s.name}: stream {json.dumps(out)}")
    return out

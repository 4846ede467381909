"""Stage ``soak``: the seed's shape under load. Open-loop PD-decode traffic (tier.traffic.open_loop: Poisson arrivals
with a fixed seed, rates cycling through phases, random DP rank, prompt and output length) until every DP rank ran
SOAK_BATCHES decode batches (the seed counted 2,019), bounded in requests and time, the flight recorder on.

Arms (SOAK_ARMS, default "patched stock", same shape and flags, started side by side): the patched soak runs while
the stock server waits idle; then stock, expected to stop at the first seedless arrival: SOAK_STALL_S without a
draft step on any rank ends it, with each rank's stack and path. After the traffic, the drain waits while the group
decodes (tier.traffic.drain). Under MPS no server is killed before the last arm is done (tier.conf.MPS).
Per arm and rank, from SGLang's own log lines and the observer's records: decode batches and the target-verify graph
on/off in each, draft rounds graph/eager and the share of group-eager rounds (per rate phase too), split rounds,
the round mix (idle ranks beside busy ones, unequal batches, arrivals on several ranks in one round, requests
finishing mid-round), ms per round and per draft step by path, requests served of those asked with exact tokens,
scheduler faults in the logs, and ``rollcall`` over the recorder files. One summary JSON per arm:
``$OUT/soak-<release>-<arm>.json``.
SOAK_DX_EAGER=1 sets SGLANG_DISABLE_DRAFT_EXTEND_CUDA_GRAPH=1 on both arms (#33973: every busy rank's draft-extend
eager, through the DSA backend's host-sync branch). SOAK_STOCK_INDEXSHARE=0 gives the stock arm the IndexShare-off
model copy (no seed, so no seedless eager fallback and no split to take); SOAK_INDEXSHARE=0 gives it to every arm, so
both serve the same traffic and their rounds compare phase by phase (patched against stock, thousands of rounds each).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from typing import Any

from tier.ab import ab_model_flags
from tier.conf import (
    CARRY,
    CPU,
    DSA_KV,
    HANG_FLAGS,
    LOGS,
    MPS,
    MTP,
    NODES,
    OUT,
    PD,
    RELEASE,
    SUMMARY,
    TIER,
    arm_seed_env,
    left,
    refuse_stuck_arm_before_another,
    say,
)
from tier.evidence import (
    DecodeCounter,
    cpu_profile,
    log_sizes,
    read_records,
    rollcall,
    round_times,
    scheduler_faults,
    spread,
    stacks_text,
    step_table,
    stuck_evidence,
    summarize,
)
from tier.hang import trigger_env
from tier.servers import Server, gpu_memory, retire, start_all
from tier.traffic import SoakPlan, SoakTraffic, open_loop

BATCHES = int(os.environ.get("SOAK_BATCHES", "2100"))
STALL_S = float(os.environ.get("SOAK_STALL_S", "40"))
DRAIN_S = float(os.environ.get("SOAK_DRAIN_S", "90"))  # kept for the drain (it may take longer: tier.traffic.drain)


def plan() -> SoakPlan:
    per4 = NODES / 4  # default rates scale with the ranks: low (ranks often idle), middle, high (bursts of 7-8)
    rates = os.environ.get("SOAK_RATES") or f"{0.6 * per4:.2f},{2.0 * per4:.2f},{5.0 * per4:.2f}"
    return SoakPlan(seed=int(os.environ.get("SOAK_SEED", "7")), rates=[float(r) for r in rates.split(",")],
                    phase_s=float(os.environ.get("SOAK_PHASE_S", "20")),
                    max_requests=int(os.environ.get("SOAK_MAX_REQS", "5000")),
                    output=tuple(int(x) for x in os.environ.get("SOAK_OUTPUT", "6,120").split(",")))  # fmt: skip


class Progress:
    """Stop conditions read by the traffic loop once a second: every rank reached the batch target, or no rank
    recorded a draft step for STALL_S while traffic runs (the records only grow while the group decodes)."""

    def __init__(self, s: Server, records: str, counter: DecodeCounter, target: int = BATCHES) -> None:
        self.s, self.records, self.counter, self.target = s, records, counter, target
        self.size, self.t_grew, self.t_read = -1, time.monotonic(), 0.0
        self.counts: dict[int, int] = {}

    def __call__(self) -> str | None:
        now = time.monotonic()
        if now - self.t_read < 1:
            return None
        self.t_read = now
        self.counts = self.counter.read()
        if self.counts and min(self.counts.values()) >= self.target:
            return "batches"
        return self.stopped()

    def stopped(self) -> str | None:
        """Why the group stopped decoding, or None while it decodes: a node exited, or STALL_S without a draft step."""
        now = time.monotonic()
        if any(not n.alive() for n in self.s.all_nodes()):
            return "node exited"
        size = sum(os.path.getsize(os.path.join(self.records, f)) for f in os.listdir(self.records)
                   if f.startswith("rank"))  # fmt: skip
        if size != self.size:
            self.size, self.t_grew = size, now
        elif now - self.t_grew > STALL_S:
            return "stalled"
        return None


def round_mix(steps: dict[int, dict[int, dict[str, Any]]], index_share: bool = True) -> dict[str, int | None]:
    """How the rounds mixed, counted over the steps every rank recorded. An arrival is a busy rank without a seed,
    which only a model with MTP IndexShare tells apart: without it no rank ever holds one (None)."""
    full = [steps[k] for k in sorted(steps) if len(steps[k]) == NODES]
    mix = {"rounds": len(full), "idle_beside_busy": 0, "unequal_batches": 0, "arrivals_on_2plus_ranks": 0,
           "finished_mid_round": 0, "max_bs": 0}  # fmt: skip
    prev: dict[int, dict[str, Any]] | None = None
    for p in full:
        busy = [x for x in p.values() if x["mode"] != "IDLE"]
        mix["idle_beside_busy"] += 0 < len(busy) < NODES
        mix["unequal_batches"] += len({x["bs"] for x in p.values()}) > 1
        mix["arrivals_on_2plus_ranks"] += sum(1 for x in busy if x["seed"] is None) >= 2
        mix["max_bs"] = max(mix["max_bs"], *(x["bs"] for x in p.values()))
        if prev is not None:  # a rank's batch shrank while another rank kept decoding
            shrank = [r for r in p if 0 < p[r]["bs"] < prev[r]["bs"]]
            mix["finished_mid_round"] += bool(shrank) and len(busy) > len(shrank)
        prev = p
    return {**mix, "arrivals_on_2plus_ranks": mix["arrivals_on_2plus_ranks"] if index_share else None}


def per_phase(drafts: list[dict[str, Any]], traffic: SoakTraffic) -> list[dict[str, Any]]:
    """Per rate phase: rounds, the share of group-eager rounds, and ms per round by path."""
    steps = step_table(drafts)
    bounds = [p["t0"] for p in traffic.phases] + [float("inf")]
    out = []
    for p, t_end in zip(traffic.phases, bounds[1:], strict=False):
        mine = {k: v for k, v in steps.items() if 0 in v and p["t0"] <= v[0]["t"] < t_end and len(v) == NODES}
        eager = sum(1 for v in mine.values() if all(x["path"] == "eager" for x in v.values()))
        sel = [r for r in drafts if r["step"] in mine]
        out.append({"phase": p["phase"], "rate": p["rate"], "sent": p["sent"], "rounds": len(mine),
                    "group_eager": eager, "eager_share": round(eager / len(mine), 4) if mine else None,
                    "round_ms": round_times(sel, steps)})  # fmt: skip
    return out


def by_rate(phases: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rate in sorted({p["rate"] for p in phases}):
        ps = [p for p in phases if p["rate"] == rate]
        rounds, eager = sum(p["rounds"] for p in ps), sum(p["group_eager"] for p in ps)
        out[str(rate)] = {"rounds": rounds, "group_eager": eager, "eager_share": round(eager / rounds, 4) if rounds
                          else None, "eager_share_per_phase": [p["eager_share"] for p in ps]}  # fmt: skip
    return out


def profile_later(s: Server, after_s: float, into: dict[str, Any]) -> threading.Thread:
    """Where the host's cores go once the soak is under way (the DP8 question: cores, NCCL's threads, spinning)."""

    def run() -> None:
        time.sleep(after_s)
        if all(n.alive() for n in s.all_nodes()):
            into["cpu_profile"] = cpu_profile(s)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def run_arm(s: Server, arm: str, records: str, recorder: str, index_share: bool) -> dict[str, Any]:
    counter = DecodeCounter(s)
    at_start = log_sizes(s)
    profiled: dict[str, Any] = {}
    profile_later(s, float(os.environ.get("SOAK_PROFILE_AT_S", "60")), profiled)
    margin = DRAIN_S + 90  # the drain's share, evidence, rollcall, kill
    say(f"{s.name}: soak until {BATCHES} decode batches per rank (bound {left() - margin:.0f}s)")
    end = time.monotonic() + left() - 90  # the drain goes on while the group decodes, up to the evidence's margin
    progress = Progress(s, records, counter)
    traffic = open_loop(s, plan(), progress, progress.stopped, max(30.0, left() - margin), end)
    rec: dict[str, Any] = {"stopped_by": traffic.stopped_by, "wall_s": traffic.wall_s,
                           "drain_ended_by": traffic.drain_ended_by, "drain_s": traffic.drain_s}  # fmt: skip
    if traffic.stopped_by == "stalled" or any(r["problem"] == "pending" for r in traffic.sent):
        rec["stuck"] = stuck_evidence(s, records)
    counts = counter.read()
    recs = read_records(records)  # once: the files hold every rank's every round
    drafts = [r for r in recs if r["kind"] == "draft"]
    a = summarize(recs)
    problems = [r for r in traffic.sent if r.get("problem")]
    rec.update(
        decode_batches=counts, verify_graph=counter.graph, max_running=counter.max_running,
        running_hist=counter.running_hist, draft_rounds=a["paths"], draft_steps=a["draft_steps"],
        group_eager_rounds=a["group_eager_steps"], rounds_all_ranks=a["steps_all_ranks"],
        eager_share=round(a["group_eager_steps"] / a["steps_all_ranks"], 4) if a["steps_all_ranks"] else None,
        split_rounds=len(a["split_steps"]), split_steps=a["split_steps"][:8], split_records=a["split_step_records"],
        seedless_step_records=a["seedless_step_records"], round_ms=a["round_ms"], draft_ms=a["draft_ms"],
        round_mix=round_mix(step_table(drafts), index_share), asked=len(traffic.sent),
        served=len(traffic.sent) - len(problems),
        tokens_asked=sum(r["tokens"] for r in traffic.sent), problems=problems[:10],
        request_s=spread([r["s"] for r in traffic.sent if "s" in r]),
        phases=per_phase(drafts, traffic), observer_errors=a["observer_errors"], meta=a["meta"],
        scheduler_faults=scheduler_faults(s, at_start), start_up_faults=scheduler_faults(s),
    )  # fmt: skip
    rec["by_rate"] = by_rate(rec["phases"])
    rec.update(profiled)
    rec["draft_extend"] = draft_extend(recs)
    rec.update(arrivals(recs))
    accept = [x for v in counter.accept.values() for x in v]
    rec["accept_len"] = {"per_batch": spread(accept), "mean": round(sum(accept) / len(accept), 4) if accept else None}
    time.sleep(2.5)  # two heartbeats: every rank's file is written out after its last recorded round
    rec["rollcall"] = rollcall(recorder)
    return rec


def arrivals(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """The PD arrivals the decode committed (observer, SEEDLESS_TRIGGER_PD=1): with a seed after the commit (the
    plugin's arrival_seed included), without, with one on the wire (the prefill's), and the aux row's state."""
    arr = [r for r in recs if r["kind"] == "arrival"]
    return {"arrivals_seeded": sum(1 for r in arr if r["committed_seed"]),
            "arrivals_seedless": sum(1 for r in arr if not r["committed_seed"]),
            "arrivals_wire_seeded": sum(1 for r in arr if r.get("wire_seed")),
            "arrivals_hidden_nonzero": sum(1 for r in arr if r.get("hidden_nonzero")),
            "arrivals_room_mismatch": sum(1 for r in arr if "room_in_buffer" in r and r["room"] is not None
                                          and r["room_in_buffer"] != r["room"])}  # fmt: skip


def draft_extend(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """#33973, per rank: is there a draft-extend graph, and the draft-extend backend's eager metadata calls (how many
    took the host-sync branch, how long they held the host)."""
    graph = {r["rank"]: r["draft_extend_graph"] for r in recs if r["kind"] == "graphs"}  # read at the first step
    out: dict[str, Any] = {}
    for rank in range(NODES):
        mine = [r for r in recs if r["kind"] == "dx-meta" and r["rank"] == rank and r["mode"] != "IDLE"]
        out[str(rank)] = {"graph": graph.get(rank), "eager_calls": len(mine),
                          "host_sync_branch": sum(1 for r in mine if r["host_sync_branch"]),
                          "ms": spread([r["ms"] for r in mine])}  # fmt: skip
    return out


def arm_env(arm: str) -> tuple[dict[str, str], str, str]:
    env, records = trigger_env(f"soak-{arm}", arm == "stock", init_comms=False)
    env.update(arm_seed_env(arm))
    recorder = os.path.join(LOGS, f"soak-{arm}-recorder")
    os.makedirs(recorder, exist_ok=True)
    env["SGLANG_DP_MTP_FIX_RECORDER_DIR"] = recorder
    if not CPU:  # CUDA events
        env["SEEDLESS_TRIGGER_TIME_DRAFT"] = "1"
    if os.environ.get("SOAK_DX_EAGER") == "1":
        env["SGLANG_DISABLE_DRAFT_EXTEND_CUDA_GRAPH"] = "1"
    if TIER == "dsa":  # the draft-extend backend's metadata calls, and each arrival's seed after the commit
        env.update(SEEDLESS_TRIGGER_DX="1", SEEDLESS_TRIGGER_PD="1")
    return env, records, recorder


def stage_soak() -> None:
    order = os.environ.get("SOAK_ARMS", "patched stock").split()
    refuse_stuck_arm_before_another(order)
    off = set(order) if os.environ.get("SOAK_INDEXSHARE") == "0" else set()
    off |= {"stock"} if os.environ.get("SOAK_STOCK_INDEXSHARE") == "0" else set()
    off_model = ab_model_flags() if off else []  # the arms in `off` run the IndexShare-off copy
    envs = {arm: arm_env(arm) for arm in order}
    servers = {arm: Server(f"soak-{arm}", MTP + PD + HANG_FLAGS + (off_model if arm in off else []),
                           envs[arm][0]) for arm in order}  # fmt: skip
    say("soak servers:", *order, "\nflags:", *servers[order[0]].flags)
    start_all(list(servers.values()))
    SUMMARY["gpu_after_ready"] = gpu_memory()
    result: dict[str, Any] = {}
    later: list[Server] = []
    for arm in order:
        s, (env, records, recorder) = servers[arm], envs[arm]
        rec: dict[str, Any] = {"release": RELEASE, "nodes": NODES, "arm": arm, "tier": TIER, "backend": DSA_KV,
                               "ready_s": s.ready_s, "flags": s.flags, "env": {k: v for k, v in env.items()
                               if k.startswith(("SGLANG_", "SEEDLESS_"))}, **provenance()}  # fmt: skip
        if s.ready_s is None:
            rec["not_ready"] = True
        elif left() < 120:
            rec["not_run"] = f"{left():.0f}s of budget left"
        else:
            rec.update(run_arm(s, arm, records, recorder, index_share=not (arm in off and bool(off_model))))
        retire(s, later)
        result[arm] = rec
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, f"soak-{RELEASE}-{arm}.json"), "w") as f:
            json.dump(rec, f, indent=1, default=str)
        say_arm(s, rec)
    for s in later:
        s.kill()
    SUMMARY["soak"] = {arm: {k: r.get(k) for k in BRIEF} for arm, r in result.items()}


BRIEF = ("stopped_by", "drain_ended_by", "drain_s", "decode_batches", "verify_graph", "draft_rounds", "arrivals_seeded",
         "arrivals_seedless", "accept_len",
         "group_eager_rounds", "eager_share", "split_rounds", "asked", "served", "round_ms", "draft_ms", "round_mix",
         "by_rate", "rollcall")  # fmt: skip


def say_arm(s: Server, rec: dict[str, Any]) -> None:
    say(f"{s.name}: " + json.dumps({k: rec.get(k) for k in BRIEF if k != "rollcall"}))
    say(f"{s.name}: rollcall exit {rec.get('rollcall', {}).get('exit')}: " +
        " | ".join(rec.get("rollcall", {}).get("text", [])[:6]))  # fmt: skip
    say(f"{s.name}: faults {json.dumps(rec.get('scheduler_faults'))[:1500]}")
    if "stuck" in rec:
        say(stacks_text(rec["stuck"]))
        say(f"  have a stack: {rec['stuck']['have_stack']}")
        for step, p in list(rec.get("split_records", {}).items())[:2]:
            say(f"  split step {step}: {json.dumps(p)}")


def provenance() -> dict[str, Any]:
    commit = os.path.join(CARRY, "plugin", "COMMIT")
    query = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
    gpu = "" if CPU else subprocess.run(query, capture_output=True, text=True).stdout.strip()
    return {"commit": open(commit).read().strip() if os.path.exists(commit) else None, "gpu": gpu or None,
            "gpu_sharing": "mps" if MPS else "time-sliced",
            "carry": sorted(os.listdir(CARRY)) if os.path.isdir(CARRY) else None}  # fmt: skip

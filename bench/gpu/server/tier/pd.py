"""Stage ``pd``: the seed's real topology. A prefill server and the DP decode group joined by a real KV transfer
(mooncake over TCP, PD_TRANSFER), the driver as the load balancer (each request to both, with the prefill's
bootstrap address, as sglang_router's mini_lb does), every served token judged.

Two prefill configurations (the seed's deployment is (b)):
  a  the prefill runs the decode's EAGLE/MTP flags: it computes each request's DSA seed and ships it in the PD
     metadata, so an arrival replays the draft graph;
  b  the prefill runs no speculative flags: every arrival is seedless, as with the fake backend.
Legs (PD_LEGS, default "b:patched a:stock a:patched b:stock"): prefill:decode arm (patched, stock, or seeded:
tier.conf.arm_seed_env), one DP decode server per arm, the prefills up beside them (a
call holds at most three DP4 servers under MPS: 48 client contexts). b:stock is expected to stop at the first
seedless arrival, so under MPS it runs last and nothing is killed before the end (tier.conf.MPS). Both servers are
DP servers of the same layout (--tp N --dp N --enable-dp-attention): SGLang's dummy weights depend only on each
tensor's size and dtype, so the same layout gives the prefill and the decode the same bytes, which the observer's
weight digests check.
Per leg (``pd-<release>-<prefill>-<arm>.json``): arrivals with and without a seed (the observer at the decode's
commit), the group-eager share, splits, decode batches with the verify graph on/off, ms per round, the accepted
length per decode batch, served of asked, the metadata buffers' layout on both sides and whether an arrival's write
landed outside its own slot, and every served token against a reference leg (tier.judge): the soak's requests (the
same plan, so the same prompts and lengths in every leg) and a fixed set of prompts sent one at a time (PD_JUDGE).
The reference is a:stock (stock with the prefill that ships seeds, which serves); a:stock itself is judged
against a:patched.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

from tier.conf import (
    CPU,
    HANG_FLAGS,
    LOGS,
    MPS,
    MTP,
    NODES,
    OUT,
    RELEASE,
    SUMMARY,
    TIER,
    VOCAB,
    arm_seed_env,
    left,
    say,
)
from tier.evidence import (
    DecodeCounter,
    log_sizes,
    read_records,
    rollcall,
    scheduler_faults,
    spread,
    step_table,
    stuck_evidence,
    summarize,
)
from tier.hang import trigger_env
from tier.judge import judge_leg, served_tokens
from tier.servers import TRIGGER_PATH, Server, gpu_memory, start_all
from tier.soak import BATCHES, Progress, arrivals, plan, provenance, round_mix
from tier.traffic import generate, open_loop, served, tokens_of

TRANSFER = os.environ.get("PD_TRANSFER", "mooncake_tcp")
BATCHES_A = int(os.environ.get("PD_BATCHES_A", "1000"))  # a legs: the seed's load is b's question
LEG_S = float(os.environ.get("PD_LEG_S", "90"))  # traffic bound per leg; the drain may add to it
PREFILL = ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", TRANSFER, "--disable-cuda-graph",
           "--skip-server-warmup"]  # fmt: skip
DECODE = ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", TRANSFER]


# on CPU only: 0.5.20's decode infers a host-pool retraction backup for a real transfer, which pins host memory with
# cudaHostRegister (a CPU torch has no CUDA); per-request CPU tensors instead (the GPU runs keep SGLang's default)
def cpu_decode_flags() -> list[str]:
    if not CPU:
        return []
    from sglang.srt.server_args import ServerArgs  # the driver runs beside the release it drives

    has = hasattr(ServerArgs, "disaggregation_decode_retraction_backup")
    return ["--disaggregation-decode-retraction-backup", "cpu_tensor"] if has else []


REFERENCE = ("a", "stock")
ARMS = ("patched", "stock", "seeded")  # tier.conf.arm_seed_env
# the prompts sent one at a time after each leg: short to past index_topk (2048 for GLM-5), 24 tokens each
JUDGE_LENGTHS = [int(x) for x in os.environ.get("PD_JUDGE", "4,9,17,33,64,100,250,700,2047,2048,2049,3000").split(",")]
JUDGE_TOKENS = 24


def legs() -> list[tuple[str, str]]:
    out = []
    for leg in os.environ.get("PD_LEGS", "b:patched a:stock a:patched b:stock").split():
        cfg, _, arm = leg.partition(":")
        if cfg not in ("a", "b") or arm not in ARMS:
            sys.exit(f"PD_LEGS: {leg!r} is not prefill:arm with prefill a or b and arm one of {', '.join(ARMS)}")
        out.append((cfg, arm))
    if MPS and ("b", "stock") in out[:-1]:
        sys.exit(f"under MPS the stuck leg b:stock must be driven last: {out}")
    return out


def observer_env(name: str, role: str) -> tuple[dict[str, str], str]:
    records = os.path.join(LOGS, f"{name}-records")
    os.makedirs(records, exist_ok=True)
    return {"SEEDLESS_TRIGGER_DIR": records, "SEEDLESS_TRIGGER_PD": "1", "SEEDLESS_TRIGGER_WEIGHTS": "1",
            "SEEDLESS_TRIGGER_ROLE": role, "SEEDLESS_TRIGGER_OBSERVE_ONLY": "1", "PYTHONPATH": TRIGGER_PATH,
            "SGLANG_HOST_IP": "127.0.0.1"}, records  # fmt: skip


def prefill_env(cfg: str) -> tuple[dict[str, str], str]:
    """A stock prefill (the plugin is a decode's), observed: its weights and its metadata buffers' layout."""
    env, records = observer_env(f"prefill-{cfg}", "prefill")
    env["SGLANG_PLUGINS"] = "launch_cpu_gaps,seedless_trigger" if CPU else "seedless_trigger"
    # a DSA prefill runs prompts shorter than index_topk through dense MHA with sglang-kernel's FA3 (flash_ops), which
    # the sm90 carry drops (342 MB); 0 sends every prompt through the sparse FlashMLA prefill the decode already has
    # (the top-k then keeps every position of such a prompt). The first GPU try died at its first prompt without it.
    env["SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD"] = "0"
    return env, records


def decode_env(arm: str) -> tuple[dict[str, str], str, str]:
    env, records = trigger_env(f"pd-{arm}", arm == "stock", init_comms=False)
    env.update(arm_seed_env(arm))
    extra, _ = observer_env(f"pd-{arm}", "decode")
    env.update({k: v for k, v in extra.items() if k not in ("PYTHONPATH", "SEEDLESS_TRIGGER_DIR")})
    recorder = os.path.join(LOGS, f"pd-{arm}-recorder")
    os.makedirs(recorder, exist_ok=True)
    env["SGLANG_DP_MTP_FIX_RECORDER_DIR"] = recorder
    if not CPU:
        env["SEEDLESS_TRIGGER_TIME_DRAFT"] = "1"
    return env, records, recorder


def since(recs: list[dict[str, Any]], t0: float, t1: float) -> list[dict[str, Any]]:
    """The records of one leg: those stamped in [t0, t1), and the draft timings of the draft steps among them."""
    mine = [r for r in recs if "t" in r and t0 <= r["t"] < t1]
    steps = {r["step"] for r in mine if r["kind"] == "draft"}
    untimed = [r for r in recs if "t" not in r and (r["kind"] != "draft-time" or r.get("step") in steps)]
    return untimed + mine


def judge_set() -> list[list[int]]:
    rng = random.Random(11)
    return [[1] + [rng.randrange(5, min(120, VOCAB)) for _ in range(n - 1)] for n in JUDGE_LENGTHS]


def alone(decode: Server, prefill: Server, tag: str) -> dict[str, dict[str, list[Any]]]:
    """The judge set, one request at a time (no batch beside it), each on DP rank i % NODES."""
    out = {}
    for i, prompt in enumerate(judge_set()):
        rid = f"judge-{len(prompt)}"
        try:
            ans = generate(decode, f"{tag}-{rid}", i % NODES, JUDGE_TOKENS, 120, prompt, True, prefill)
        except Exception as exc:  # noqa: BLE001 - a failed request is a finding
            say(f"{tag}: {rid} failed: {exc!r}"[:300])
            continue
        if served(ans, JUDGE_TOKENS, i % NODES) is None:
            out[rid] = tokens_of(ans)
    return out


def aux_layout(prefill_records: str, decode_records: str) -> dict[str, Any]:
    """The metadata buffers' item lengths on each side (every process of a side has the same), and the buffers whose
    lengths differ: mooncake's send_aux addresses the decode's slot k at k * (the prefill's length)."""

    def lens(folder: str) -> list[int] | None:
        for name in sorted(os.listdir(folder)):
            if name.startswith("aux-"):
                with open(os.path.join(folder, name)) as f:
                    return json.load(f).get("item_lens")
        return None

    p, d = lens(prefill_records), lens(decode_records)
    differ = [] if p is None or d is None else [i for i, (x, y) in enumerate(zip(p, d, strict=False)) if x != y]
    return {"prefill_item_lens": p, "decode_item_lens": d, "differ": differ}


def written_elsewhere(arr: list[dict[str, Any]], layout: dict[str, Any]) -> int:
    """Arrivals whose prefill write of a differing buffer landed in another slot than the arrival's own."""
    p, d = layout["prefill_item_lens"], layout["decode_item_lens"]
    n = 0
    for r in arr:
        k = r.get("idx")
        if k is not None and any((k * p[i]) // d[i] != k for i in layout["differ"]):
            n += 1
    return n


def weights(record_dirs: dict[str, str]) -> dict[str, Any]:
    """The weight digests, per model and rank, of every server, and whether each decode rank matches each prefill
    rank of the same index."""
    got: dict[str, dict[str, dict[int, str]]] = {}
    for name, folder in record_dirs.items():
        for r in read_records(folder):
            if r["kind"] == "weights":
                got.setdefault(name, {}).setdefault(r["model"], {})[r["rank"]] = r["digest"]
    pre = [n for n in got if n.startswith("prefill")]
    dec = [n for n in got if not n.startswith("prefill")]
    checks = {f"{d} vs {p}": {m: {"ranks": len(got[d][m]), "identical": sum(1 for rk, h in got[d][m].items()
                                                                           if got[p][m].get(rk) == h)}
                              for m in got[d] if m in got[p]} for d in dec for p in pre}  # fmt: skip
    return {"digests": got, "checks": checks}


def run_leg(cfg: str, arm: str, prefill: Server, decode: Server, records: str, recorder: str) -> dict[str, Any]:
    tag = f"{cfg}:{arm}"
    t0 = time.time()
    counter = DecodeCounter.from_now(decode)
    at_start = log_sizes(decode)
    target = BATCHES if cfg == "b" else BATCHES_A
    say(f"leg {tag}: until {target} decode batches per rank, or {LEG_S:.0f}s of traffic ({left():.0f}s left)")
    progress = Progress(decode, records, counter, target)
    end = time.monotonic() + min(LEG_S + 60, max(30.0, left() - 120))
    bound = min(LEG_S, max(20.0, left() - 150))
    traffic = open_loop(decode, plan(), progress, progress.stopped, bound, end, prefill, f"{cfg}{arm[0]}-")
    rec: dict[str, Any] = {"stopped_by": traffic.stopped_by, "wall_s": traffic.wall_s,
                           "drain_ended_by": traffic.drain_ended_by, "drain_s": traffic.drain_s}  # fmt: skip
    stuck = traffic.stopped_by == "stalled" or any(r.get("problem") == "pending" for r in traffic.sent)
    if stuck:
        rec["stuck"] = stuck_evidence(decode, records)
    alone_tokens = {} if stuck else alone(decode, prefill, tag.replace(":", "-"))
    counts = counter.read()
    recs = since(read_records(records), t0, time.time() + 1)
    a = summarize(recs)
    problems = [r for r in traffic.sent if r.get("problem")]
    accept = [x for v in counter.accept.values() for x in v]
    rec.update(
        decode_batches=counts, verify_graph=counter.graph, max_running=counter.max_running,
        accept_len={"per_batch": spread(accept), "mean": round(sum(accept) / len(accept), 4) if accept else None},
        draft_rounds=a["paths"], draft_steps=a["draft_steps"], group_eager_rounds=a["group_eager_steps"],
        rounds_all_ranks=a["steps_all_ranks"],
        group_eager_share=round(a["group_eager_steps"] / a["steps_all_ranks"], 4) if a["steps_all_ranks"] else None,
        split_rounds=len(a["split_steps"]), split_records=a["split_step_records"], round_ms=a["round_ms"],
        draft_ms=a["draft_ms"], round_mix=round_mix(step_table([r for r in recs if r["kind"] == "draft"])),
        **arrivals(recs), asked=len(traffic.sent), served=len(traffic.sent) - len(problems), problems=problems[:8],
        prefill_errors=sum(1 for r in traffic.sent if r.get("prefill_error")),
        request_s=spread([r["s"] for r in traffic.sent if "s" in r]), observer_errors=a["observer_errors"],
        scheduler_faults=scheduler_faults(decode, at_start),
    )  # fmt: skip
    if arm == "patched":
        time.sleep(2.5)  # two heartbeats: every rank's file is written out after its last recorded round
        rec["rollcall"] = rollcall(recorder)
    rec["_tokens"] = {"soak": served_tokens(traffic.sent), "alone": alone_tokens}
    rec["_arrivals"] = [r for r in recs if r["kind"] == "arrival"]
    return rec


def judge_all(result: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Every leg's served tokens against the reference leg's: a:stock (stock beside the prefill that ships seeds),
    a:stock itself against a:patched (and a:patched's when a:stock did not run)."""
    for leg, rec in result.items():
        ref = next((r for r in (REFERENCE, ("a", "patched")) if r != leg and "_tokens" in result.get(r, {})), None)
        if "_tokens" not in rec or ref is None:
            rec["judge"] = {"reference": None, "why": "no served tokens in this leg or in a reference leg"}
            continue
        rec.update(judge_leg(rec["_tokens"], result[ref]["_tokens"], f"{ref[0]}:{ref[1]}"))


def write_leg(rec: dict[str, Any]) -> None:
    """The leg's JSON, and its served tokens apart (``pd-tokens-...``: the judge can be run again from them)."""
    os.makedirs(OUT, exist_ok=True)
    name = f"{RELEASE}-{rec['prefill']}-{rec['arm']}.json"
    with open(os.path.join(OUT, f"pd-{name}"), "w") as f:
        json.dump({k: v for k, v in rec.items() if not k.startswith("_")}, f, indent=1, default=str)
    if "_tokens" in rec:
        with open(os.path.join(OUT, f"pd-tokens-{name}"), "w") as f:
            json.dump(rec["_tokens"], f)


def stage_pd() -> None:
    order = legs()
    cfgs = sorted({c for c, _ in order})
    arms = sorted({a for _, a in order})
    pre_envs = {c: prefill_env(c) for c in cfgs}
    dec_envs = {a: decode_env(a) for a in arms}
    prefills = {c: Server(f"prefill-{c}", (MTP if c == "a" else []) + PREFILL, pre_envs[c][0]) for c in cfgs}
    decodes = {
        a: Server(f"pd-decode-{a}", MTP + DECODE + cpu_decode_flags() + HANG_FLAGS, dec_envs[a][0]) for a in arms
    }
    say("pd servers:", *prefills, *decodes, "\nprefill a flags:", *next(iter(prefills.values())).flags)
    start_all([*prefills.values(), *decodes.values()])
    SUMMARY["gpu_after_ready"] = gpu_memory()
    dirs = {**{f"prefill-{c}": e[1] for c, e in pre_envs.items()}, **{f"decode-{a}": e[1] for a, e in dec_envs.items()}}
    SUMMARY["pd_weights"] = weights(dirs)
    say("weights:", json.dumps(SUMMARY["pd_weights"]["checks"]))
    result: dict[tuple[str, str], dict[str, Any]] = {}
    for cfg, arm in order:
        p, d = prefills[cfg], decodes[arm]
        rec: dict[str, Any] = {"release": RELEASE, "nodes": NODES, "tier": TIER, "transfer": TRANSFER,
                               "prefill": cfg, "prefill_spec": cfg == "a", "arm": arm, "leg": f"{cfg}:{arm}",
                               "ready_s": d.ready_s, "prefill_ready_s": p.ready_s, "flags": d.flags,
                               "prefill_flags": p.flags, **provenance()}  # fmt: skip
        if d.ready_s is None or p.ready_s is None:
            rec["not_ready"] = True
        elif left() < 60:  # a leg's traffic, drain and evidence (100 s skipped 0.5.17's legs at 85 s left)
            rec["not_run"] = f"{left():.0f}s of budget left"
        else:
            rec.update(run_leg(cfg, arm, p, d, dec_envs[arm][1], dec_envs[arm][2]))
            layout = aux_layout(pre_envs[cfg][1], dec_envs[arm][1])
            rec.update(aux_layout=layout, arrivals_written_elsewhere=written_elsewhere(rec.pop("_arrivals"), layout))
        result[(cfg, arm)] = rec
        write_leg(rec)
        say(f"leg {cfg}:{arm}: " + json.dumps({k: rec.get(k) for k in BRIEF}, default=str))
    judge_all(result)
    for rec in result.values():
        write_leg(rec)
        say(f"judged {rec['leg']}: " + json.dumps({k: rec.get(k) for k in ("tokens_compared", "tokens_identical")})
            + " " + json.dumps({k: {x: v.get(x) for x in ("requests_compared", "requests_identical", "near_ties",
                                                          "divergences")} for k, v in rec.get("judge", {}).items()
                                if isinstance(v, dict)}))  # fmt: skip
    for s in [*decodes.values(), *prefills.values()]:
        s.kill()
    SUMMARY["pd"] = {rec["leg"]: {k: rec.get(k) for k in BRIEF} for rec in result.values()}


BRIEF = ("stopped_by", "drain_ended_by", "decode_batches", "verify_graph", "draft_rounds", "group_eager_share",
         "split_rounds", "arrivals_seeded", "arrivals_seedless", "arrivals_written_elsewhere", "asked", "served",
         "prefill_errors", "round_ms", "accept_len", "tokens_compared", "tokens_identical")  # fmt: skip

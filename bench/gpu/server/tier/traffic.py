"""Requests to a server: one request, waves of concurrent requests, and the soak's open-loop PD-decode traffic."""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from tier.conf import NODES, VOCAB
from tier.servers import Server

_room = [1000]
_room_lock = threading.Lock()


def generate(
    s: Server,
    rid: str,
    rank: int,
    n: int,
    timeout: float = 120,
    input_ids: list[int] | None = None,
    logprobs: bool = False,
    prefill: Server | None = None,
) -> dict[str, Any]:
    """One PD-decode request routed to DP rank ``rank``, greedy, exactly ``n`` new tokens asked. With ``prefill`` (a
    real KV transfer, stage pd) the same body goes to the prefill server and the decode at once, with the prefill's
    bootstrap address, as sglang_router's mini_lb does; the decode's answer is returned (a prefill error is kept)."""
    with _room_lock:  # bootstrap_room % NODES == the routed rank (the fake transfer's rank; SGLang's
        _room[0] += 1 + (rank - _room[0] - 1) % NODES  # follow_bootstrap_room on a DP prefill)
        room = _room[0]
    body: dict[str, Any] = {"rid": rid, "input_ids": input_ids or [1, 5 + room % 50, 6, 7],
                            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    if logprobs:  # the top two at each position too: a difference is judged by the gap there (tier.judge)
        body.update(return_logprob=True, top_logprobs_num=2 if prefill is not None else 0)
    if s.dp:
        body["routed_dp_rank"] = rank
    if prefill is not None:
        body.update(bootstrap_host="127.0.0.1", bootstrap_port=prefill.bootstrap_port, bootstrap_room=room)
    elif s.pd:  # SGLang's fake-transfer marker; nothing is contacted
        body.update(bootstrap_host="2.2.2.2", bootstrap_room=room)
    t = time.monotonic()
    pre: dict[str, Any] = {}
    sender = None
    if prefill is not None:
        sender = threading.Thread(target=_post_into, args=(prefill, body, timeout, pre), daemon=True)
        sender.start()
    out = _post(s, body, timeout)
    out["_s"] = time.monotonic() - t
    if sender is not None:
        sender.join(timeout)
        if "error" in pre or sender.is_alive():
            out["_prefill_error"] = pre.get("error", "no answer")
    return out


def _post(s: Server, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{s.port}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return out


def _post_into(s: Server, body: dict[str, Any], timeout: float, into: dict[str, Any]) -> None:
    try:
        into["out"] = _post(s, body, timeout)
    except Exception as exc:  # noqa: BLE001 - the caller reports it
        into["error"] = f"{type(exc).__name__}: {exc}"[:200]


def tokens_of(out: dict[str, Any]) -> dict[str, list[Any]]:
    """What a judge compares: the tokens, each one's logprob, and the gap between the top two logprobs there (None
    where the server returned no top logprobs)."""
    meta = out.get("meta_info", {})
    lps = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    gaps = [round(t[0][0] - t[1][0], 6) if t and len(t) > 1 and t[1][0] is not None else None for t in tops]
    return {"ids": list(out.get("output_ids") or []), "lp": [None if x[0] is None else round(x[0], 6) for x in lps],
            "gap": gaps}  # fmt: skip


def served(out: dict[str, Any], want: int, rank: int | None) -> str | None:
    """What is wrong with a response, or None: exactly ``want`` tokens, from the routed rank."""
    got = len(out.get("output_ids") or [])
    dp = out.get("meta_info", {}).get("dp_rank")
    if got != want:
        return f"{got} tokens, asked {want}"
    if rank is not None and dp not in (None, rank):
        return f"served by DP rank {dp}, routed to {rank}"
    return None


def workload(s: Server, tokens: int, per_rank: int, waves: int, solo: int) -> dict[str, Any]:
    """Waves of concurrent requests on every DP rank at once, then single requests (the other ranks idle)."""
    conc, walls, bad = [], [], []
    for w in range(waves):
        reqs = [(f"w{w}-{rk}-{j}", rk) for rk in s.ranks for j in range(per_rank * (NODES // len(s.ranks)))]
        t = time.monotonic()
        with ThreadPoolExecutor(len(reqs)) as pool:
            outs = list(pool.map(lambda q: generate(s, q[0], q[1], tokens), reqs))
        walls.append(time.monotonic() - t)
        conc += [o["_s"] for o in outs]
        bad += [p for o, q in zip(outs, reqs, strict=True) if (p := served(o, tokens, q[1] if s.dp else None))]
    singles = []
    for k in range(solo):
        rank = s.ranks[k % len(s.ranks)]
        o = generate(s, f"solo-{k}", rank, tokens)
        singles.append(o["_s"])
        bad += [p for p in [served(o, tokens, rank if s.dp else None)] if p]
    return {"conc_ms_tok": 1000 * statistics.median(conc) / tokens, "wave_s": statistics.median(walls),
            "solo_ms_tok": 1000 * statistics.median(singles) / tokens, "conc": conc, "solo": singles,
            "bad": bad[:4]}  # fmt: skip


# --- the soak's open-loop traffic -------------------------------------------------------------------------------------
@dataclass
class SoakPlan:
    """Open-loop arrivals (Poisson, fixed seed) in phases of ``phase_s`` seconds cycling through ``rates`` (requests
    per second for the whole server), each request on a random DP rank with a random prompt and output length."""

    seed: int
    rates: list[float]
    phase_s: float
    max_requests: int
    prompt: tuple[int, int] = (4, 48)
    output: tuple[int, int] = (6, 120)


@dataclass
class SoakTraffic:
    sent: list[dict[str, Any]] = field(default_factory=list)
    phases: list[dict[str, Any]] = field(default_factory=list)
    stopped_by: str = ""
    wall_s: float = 0.0
    drain_ended_by: str = ""
    drain_s: float = 0.0


def drain(futures: list[Future[dict[str, Any]]], stopped: Callable[[], str | None], end: float) -> str:
    """Wait for every request while the group decodes: "drained" when all are answered, what ``stopped()`` names once
    the group stops (a stuck group's requests never come back), or "time" at ``end`` (monotonic) with requests still
    in flight on a group that decodes (a backlog, not a hang)."""
    pending = {f for f in futures if not f.done()}
    while pending:
        if time.monotonic() >= end:
            return "time"
        if why := stopped():
            return why
        _, pending = wait(pending, timeout=min(1.0, max(0.01, end - time.monotonic())), return_when=FIRST_COMPLETED)
    return "drained"


def _request_of(rng: random.Random, plan: SoakPlan, n: int) -> dict[str, Any]:
    # token ids inside the model's vocabulary: a real prefill embeds them (stage pd; the fake backend never did)
    prompt = [1] + [rng.randrange(5, min(400, VOCAB)) for _ in range(rng.randint(*plan.prompt) - 1)]
    # mostly short and medium outputs, some long ones: requests finish in the middle of others' decoding
    tokens = rng.randint(*plan.output) if rng.random() < 0.85 else rng.randint(plan.output[1], 2 * plan.output[1])
    return {"rid": f"soak-{n}", "rank": rng.randrange(NODES), "prompt": prompt, "tokens": tokens}


def open_loop(
    s: Server,
    plan: SoakPlan,
    done: Callable[[], str | None],
    stopped: Callable[[], str | None],
    max_s: float,
    end: float,
    prefill: Server | None = None,
    rid_prefix: str = "",
) -> SoakTraffic:
    """Send the plan's arrivals until ``done()`` names a reason to stop, ``max_requests`` were sent or ``max_s``
    passed; then drain what is in flight until ``end`` (tier.traffic.drain; nothing after a stall: nothing more will
    come). Every response is checked for its exact tokens; a request still pending is a finding, kept as such. With
    ``prefill`` (stage pd) each request also goes to that prefill server, and each answer's tokens, logprobs and
    top-two gaps are kept for the judge (``tokens``); ``rid_prefix`` keeps a leg's request ids apart from an earlier
    leg's on the same server (SGLang refuses an id still in flight), and ``n`` names the plan's request."""
    rng = random.Random(plan.seed)
    traffic = SoakTraffic()
    futures: list[tuple[dict[str, Any], Future[dict[str, Any]]]] = []
    pool = ThreadPoolExecutor(max(64, 16 * NODES))
    t0 = time.monotonic()
    next_at, n = t0, 0
    while True:
        now = time.monotonic()
        phase = int((now - t0) // plan.phase_s)
        rate = plan.rates[phase % len(plan.rates)]
        if not traffic.phases or traffic.phases[-1]["phase"] != phase:
            traffic.phases.append({"phase": phase, "rate": rate, "t0": time.time(), "sent": 0})
        reason = done() or ("requests" if n >= plan.max_requests else None) or ("time" if now - t0 > max_s else None)
        if reason:
            traffic.stopped_by = reason
            break
        if now < next_at:
            time.sleep(min(next_at - now, 0.05))
            continue
        n += 1
        req = _request_of(rng, plan, n)
        req.update(t_sent=time.time(), phase=phase, n=req["rid"], rid=rid_prefix + req["rid"])
        futures.append((req, pool.submit(generate, s, req["rid"], req["rank"], req["tokens"], max(1.0, end - now),
                                         req["prompt"], prefill is not None, prefill)))  # fmt: skip
        traffic.phases[-1]["sent"] += 1
        next_at += rng.expovariate(rate)
    t_drain = time.monotonic()
    traffic.drain_ended_by = (
        "stalled" if traffic.stopped_by == "stalled" else drain([f for _, f in futures], stopped, end)
    )
    traffic.drain_s = round(time.monotonic() - t_drain, 1)
    for req, fut in futures:
        req["prompt_len"] = len(req.pop("prompt"))
        traffic.sent.append(req)
        if not fut.done():
            req["problem"] = "pending"
            continue
        try:
            out = fut.result()
        except Exception as exc:  # noqa: BLE001 - a failed request is a finding, kept
            req["problem"] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        req.update(problem=served(out, req["tokens"], req["rank"]), got=len(out.get("output_ids") or []),
                   s=round(out["_s"], 3))  # fmt: skip
        if prefill is not None:
            req["tokens_out"] = tokens_of(out)
            if "_prefill_error" in out:
                req["prefill_error"] = out["_prefill_error"]
    pool.shutdown(wait=False, cancel_futures=True)  # a stuck server's requests end when it is killed
    traffic.wall_s = round(time.monotonic() - t0, 1)
    return traffic

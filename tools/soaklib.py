"""Soak: sustained PD-decode traffic on a real launch of the tier's shape, with soak-forced eager rounds (the vote
probe, ``tests/launch/probes/launch_vote_probe``, point 4) and malformed requests, then the checks. In tools/, beside
``launchlib``, because both ``bench/soak.py`` (on demand: >= 2,019 decode batches per rank, plugin on and off) and
the launch tier's short soak (``tests/launch/test_vote_probe.py``: ~200, one release, inside c's patched launch) use it.

Traffic: 1-16 requests in flight (the target concurrency changes every few completions), each routed to a DP rank
(mostly the one with fewer in flight, else at random), with its own ``max_new_tokens`` and prompt; a new request
starts whenever one finishes (arrivals while others decode), until every rank has run the asked number of decode
batches (counted from the probe's records as they are written). Every ``malformed_every`` requests one malformed
request, in turn: a bad JSON body, no ``bootstrap_room``, ``max_new_tokens`` 0; SGLang's answer is recorded as it
comes.
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from launchlib import LAUNCH_DIR

FORCE_RID = "soak-"  # the probe forces rounds only for batches holding such a request (its default prefix)
MALFORMED = ("bad_json", "no_bootstrap_room", "max_new_tokens_0")
# SGLang's answers (read from 0.5.17's and 0.5.20's source): a body that is not JSON is
# refused by FastAPI's validation (400, SGLang's error object "JSON decode error"); with the fake transfer backend the
# tokenizer manager gives a request without bootstrap_room a room of its own (fake_bootstrap_room_counter) and serves
# it (200, its 8 tokens); max_new_tokens 0 passes SamplingParams.verify ("at least 0"): 200 with 0 tokens.
MALFORMED_ANSWER = {"bad_json": {400}, "no_bootstrap_room": {200}, "max_new_tokens_0": {200}}
NEW_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# Scheduler RSS may grow this much from the soak's start to its end (allocator warm-up of new batch shapes grows it
# by a few MB); a leak per request or per round would pass it within a few hundred rounds.
RSS_GROWTH_MB = 64
PLUGIN_METRIC = "sglang:dp_mtp_fix_"


def probe_pythonpath(gaps: str, tmp: Path, probe: str = "launch_vote_probe") -> str:
    """The tier's stand-ins plus a test-only probe of ``tests/launch/probes`` (the vote probe unless named),
    registered like launch_cpu_gaps (a dist-info in a temp dir)."""
    info = tmp / f"{probe}-0.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {probe.replace('_', '-')}\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{probe} = {probe}:register\n")
    return os.pathsep.join([gaps, str(LAUNCH_DIR / "probes"), str(tmp)])


def force_env(rate: float, seed: int) -> dict[str, str]:
    return {"LAUNCH_VOTE_PROBE_FORCE_RATE": str(rate), "LAUNCH_VOTE_PROBE_FORCE_SEED": str(seed),
            "LAUNCH_VOTE_PROBE_FORCE_RID": FORCE_RID}  # fmt: skip


def records_size(records: Path) -> int:
    """How much the probe has written so far (``launchlib.settle`` waits for it to stop growing)."""
    return sum(p.stat().st_size for p in records.glob("rank*.jsonl"))


def read_records(records: Path) -> list[dict]:
    return [json.loads(line) for p in sorted(records.glob("rank*.jsonl")) for line in p.read_text().splitlines()]


def rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


class DecodeCount:
    """DECODE draft steps per rank, read from the probe's files as they grow (only the new bytes each time)."""

    def __init__(self, records: Path):
        self.records = records
        self.offsets: dict[Path, int] = {}
        self.partial: dict[Path, bytes] = {}
        self.counts: dict[int, int] = {}

    def read(self) -> dict[int, int]:
        for path in sorted(self.records.glob("rank*.jsonl")):
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = self.partial.get(path, b"") + f.read()
                self.offsets[path] = f.tell()
            *lines, self.partial[path] = data.split(b"\n")
            for line in lines:
                rec = json.loads(line)
                if rec["kind"] == "draft" and rec["mode"] == "DECODE":
                    self.counts[rec["rank"]] = self.counts.get(rec["rank"], 0) + 1
        return dict(self.counts)


@dataclass
class Traffic:
    requests: list[dict] = field(default_factory=list)
    malformed: list[dict] = field(default_factory=list)
    rss_kb: dict[int, list[list[float]]] = field(default_factory=dict)  # rank -> [[seconds, kB], ...]
    concurrency: list[int] = field(default_factory=list)  # the target in flight, each time it changed
    decode_at_start: dict[int, int] = field(default_factory=dict)
    decode_at_end: dict[int, int] = field(default_factory=dict)
    wall_s: float = 0.0
    stopped_by: str = ""


def _post(port: int, data: bytes, timeout: float) -> tuple[int, dict | str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=data,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
            return resp.status, json.loads(body)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")[:400]


def _request(port: int, n: int, rank: int, rng: random.Random, timeout: float) -> dict:
    room = 100_000 + 2 * n + rank  # room % 2 == rank, should the router follow the room
    asked = rng.choice(NEW_TOKENS)
    prompt = [1, *(rng.randrange(2, 128) for _ in range(rng.randrange(2, 12)))]
    rid = f"{FORCE_RID}{n}"
    body = {"rid": rid, "routed_dp_rank": rank, "bootstrap_host": "2.2.2.2", "bootstrap_room": room,
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": asked, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    rec: dict = {"rid": rid, "rank": rank, "asked": asked}

    def run() -> dict:
        t0 = time.monotonic()
        try:
            status, out = _post(port, json.dumps(body).encode(), timeout)
        except Exception as exc:  # noqa: BLE001 - a timeout or a dropped connection is a lost request
            rec.update(error=f"{type(exc).__name__}: {exc}")
            return rec
        rec["s"] = round(time.monotonic() - t0, 2)
        if status != 200 or not isinstance(out, dict):
            rec.update(error=f"HTTP {status}: {out}")
            return rec
        meta = out.get("meta_info", {})
        rec.update(got=len(out.get("output_ids", [])), completion_tokens=meta.get("completion_tokens"),
                   dp_rank=meta.get("dp_rank"), finish=(meta.get("finish_reason") or {}).get("type"))  # fmt: skip
        return rec

    rec["run"] = run
    return rec


def _malformed(port: int, kind: str, n: int, timeout: float) -> dict:
    good = {
        "rid": f"malformed-{n}",
        "bootstrap_host": "2.2.2.2",
        "bootstrap_room": 900_000 + n,
        "input_ids": [1, 5, 6, 7],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    }
    if kind == "bad_json":
        data = b'{"input_ids": [1, 5, 6,'
    elif kind == "no_bootstrap_room":
        data = json.dumps({k: v for k, v in good.items() if k != "bootstrap_room"}).encode()
    else:
        data = json.dumps({**good, "sampling_params": {**good["sampling_params"], "max_new_tokens": 0}}).encode()
    rec: dict = {"kind": kind, "after_request": n}
    try:
        status, out = _post(port, data, timeout)
    except Exception as exc:  # noqa: BLE001
        rec.update(status=None, error=f"{type(exc).__name__}: {exc}")
        return rec
    rec["status"] = status
    if isinstance(out, dict):
        rec["output_tokens"] = len(out.get("output_ids", []))
        rec["finish"] = (out.get("meta_info", {}).get("finish_reason") or {}).get("type")
    else:
        rec["body"] = out[:200]
    return rec


def drive(
    port: int,
    records: Path,
    pids: dict[int, int],
    batches: int,
    seed: int = 0,
    max_in_flight: int = 16,
    malformed_every: int = 100,
    timeout: float = 600,
    max_wall: float = 3 * 3600,
    progress: Callable[[str], None] | None = None,
) -> Traffic:
    """Send traffic until every DP rank has run ``batches`` more DECODE batches (or ``max_wall`` seconds passed)."""
    rng = random.Random(seed)
    traffic = Traffic()
    counter = DecodeCount(records)
    start = counter.read()
    traffic.decode_at_start = start
    t0 = time.monotonic()
    last_rss = -1e9
    last_progress = t0
    in_flight: set[Future] = set()
    malformed: list[Future] = []
    rank_of: dict[Future, int] = {}
    n = 0
    target, until = 1, 0  # target concurrency, and the completion count at which it changes next
    done_count = 0
    with ThreadPoolExecutor(max_in_flight + 4) as pool:
        while True:
            now = time.monotonic()
            if now - last_rss >= 5:
                for rank, pid in pids.items():
                    kb = rss_kb(pid)
                    if kb is not None:
                        traffic.rss_kb.setdefault(rank, []).append([round(now - t0, 1), kb])
                last_rss = now
            counts = counter.read()
            ran = {r: counts.get(r, 0) - start.get(r, 0) for r in pids}
            if progress and now - last_progress >= 60:
                progress(f"{now - t0:.0f}s: requests {n}, in flight {len(in_flight)}, decode batches {ran}")
                last_progress = now
            if min(ran.values()) >= batches:
                traffic.stopped_by = "batches"
                break
            if now - t0 > max_wall:
                traffic.stopped_by = "max_wall"
                break
            if done_count >= until:
                target = rng.randint(1, max_in_flight)
                until = done_count + rng.randint(4, 24)
                traffic.concurrency.append(target)
            while len(in_flight) < target:
                n += 1
                if malformed_every and n % malformed_every == 0:
                    kind = MALFORMED[(n // malformed_every - 1) % len(MALFORMED)]
                    malformed.append(pool.submit(_malformed, port, kind, n, timeout))
                # Mostly to the rank with fewer requests in flight (both ranks decode whenever 2+ are in flight, so
                # neither lags far behind the other's count), else at random.
                busy = [sum(rank_of[f] == k for f in in_flight) for k in (0, 1)]
                rank = busy.index(min(busy)) if busy[0] != busy[1] and rng.random() < 0.8 else rng.randrange(2)
                rec = _request(port, n, rank, rng, timeout)
                traffic.requests.append(rec)
                future = pool.submit(rec.pop("run"))
                rank_of[future] = rank
                in_flight.add(future)
            finished, in_flight = wait(in_flight, timeout=1.0, return_when=FIRST_COMPLETED)
            done_count += len(finished)
        wait(in_flight)
        traffic.malformed = [f.result() for f in malformed]
    traffic.wall_s = round(time.monotonic() - t0, 1)
    traffic.decode_at_end = counter.read()
    for rank, pid in pids.items():
        kb = rss_kb(pid)
        if kb is not None:
            traffic.rss_kb.setdefault(rank, []).append([traffic.wall_s, kb])
    return traffic


def would_be_graph(rec: dict) -> bool:
    """The draft path this rank would take with a captured draft graph (``test_vote_probe.would_be_graph``)."""
    return rec["generic"] and rec["vote"] is not False and not rec["needs_eager"]


def _per_rank_metric(text: str, name: str, **match: str) -> dict[int, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[int, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in match.items()):
                out[int(s.labels["dp_rank"])] = out.get(int(s.labels["dp_rank"]), 0) + s.value
    return out


def analyse(records: list[dict], traffic: Traffic, plugin_on: bool, metrics_end: str | None,
            after_round: int = 0) -> tuple[dict, list[str]]:  # fmt: skip
    """Figures, and the failed checks (empty: every check held). Per-round checks over the rounds after
    ``after_round`` (the soak's; a shared launch served other requests before); the counters over the whole launch."""
    fail: list[str] = []
    meta = {r["rank"]: r for r in records if r["kind"] == "meta"}
    drafts = [r for r in records if r["kind"] == "draft"]
    ranks = sorted(meta)
    if ranks != [0, 1]:
        fail.append(f"probe meta from ranks {ranks}, not [0, 1]")
    rounds: dict[int, dict[int, dict]] = {}
    for rec in drafts:
        if rec["round"] is None:
            fail.append(f"a draft step outside a counted MLP sync: {rec}")
            continue
        if rec["rank"] in rounds.get(rec["round"], {}):
            fail.append(f"two draft steps of rank {rec['rank']} in round {rec['round']}")
        rounds.setdefault(rec["round"], {})[rec["rank"]] = rec
    soak = {r: p for r, p in rounds.items() if r > after_round}
    lonely = sorted(r for r, p in soak.items() if set(p) != {0, 1})
    forced = {r for r, p in soak.items() if any(rec["needs_eager"] for rec in p.values())}
    split = sorted(r for r, p in soak.items() if len({would_be_graph(rec) for rec in p.values()}) > 1)
    vote_no = {r for r, p in soak.items() if any(rec["vote"] is False for rec in p.values())}
    soak_recs = [rec for p in soak.values() for rec in p.values()]
    decode = {k: sum(rec["rank"] == k and rec["mode"] == "DECODE" for rec in soak_recs) for k in (0, 1)}
    idle = {k: sum(rec["rank"] == k and rec["mode"] == "IDLE" for rec in soak_recs) for k in (0, 1)}
    forced_by = {k: sum(rec["rank"] == k and rec["needs_eager"] for rec in soak_recs) for k in (0, 1)}
    if lonely:
        fail.append(f"{len(lonely)} rounds without a draft step of both ranks, e.g. {lonely[:5]}")
    if plugin_on:
        if split:
            fail.append(f"ranks took different draft paths in {len(split)} rounds, e.g. {split[:5]}")
        if vote_no != forced:
            fail.append(f"group vote 'eager' in rounds {sorted(vote_no ^ forced)[:10]} (xor the forced rounds)")
        asked_wrong = [
            (rec["round"], rec["rank"], rec["asked"], rec["needs_eager"])
            for rec in soak_recs
            if rec["asked"] != (rec["needs_eager"] if rec["mode"] == "DECODE" else None)
        ]
        if asked_wrong:
            fail.append(f"the plugin's ask of the hook differs from the probe's need: {asked_wrong[:5]}")
        if not all(forced_by.values()):
            fail.append(f"no forced round on some rank: {forced_by}")
    elif set(split) != forced:
        fail.append(f"plugin off: would-split rounds {split[:10]} are not the forced rounds {sorted(forced)[:10]}")
    if any(rec["graph_runner"] or rec["can_run"] for rec in soak_recs):
        fail.append("a draft step had a graph runner or could run a graph (CPU: none expected)")

    # Counters on /metrics over the whole launch against the probe's counts (every decode/idle batch of a rank is
    # one draft step, recorded; the plugin counts each after its sync).
    counters: dict = {}
    if plugin_on:
        if metrics_end is None:
            fail.append("no /metrics scrape")
        else:
            all_forced = {r for r, p in rounds.items() if any(rec["needs_eager"] for rec in p.values())}
            probe = {
                "decode_batches": {k: sum(rec["rank"] == k for rec in drafts) for k in (0, 1)},
                "forced_eager_vote": {
                    k: sum(rec["rank"] == k and rec["round"] in all_forced for rec in drafts) for k in (0, 1)
                },
                "own_seedless_batch": {
                    k: sum(rec["rank"] == k and rec["needs_eager"] for rec in drafts) for k in (0, 1)
                },
            }
            probe["other_rank_vote"] = {k: probe["forced_eager_vote"][k] - probe["own_seedless_batch"][k]
                                        for k in (0, 1)}  # fmt: skip
            decode_total = PLUGIN_METRIC + "decode_batches_total"
            forced_total = PLUGIN_METRIC + "forced_eager_draft_batches_total"
            seen = {
                "decode_batches": _per_rank_metric(metrics_end, decode_total),
                "forced_eager_vote": _per_rank_metric(metrics_end, decode_total, draft_vote="forced_eager"),
                "own_seedless_batch": _per_rank_metric(metrics_end, forced_total, cause="own_seedless_batch"),
                "other_rank_vote": _per_rank_metric(metrics_end, forced_total, cause="other_rank_vote"),
            }
            seen = {k: {r: int(v.get(r, -1)) for r in (0, 1)} for k, v in seen.items()}
            counters = {"metrics": seen, "probe": probe}
            if seen != probe:
                fail.append(f"/metrics counters differ from the probe's counts: {counters}")

    reqs = traffic.requests
    bad = [r for r in reqs if r.get("error") or r.get("got") != r["asked"] or r.get("completion_tokens") != r["asked"]
           or r.get("dp_rank") != r["rank"]]  # fmt: skip
    if bad:
        fail.append(f"{len(bad)} of {len(reqs)} requests failed or came back short/long/misrouted, e.g. {bad[:3]}")
    if not all(m.get("status") is not None for m in traffic.malformed):
        fail.append(f"a malformed request got no HTTP answer: {traffic.malformed}")
    if traffic.stopped_by != "batches":
        fail.append(f"stopped by {traffic.stopped_by} before the asked decode batches: {decode}")
    rss = {
        rank: {"start_mb": round(s[0][1] / 1024, 1), "end_mb": round(s[-1][1] / 1024, 1),
               "max_mb": round(max(kb for _, kb in s) / 1024, 1), "samples": len(s)}
        for rank, s in traffic.rss_kb.items()
    }  # fmt: skip
    figures = {
        "decode_batches_per_rank": decode,
        "idle_batches_per_rank": idle,
        "rounds": len(soak),
        "forced_rounds": len(forced),
        "forced_eager_share": round(len(forced) / len(soak), 4) if soak else None,
        "forced_by_rank": forced_by,
        "rounds_ranks_disagree": len(split),
        "requests": len(reqs),
        "requests_ok": len(reqs) - len(bad),
        "tokens_generated": sum(r.get("got") or 0 for r in reqs),
        "max_new_tokens_asked": sorted({r["asked"] for r in reqs}),
        "concurrency_targets": {
            "min": min(traffic.concurrency, default=0),
            "max": max(traffic.concurrency, default=0),
            "changes": len(traffic.concurrency),
        },
        "requests_per_rank": {k: sum(r["rank"] == k for r in reqs) for k in (0, 1)},
        "malformed": traffic.malformed,
        "counters": counters,
        "scheduler_rss": rss,
        "rss_kb_samples": traffic.rss_kb,
        "wall_s": traffic.wall_s,
        "stopped_by": traffic.stopped_by,
    }
    return figures, fail

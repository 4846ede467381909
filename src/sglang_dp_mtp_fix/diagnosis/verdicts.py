"""``rollcall``'s verdicts: from the files ``reader`` read, each rank's one file, the first round where ranks decided
differently, which ranks stopped, and whether a group that does not advance stalls outside the vote. Each verdict is
data (``findings``); the sentences that say them are the ``rollcall`` command's."""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from typing import Any

from sglang_dp_mtp_fix.diagnosis.reader import ALIVE, RankFile, Record, liveliest, process_state, read_all, watch
from sglang_dp_mtp_fix.diagnosis.recfile import HEARTBEAT_STALE_S

SETTLE_S = 1.5  # rollcall watches the entered rounds this long (more than a heartbeat) before judging a stall
BEHIND_ROUNDS = 2  # ranks of a group are at most one round apart while they take part in every round


def decide(targets: Sequence[str], settle_s: float = SETTLE_S) -> tuple[dict[str, Any], int, list[dict[str, Any]]]:
    """Read every rank's file: first the heartbeats (which ranks stopped: frozen or dead), then the decisions (the
    first round where ranks decided differently), then, when no round advances, whether the group stalls outside
    the vote or a rank is many rounds behind. (data, exit code): 0 all agree and nothing stopped, 1 a divergence, a
    stopped rank, a stall, mixed versions or a rank without a file, 2 unreadable or incompatible files, or fields
    that cannot be true (nothing else found). ``findings``: what the answer says, as data (its text: the
    ``rollcall`` command). ``settle_s``: how long to watch the heartbeats and the entered rounds
    (0: not watched, no stall judged, e.g. for copied files). Bounded by the records the files hold."""
    files, refused, notes = read_all(targets)
    data: dict[str, Any] = {"refused": refused, "notes": notes, "ranks": [], "missing_ranks": [], "superseded": []}
    if not files:
        data["verdict"] = "unreadable"
        return data, 2, [{"kind": "no_file", "refused": bool(refused)}]
    newest = _one_file_per_rank(files, data)
    if newest is None:
        data["verdict"] = "incompatible"
        return data, 2, [{"kind": "incompatible", "shapes": sorted({(f.dp_size, f.tp_size) for f in files})}]
    dp_size, tp_size = next(iter(newest.values())).dp_size, next(iter(newest.values())).tp_size
    by_dp = tp_size == dp_size  # one scheduler per DP rank: name DP ranks; else the MLP-sync group's (tp) ranks
    ranks = sorted(newest.values(), key=lambda f: f.dp_rank if by_dp else f.tp_rank)
    labels = {f.path: f.dp_rank if by_dp else f.tp_rank for f in ranks}
    data["rank_kind"] = "dp" if by_dp else "tp"
    data["size"] = tp_size
    data["missing_ranks"] = sorted(set(range(tp_size)) - {f.tp_rank for f in ranks})
    data["ranks"] = [_rank_entry(f, labels[f.path]) for f in ranks]
    divergence, data["compared"] = _first_divergence(ranks, labels)
    liveness = _liveness(ranks, settle_s)
    for f, entry in zip(ranks, data["ranks"], strict=True):
        entry.update(liveness["per_rank"][f.path])
    data["liveness"] = {k: v for k, v in liveness.items() if k != "per_rank"}
    code, verdict, findings = _judge(data, ranks, labels, divergence, liveness)
    data["verdict"] = verdict
    return data, code, findings


def _one_file_per_rank(files: Sequence[RankFile], data: dict[str, Any]) -> dict[int, RankFile] | None:
    """Each rank's liveliest file, of the deployment (dp size, tp size) whose file is liveliest; the others are
    ``superseded``. None when two deployments' processes both run: files of two groups."""
    best = max(files, key=liveliest)
    shape = (best.dp_size, best.tp_size)
    others = [f for f in files if (f.dp_size, f.tp_size) != shape]
    if others and ALIVE[process_state(best)] == 2 and any(ALIVE[process_state(f)] == 2 for f in others):
        return None
    if others:
        data["notes"].append(f"{len(others)} file(s) of another deployment (dp size, tp size not {shape}) ignored: "
                             "the newest files are this one's")  # fmt: skip
    newest: dict[int, RankFile] = {}
    for f in sorted((f for f in files if (f.dp_size, f.tp_size) == shape), key=liveliest):
        if f.tp_rank in newest:
            data["superseded"].append(newest[f.tp_rank].path)
        newest[f.tp_rank] = f
    return newest


def _rank_entry(f: RankFile, label: int) -> dict[str, Any]:
    return {
        "rank": label,
        "dp_rank": f.dp_rank,
        "tp_rank": f.tp_rank,
        "global_rank": f.global_rank,
        "file": f.path,
        "host": f.host,
        "pid": f.pid,
        "plugin_version": f.plugin_version,
        "sglang_version": f.sglang_version,
        "started": f.start_unix or None,
        "last_round": f.last_round,
        "entered_round": f.entered,
        "entered_trusted": f.entered_trusted,
        "records": len(f.records),
        "skipped": f.skipped,
        "implausible": f.implausible,
        "decode_or_idle_records": sum(1 for r in f.records.values() if r.mode in _decode_or_idle_modes()),
    }


def _first_divergence(ranks: Sequence[RankFile], labels: dict[str, int]) -> tuple[dict[str, Any] | None, list[int]]:
    """The first round where ranks decided differently, among the ranks whose rings still hold it (a smaller ring
    must not hide two other ranks' split); a rank without a record of a round it passed had no batch then (nothing
    to compare). Only rounds some file holds are visited."""
    lo = min((min(f.records) for f in ranks if f.records), default=1)
    hi = max(f.last_round for f in ranks)
    for r in sorted({r for f in ranks for r in f.records if r >= lo}):
        keys: dict[tuple[Any, ...], list[tuple[RankFile, Record, bool]]] = {}
        for f in ranks:
            rec = f.records.get(r)
            if rec is not None:
                pending = (r == f.last_round and rec.path is None) or rec.path_damaged
                keys.setdefault(rec.key(pending), []).append((f, rec, pending))
        # A path not known yet (a rank's latest round) is compared on its votes only.
        votes = {k[:2] for k in keys}
        paths = {k[2:] for k in keys if k[2] is not None}
        if len(votes) > 1 or len(paths) > 1:
            groups = sorted(keys.values(), key=lambda g: (-len(g), labels[g[0][0].path]))
            parts = [
                {"ranks": [labels[f.path] for f, _, _ in g], "pending": g[0][2], **g[0][1].as_dict()} for g in groups
            ]
            # "pending" and "votes_differ": what the decision's text needs (the command puts the text in their place)
            return {"round": r, "groups": parts, "votes_differ": len(votes) > 1}, [lo, hi]
    return None, [lo, hi]


def _judge(
    data: dict[str, Any],
    ranks: Sequence[RankFile],
    labels: dict[str, int],
    divergence: dict[str, Any] | None,
    liveness: dict[str, Any],
) -> tuple[int, str, list[dict[str, Any]]]:
    """(exit code, verdict, findings) from the fields gathered; ``data`` gets the verdict's own fields."""
    kind = data["rank_kind"].upper()
    found: list[dict[str, Any]] = []
    code, verdict = 0, "agree"
    stopped = [f for f in ranks if liveness["per_rank"][f.path]["stopped"]]
    if stopped:
        code, verdict = 1, "stopped"
        data["stopped_ranks"] = [labels[f.path] for f in stopped]
        found += [_stopped(f, kind, labels[f.path], liveness["per_rank"][f.path]) for f in stopped]
    if divergence is not None:
        code, verdict = 1, "diverge"
        found.append({"kind": "diverge", "divergence": divergence})
        data["divergence"] = divergence
    else:
        found.append(_agreement(data, ranks, labels))
        if not stopped and liveness["advancing"] is False and not liveness["all_stale"]:
            stall = _stall(data, ranks, labels, kind)
            if stall:
                code, verdict = 1, "behind" if "behind_ranks" in data else "stall_outside_vote"
                found.append(stall)
    if liveness["all_stale"]:
        found.append({"kind": "all_stale", **{k: liveness[k] for k in ("watched_s", "newest_heartbeat_age_s")}})
    if data["missing_ranks"]:
        code = 1
        found.append({"kind": "missing", "rank_kind": kind, "ranks": data["missing_ranks"], "size": data["size"]})
    mixed = _mixed_versions(ranks, labels)
    if mixed:
        data["mixed_versions"] = mixed
        code = code or 1
        verdict = "mixed_versions" if verdict == "agree" else verdict
        found.append({"kind": "mixed_versions", "mixed": mixed})
    implausible = [labels[f.path] for f in ranks if f.implausible]
    if implausible:
        found.append({"kind": "implausible", "ranks": implausible})
    if (data["refused"] or implausible) and code == 0:
        code = 2
    if data["refused"]:
        found.append({"kind": "refused", "count": len(data["refused"])})
    if verdict == "agree" and code:
        verdict = {1: "missing", 2: "unreadable"}[code]
    return code, verdict, found


def _stopped(f: RankFile, kind: str, label: int, live: dict[str, Any]) -> dict[str, Any]:
    """A stopped rank, as the answer names it: what became of its process, its last heartbeat and rounds."""
    return {
        "kind": "stopped",
        "rank_kind": kind,
        "rank": label,
        "pid": f.pid,
        "host": f.host,
        "process": live["process"],
        "since": f.heartbeat_wall or f.start_unix,
        "heartbeat": bool(f.heartbeat_wall),
        "stale_by": live["stale_by"],
        "heartbeat_behind_s": live["heartbeat_behind_s"],
        "entered": f.entered,
        "last_round": f.last_round,
    }


def _agreement(data: dict[str, Any], ranks: Sequence[RankFile], labels: dict[str, int]) -> dict[str, Any]:
    """No divergence: up to which round every rank agrees, and which ranks never entered the latest round recorded
    (the entered round, not the records: a rank that entered a round without a batch there reached it). Each file
    is written out once a second at its own moment, so a live rank's entered round is the newest the watch read."""
    last = {labels[f.path]: f.last_round for f in ranks}
    agreed, top = min(last.values()), max(last.values())
    data["agreed_up_to"] = agreed
    found: dict[str, Any] = {"kind": "agreement", "ranks": len(ranks), "agreed": agreed, "top": top}
    reached = {labels[f.path]: max(f.entered, f.entered_watched) if f.entered_trusted else f.last_round for f in ranks}
    behind = sorted(k for k, v in reached.items() if v < top)
    if behind:
        data["never_reached"] = behind
        return {**found, "never_reached": behind, "lag_s": _write_out_lag(ranks, labels, behind, top)}
    if agreed < top:
        return {**found, "entered_without_record": sorted(k for k, v in last.items() if v < top)}
    return found


def _write_out_lag(ranks: Sequence[RankFile], labels: dict[str, int], behind: list[int], top: int) -> float | None:
    """How much earlier the behind ranks' files were written out than the newest file that holds ``top`` (same host:
    one clock): within that lag the rank may have reached it. None where no such time is known."""
    newest: dict[str, float] = {}
    for f in ranks:
        if f.last_round == top and f.heartbeat_wall:
            newest[f.host] = max(newest.get(f.host, 0.0), f.heartbeat_wall)
    lags = [newest[f.host] - f.heartbeat_wall for f in ranks
            if labels[f.path] in behind and f.heartbeat_wall and f.host in newest]  # fmt: skip
    if not lags or max(lags) <= 0:
        return None
    return max(lags)


def _stall(data: dict[str, Any], ranks: Sequence[RankFile], labels: dict[str, int], kind: str) -> dict[str, Any] | None:
    """Every rank alive, no round advances: one rank many rounds behind, or a stall outside the vote. Only entered
    rounds that can be true are compared (a corrupt one is never another rank's blame)."""
    entered = {labels[f.path]: f.entered for f in ranks if f.entered_trusted}
    if not entered:
        return None
    top = max(entered.values())
    behind = sorted(k for k, v in entered.items() if top - v >= BEHIND_ROUNDS)
    if behind:
        data["behind_ranks"] = behind
        return {
            "kind": "behind",
            "rank_kind": kind,
            "ranks": behind,
            "entered": [entered[k] for k in behind],
            "top": top,
        }
    if top == 0:
        return None
    return {"kind": "stall_outside_vote", "round": top}


def _mixed_versions(ranks: Sequence[RankFile], labels: dict[str, int]) -> dict[str, dict[str, list[int]]]:
    """Plugin or SGLang versions that differ across the files: {"plugin": {version: [ranks]}, ...}; empty if one."""
    mixed: dict[str, dict[str, list[int]]] = {}
    for what, attr in (("plugin", "plugin_version"), ("sglang", "sglang_version")):
        by: dict[str, list[int]] = {}
        for f in ranks:
            by.setdefault(getattr(f, attr), []).append(labels[f.path])
        if len(by) > 1:
            mixed[what] = dict(sorted(by.items()))
    return mixed


def _liveness(ranks: Sequence[RankFile], settle_s: float) -> dict[str, Any]:
    """Heartbeats first. Watched (``settle_s`` > 0): a rank whose counter does not tick while another's does has
    stopped. Not watched: heartbeat wall times are compared only between files of one host (one clock). On this
    host and boot the process table answers at once (stopped, gone)."""
    states = {f.path: process_state(f) for f in ranks}
    known = {p for p, s in states.items() if s in ("stopped", "dead")}
    watched = settle_s > 0
    ticked, advancing, watched_s = watch(ranks, settle_s, known) if watched else (set(), False, 0.0)
    states = {f.path: process_state(f) for f in ranks}
    host_fresh: dict[str, float] = {}
    for f in ranks:
        host_fresh[f.host] = max(host_fresh.get(f.host, 0.0), f.heartbeat_wall or f.start_unix)
    quiet = watched and not ticked  # no counter moved at all: the group is down (or copies), not one rank
    per_rank: dict[str, dict[str, Any]] = {}
    for f in ranks:
        sign = f.heartbeat_wall or f.start_unix  # 0: no time that can be true: not compared
        behind_s = round(host_fresh[f.host] - sign, 1) if sign else None
        by_counter = watched and not quiet
        stale = f.path not in ticked if by_counter else (behind_s or 0) > HEARTBEAT_STALE_S
        per_rank[f.path] = {
            "heartbeat": f.heartbeat_wall or None,
            "heartbeat_ticked": (f.path in ticked) if watched else None,
            "stale_by": ("counter" if by_counter else "clock") if stale else None,
            "heartbeat_behind_s": behind_s,  # against the freshest of the same host's files
            "process": states[f.path],
            "stopped": states[f.path] in ("stopped", "dead") or stale,
        }
    here = socket.gethostname()[:64]
    local = [host_fresh[f.host] for f in ranks if f.host == here]
    newest_local = max(local, default=0.0)
    age = round(time.time() - newest_local, 1) if newest_local else None
    unwatched_stale = len(local) == len(ranks) and age is not None and age > HEARTBEAT_STALE_S
    return {
        "per_rank": per_rank,
        "advancing": advancing if watched else None,  # None: not watched, no stall judged
        "watched_s": round(watched_s, 2),
        "all_stale": quiet or (not watched and unwatched_stale),
        "newest_heartbeat_age_s": age,  # this host's files only (another host's clock is not this one)
    }


def _decode_or_idle_modes() -> frozenset[int]:
    """SGLang's DECODE and IDLE ForwardMode values (what the counters count), without importing SGLang."""
    return _MODES


# ForwardMode values (stable since 0.5.x: EXTEND=1, DECODE=2, MIXED=3, IDLE=4; checked by the tests).
_MODES = frozenset({2, 4})

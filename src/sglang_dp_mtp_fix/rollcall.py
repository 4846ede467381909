"""``sglang-dp-mtp-fix rollcall DIR [DIR ...]``: reads every rank's flight-recorder file (layout: ``recfile``; writer:
``recorder``) and names the first round where ranks decided differently."""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang_dp_mtp_fix import recfile
from sglang_dp_mtp_fix.errors import RecorderFileError
from sglang_dp_mtp_fix.recfile import (
    BOOT_ID_OFFSET,
    BOOT_ID_SIZE,
    ENTERED_OFFSET,
    FILE_GLOB,
    FORMAT_VERSION,
    GROUP_DRAFT,
    GROUP_GENERIC,
    HEADER,
    HEADER_SIZE,
    HEARTBEAT,
    HEARTBEAT_OFFSET,
    HEARTBEAT_STALE_S,
    MAGIC,
    MAX_CAPACITY,
    PATH_EAGER,
    PATH_GRAPH,
    PATH_NAMES,
    PROC_START,
    PROC_START_OFFSET,
    RECORD,
    RUNNER_GATHERS,
    SENT_DRAFT,
    SENT_GENERIC,
)

SETTLE_S = 1.5  # rollcall watches the entered rounds this long (more than a heartbeat) before judging a stall
BEHIND_ROUNDS = 2  # ranks of a group are at most one round apart while they take part in every round


@dataclass
class Record:
    round: int
    t_ns: int
    tokens: int
    mode: int
    flags: int
    path: int | None  # None: no draft path recorded for this round
    bucket: int

    def key(self, pending: bool) -> tuple[Any, ...]:
        """What makes collectives differ: the group votes, the draft path and (when the runner gathers, so the
        bucket is common by design) the bucket. ``pending``: the path is not known yet (the rank's latest round)."""
        path = None if pending else (self.path or 0) & 3
        gathers = bool((self.path or 0) & RUNNER_GATHERS)
        bucket = self.bucket if gathers and path == PATH_GRAPH else None
        return bool(self.flags & GROUP_GENERIC), bool(self.flags & GROUP_DRAFT), path, bucket

    def as_dict(self) -> dict[str, Any]:
        path = PATH_NAMES.get(None if self.path is None else self.path & 3, "?")
        return {
            "round": self.round,
            "monotonic_ns": self.t_ns,
            "tokens": self.tokens,
            "forward_mode": self.mode,
            "decode_vote_sent": bool(self.flags & SENT_GENERIC),
            "decode_vote_group": bool(self.flags & GROUP_GENERIC),
            "draft_vote_sent": bool(self.flags & SENT_DRAFT),
            "draft_vote_group": bool(self.flags & GROUP_DRAFT),
            "draft_path": path,
            "bucket": self.bucket if path == "graph" else None,
        }


@dataclass
class RankFile:
    path: str
    host: str
    pid: int
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int
    global_rank: int
    start_unix: float
    plugin_version: str
    sglang_version: str
    capacity: int
    entered: int  # the MLP-sync round this rank entered last (recorded or not)
    records: dict[int, Record] = field(default_factory=dict)
    skipped: int = 0  # slots that held no whole record of their own round (being written, or cut by a kill)
    proc_start: int = 0  # clock ticks since boot (recfile); 0 unknown
    boot_id: bytes = b""
    heartbeat_wall: float = 0.0  # unix s of the last heartbeat; 0: none yet (or torn in both reads)
    heartbeat_ticks: int = 0

    @property
    def last_round(self) -> int:
        return max(self.records, default=0)


def process_state(f: RankFile) -> str:
    """What became of the process that wrote ``f``, where this host can tell: ``running``, ``stopped`` (SIGSTOP, a
    debugger), ``dead`` (gone, a zombie, or its PID now another process's); ``unknown`` for a file from another host
    or boot (a copied directory)."""
    if f.host != socket.gethostname()[:64] or not f.proc_start or f.boot_id != recfile.boot_id():
        return "unknown"
    if recfile.proc_start_ticks(f.pid) != f.proc_start:
        return "dead"
    state = recfile.proc_state(f.pid)
    if state is None or state in ("Z", "X", "x"):
        return "dead"
    return "stopped" if state in ("T", "t") else "running"


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def read_file(path: str) -> RankFile:
    """One rank's file; raises RecorderFileError with the reason. Never follows a link, never blocks on a FIFO."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise RecorderFileError(f"cannot read: {exc.strerror}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise RecorderFileError("not a regular file (a link, a FIFO or a device is never opened)")
    if st.st_size < HEADER_SIZE:
        raise RecorderFileError(f"truncated: {st.st_size} bytes, the header alone is {HEADER_SIZE}")
    limit = HEADER_SIZE + MAX_CAPACITY * RECORD.size
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            first = os.pread(fd, limit + 1, 0)
            second = os.pread(fd, limit + 1, 0)  # a record the writer changed in between is skipped
        finally:
            os.close(fd)
    except OSError as exc:
        raise RecorderFileError(f"cannot read: {exc.strerror}") from exc
    if len(first) < HEADER_SIZE:
        raise RecorderFileError(f"truncated: {len(first)} bytes, the header alone is {HEADER_SIZE}")
    h = HEADER.unpack_from(first, 0)
    magic, version, header_size, record_size, capacity = h[:5]
    if magic != MAGIC:
        if magic == b"\0" * 8 and first[8:12] != b"\0" * 4:
            raise RecorderFileError("header incomplete (the process stopped while it created the file)")
        raise RecorderFileError(f"not a flight-recorder file (starts with {magic!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION or header_size != HEADER_SIZE or record_size != RECORD.size:
        raise RecorderFileError(
            f"format {version} (header {header_size} B, records {record_size} B): this rollcall reads format "
            f"{FORMAT_VERSION} ({HEADER_SIZE} B, {RECORD.size} B); use the plugin version that wrote it"
        )
    if not 1 <= capacity <= MAX_CAPACITY:
        raise RecorderFileError(f"corrupt header: capacity {capacity}")
    want = HEADER_SIZE + capacity * RECORD.size
    if len(first) != want or len(second) != want:
        raise RecorderFileError(f"truncated or padded: {len(first)} bytes, the header promises {want}")
    dp_rank, dp_size, tp_rank, tp_size, global_rank, pid, start_unix, _, plugin_v, sglang_v, host = h[5:]
    if not (0 < dp_size <= tp_size <= MAX_CAPACITY and tp_size % dp_size == 0 and 0 <= tp_rank < tp_size):
        raise RecorderFileError(f"corrupt header: dp rank {dp_rank} of {dp_size}, tp rank {tp_rank} of {tp_size}")
    (entered,) = struct.unpack_from("<Q", first, ENTERED_OFFSET)
    rank = RankFile(
        path, _text(host), pid, dp_rank, dp_size, tp_rank, tp_size, global_rank, start_unix, _text(plugin_v),
        _text(sglang_v), capacity, entered,
    )  # fmt: skip
    rank.proc_start = PROC_START.unpack_from(second, PROC_START_OFFSET)[0]
    rank.boot_id = second[BOOT_ID_OFFSET : BOOT_ID_OFFSET + BOOT_ID_SIZE]
    for raw in (second, first):  # the later read first; a torn write has two different tick copies
        ticks, wall, _mono, ticks_again = HEARTBEAT.unpack_from(raw, HEARTBEAT_OFFSET)
        if ticks == ticks_again:
            rank.heartbeat_wall, rank.heartbeat_ticks = (wall, ticks) if ticks else (0.0, 0)
            break
    for slot in range(capacity):
        off = HEADER_SIZE + slot * RECORD.size
        raw = first[off : off + RECORD.size]
        if raw != second[off : off + RECORD.size]:
            rank.skipped += 1
            continue
        begin, t_ns, tokens, mode, flags, end, bucket, code, stamp = RECORD.unpack(raw)
        if begin == end == 0:
            if raw != bytes(RECORD.size):
                rank.skipped += 1
            continue  # never written
        if begin != end or flags > 15 or (code & 3) == 3 or code > 7:
            rank.skipped += 1  # cut while being written (or not a record)
            continue
        old = rank.records.get(end)
        if old is not None and old.t_ns > t_ns:
            continue  # two records of one round (nothing gathered in between): the later one holds
        rank.records[end] = Record(end, t_ns, tokens, mode, flags, code if stamp == end else None, bucket)
    return rank


def _describe(rec: Record, pending: bool, show_votes: bool) -> str:
    generic, draft, path, bucket = rec.key(pending)
    if path is None:
        text = "draft step not reached yet"
    elif path == PATH_GRAPH:
        text = f"draft graph (bucket {rec.bucket})" if rec.bucket >= 0 else "draft graph"
    elif path == PATH_EAGER:
        if not draft:
            cause = "own seedless batch" if not rec.flags & SENT_DRAFT else "another rank's vote"
        else:
            cause = "after a graph vote: decided outside the vote"
        text = f"eager ({cause})"
    else:
        text = "no draft step"
    if show_votes:
        text += f"; decode vote {'graph' if generic else 'eager'}, draft vote {'graph' if draft else 'eager'}"
    return text


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"{'ranks' if len(ranks) > 1 else 'rank'} {list(ranks)}"


def files_in(target: str, refused: list[dict[str, str]] | None = None, notes: list[str] | None = None) -> list[str]:
    """The recorder files named by ``target`` (a file, or a directory's ``sglang-dp-mtp-fix-*.rec``)."""
    refused = [] if refused is None else refused
    notes = [] if notes is None else notes
    try:
        st = os.stat(target)
    except OSError as exc:
        refused.append({"file": target, "reason": f"cannot read: {exc.strerror}"})
        return []
    if not stat.S_ISDIR(st.st_mode):
        return [target]
    try:
        names = sorted(n for n in os.listdir(target) if FILE_GLOB.match(n))
    except OSError as exc:
        refused.append({"file": target, "reason": f"cannot list the directory: {exc.strerror}"})
        return []
    if not names:
        notes.append(f"{target}: no flight-recorder files (sglang-dp-mtp-fix-*.rec)")
    return [os.path.join(target, n) for n in names]


def rollcall(targets: Sequence[str], settle_s: float = SETTLE_S) -> tuple[dict[str, Any], int]:
    """Read every rank's file: first the heartbeats (which ranks stopped: frozen or dead), then the decisions (the
    first round where ranks decided differently), then, when no round advances, whether the group stalls outside
    the vote or a rank is many rounds behind. (data, exit code): 0 all agree and nothing stopped, 1 a divergence, a
    stopped rank, a stall or a rank without a file, 2 unreadable or incompatible files (nothing to compare).
    ``settle_s``: how long to watch the entered rounds for progress (0: not watched, no stall judged)."""
    refused: list[dict[str, str]] = []
    notes: list[str] = []
    files: list[RankFile] = []
    for target in targets:
        for path in files_in(target, refused, notes):
            try:
                files.append(read_file(path))
            except RecorderFileError as exc:
                refused.append({"file": path, "reason": str(exc)})
    data: dict[str, Any] = {"refused": refused, "notes": notes, "ranks": [], "missing_ranks": [], "superseded": []}
    if not files:
        data["verdict"] = "unreadable"
        data["answer"] = "no readable flight-recorder file" + (" (see refused)" if refused else "")
        return data, 2
    # One file per scheduler: a restarted server leaves its earlier files; the newest one per rank is read.
    newest: dict[int, RankFile] = {}
    for f in sorted(files, key=lambda f: f.start_unix):
        if f.tp_rank in newest:
            data["superseded"].append(newest[f.tp_rank].path)
        newest[f.tp_rank] = f
    shapes = sorted({(f.dp_size, f.tp_size) for f in newest.values()})
    if len(shapes) > 1:
        data["verdict"] = "incompatible"
        data["answer"] = "files from different deployments (dp size, tp size): " + ", ".join(map(str, shapes))
        return data, 2
    dp_size, tp_size = shapes[0]
    by_dp = tp_size == dp_size  # one scheduler per DP rank: name DP ranks; else the MLP-sync group's (tp) ranks

    def label(f: RankFile) -> int:
        return f.dp_rank if by_dp else f.tp_rank

    ranks = sorted(newest.values(), key=label)
    data["rank_kind"] = "dp" if by_dp else "tp"
    data["size"] = tp_size
    data["missing_ranks"] = sorted(set(range(tp_size)) - {f.tp_rank for f in ranks})
    for f in ranks:
        data["ranks"].append(
            {
                "rank": label(f),
                "dp_rank": f.dp_rank,
                "tp_rank": f.tp_rank,
                "global_rank": f.global_rank,
                "file": f.path,
                "host": f.host,
                "pid": f.pid,
                "plugin_version": f.plugin_version,
                "sglang_version": f.sglang_version,
                "started": f.start_unix,
                "last_round": f.last_round,
                "entered_round": f.entered,
                "records": len(f.records),
                "skipped": f.skipped,
                "decode_or_idle_records": sum(1 for r in f.records.values() if r.mode in _decode_or_idle_modes()),
            }
        )
    # Compare round by round where every ring still holds data; a rank without a record of a round it passed had no
    # batch then (nothing to compare), a rank whose last round is earlier never reached it.
    lo = max((min(f.records) for f in ranks if f.records), default=1)
    hi = max(f.last_round for f in ranks)
    divergence: dict[str, Any] | None = None
    for r in range(lo, hi + 1):
        present = [(f, f.records[r]) for f in ranks if r in f.records]
        keys: dict[tuple[Any, ...], list[tuple[RankFile, Record, bool]]] = {}
        for f, rec in present:
            pending = r == f.last_round and rec.path is None
            keys.setdefault(rec.key(pending), []).append((f, rec, pending))
        # A path not known yet (a rank's latest round) is compared on its votes only.
        votes = {k[:2] for k in keys}
        paths = {k[2:] for k in keys if k[2] is not None}
        if len(votes) > 1 or len(paths) > 1:
            groups = sorted(keys.values(), key=lambda g: (-len(g), label(g[0][0])))
            show_votes = len(votes) > 1
            parts = []
            for g in groups:
                text = _describe(g[0][1], g[0][2], show_votes)
                parts.append({"ranks": [label(f) for f, _, _ in g], "decision": text, **g[0][1].as_dict()})
            divergence = {"round": r, "groups": parts}
            break
    data["compared"] = [lo, hi]
    answers: list[str] = []
    code = 0
    verdict = "agree"
    liveness = _liveness(ranks, settle_s)
    for f, entry in zip(ranks, data["ranks"], strict=True):
        entry.update(liveness["per_rank"][f.path])
    data["liveness"] = {k: v for k, v in liveness.items() if k != "per_rank"}
    stopped = [(f, liveness["per_rank"][f.path]) for f in ranks if liveness["per_rank"][f.path]["stopped"]]
    kind = "DP" if by_dp else "TP"
    if stopped:
        code, verdict = 1, "stopped"
        data["stopped_ranks"] = [label(f) for f, _ in stopped]
        for f, live in stopped:
            answers.append(f"{kind} rank {label(f)} stopped: {_stopped_text(f, live)}")
    if divergence is not None:
        code = 1
        groups_found: list[dict[str, Any]] = divergence["groups"]
        text = ", ".join(f"{_ranks_text(p['ranks'])} {p['decision']}" for p in groups_found)
        answers.append(f"round {divergence['round']}: {text}")
        data["divergence"] = divergence
        verdict = "diverge"
    else:
        last = {label(f): f.last_round for f in ranks}
        agreed = min(last.values())
        behind = sorted(k for k, v in last.items() if v == agreed)
        data["agreed_up_to"] = agreed
        if len(behind) < len(last):
            data["never_reached"] = behind
            answers.append(
                f"all {len(ranks)} ranks agreed up to round {agreed}; {_ranks_text(behind)} never reached round "
                f"{agreed + 1}"
            )
        elif agreed == 0:
            answers.append(f"no round recorded yet on any of the {len(ranks)} ranks with a file")
        else:
            answers.append(f"all {len(ranks)} ranks agreed up to round {agreed}, the last round of every rank")
        if not stopped and liveness["advancing"] is False and not liveness["all_stale"]:
            entered = {label(f): f.entered for f in ranks}
            top = max(entered.values())
            behind_ranks = sorted(k for k, v in entered.items() if top - v >= BEHIND_ROUNDS)
            if behind_ranks:
                code, verdict = 1, "behind"
                data["behind_ranks"] = behind_ranks
                answers.append(
                    f"no round advances and {kind} {_ranks_text(behind_ranks)} "
                    f"{'are' if len(behind_ranks) > 1 else 'is'} many rounds behind (entered "
                    f"{', '.join(str(entered[k]) for k in behind_ranks)}; the others up to {top}): that rank stopped "
                    "taking part in MLP-sync rounds while the others went on (a sync it skipped, or a collective "
                    "outside the sync that only the others issue)"
                )
            elif top > 0:
                code, verdict = 1, "stall_outside_vote"
                answers.append(
                    f"every rank alive (heartbeats ticking), none advances, all in round {top} with the same "
                    "decisions: a stall outside the vote. Check where the ranks wait (py-spy dump --pid <pid> "
                    "--native), e.g. a lazily loaded kernel on the first target-verify or draft step (sglang#33642: "
                    "every scheduler in cuModuleLoadData; start with CUDA_MODULE_LOADING=EAGER), a collective outside "
                    "the MLP sync, or a stuck device"
                )
    if liveness["all_stale"]:
        answers.append(
            f"every heartbeat stopped (the newest {liveness['newest_heartbeat_age_s']:.0f} s ago): the server is "
            "down, or these are copies (read the files on their own nodes to tell frozen from dead)"
        )
    if data["missing_ranks"]:
        code = 1
        kind = "DP " if by_dp else "TP "
        answers.append(
            f"{kind}{_ranks_text(data['missing_ranks'])} of {tp_size} no file: the plugin or its recorder is not "
            "active there (SGLANG_DP_MTP_FIX=off, not installed, the variable unset), or that node's directory was "
            "not copied here"
        )
    if refused and code == 0:
        code = 2
        answers.append(f"{len(refused)} file(s) refused (see above): the answer may be incomplete")
    if verdict == "agree" and code:
        verdict = {1: "missing", 2: "unreadable"}[code]
    data["verdict"] = verdict
    data["answer"] = "; ".join(answers)
    return data, code


def _liveness(ranks: Sequence[RankFile], settle_s: float) -> dict[str, Any]:
    """Heartbeats first: each rank's heartbeat age against the group's freshest, what became of its process (where
    this host can tell), and whether any rank's entered round advances over ``settle_s``."""
    now = time.time()
    last_sign = {f.path: f.heartbeat_wall or f.start_unix for f in ranks}
    freshest = max(last_sign.values())
    advancing: bool | None = None  # None: not watched (settle_s 0): no stall judged
    if settle_s > 0:
        advancing = False
        time.sleep(settle_s)
        for f in ranks:
            try:
                again = read_file(f.path)
            except RecorderFileError:
                continue
            advancing |= again.entered != f.entered
            if again.heartbeat_wall > f.heartbeat_wall:
                f.heartbeat_wall, f.heartbeat_ticks = again.heartbeat_wall, again.heartbeat_ticks
                last_sign[f.path] = again.heartbeat_wall
        freshest = max(last_sign.values())
    per_rank: dict[str, dict[str, Any]] = {}
    for f in ranks:
        state = process_state(f)
        behind_s = freshest - last_sign[f.path]
        stale = behind_s > HEARTBEAT_STALE_S
        per_rank[f.path] = {
            "heartbeat": f.heartbeat_wall or None,
            "heartbeat_behind_s": round(behind_s, 1),
            "process": state,
            "stopped": state in ("stopped", "dead") or stale,
        }
    return {
        "per_rank": per_rank,
        "advancing": advancing,
        "all_stale": now - freshest > HEARTBEAT_STALE_S + settle_s,
        "newest_heartbeat_age_s": round(now - freshest, 1),
    }


def _stopped_text(f: RankFile, live: dict[str, Any]) -> str:
    since = f.heartbeat_wall or f.start_unix
    when = time.strftime("%H:%M:%S", time.gmtime(since)) + " UTC"
    what = {
        "stopped": f"frozen (pid {f.pid} is stopped: SIGSTOP or a debugger)",
        "dead": f"dead (pid {f.pid} is gone)",
        "running": f"frozen (pid {f.pid} runs, but its heartbeat thread stopped)",
        "unknown": "its heartbeat stopped (another host or boot: whether frozen or dead is told on its node)",
    }[live["process"]]
    beat = "heartbeat" if f.heartbeat_wall else "no heartbeat since the file opened at"
    return (
        f"{what}; {beat} {when}, {live['heartbeat_behind_s']:.0f} s before the freshest; last entered round "
        f"{f.entered}, last recorded {f.last_round} (host {f.host})"
    )


def _decode_or_idle_modes() -> frozenset[int]:
    """SGLang's DECODE and IDLE ForwardMode values (what the counters count), without importing SGLang."""
    return _MODES


# ForwardMode values (stable since 0.5.x: EXTEND=1, DECODE=2, MIXED=3, IDLE=4; checked by the tests).
_MODES = frozenset({2, 4})


def print_rollcall(data: dict[str, Any]) -> None:
    kind = "DP" if data.get("rank_kind", "dp") == "dp" else "TP"
    if data.get("size"):
        print(f"sglang-dp-mtp-fix rollcall: {len(data['ranks'])} of {data['size']} {kind} ranks have a file")
    for r in data["ranks"]:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["started"]))
        skipped = f", {r['skipped']} half-written" if r["skipped"] else ""
        print(
            f"  {kind} rank {r['rank']}: last round {r['last_round']} ({r['records']} rounds kept{skipped}, "
            f"last entered {r['entered_round']}); "
            f"host {r['host']} pid {r['pid']}, started {started} UTC, plugin {r['plugin_version']} on SGLang "
            f"{r['sglang_version']}"
        )
    for m in data["missing_ranks"]:
        print(f"  {kind} rank {m}: NO FILE")
    for path in data["superseded"]:
        print(f"  ignored (an older file of the same rank): {path}")
    for ref in data["refused"]:
        print(f"  refused {ref['file']}: {ref['reason']}")
    for note in data["notes"]:
        print(f"  {note}")
    print(data["answer"])


def rollcall_json(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2)

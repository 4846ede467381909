"""``sglang-dp-mtp-fix rollcall DIR [DIR ...]``: reads every rank's flight-recorder file (layout: ``recfile``; writer:
``recorder``) and names the first round where ranks decided differently."""

from __future__ import annotations

import json
import os
import stat
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang_dp_mtp_fix.errors import RecorderFileError
from sglang_dp_mtp_fix.recfile import (
    ENTERED_OFFSET,
    FILE_GLOB,
    FORMAT_VERSION,
    GROUP_DRAFT,
    GROUP_GENERIC,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_CAPACITY,
    PATH_EAGER,
    PATH_GRAPH,
    PATH_NAMES,
    RECORD,
    RUNNER_GATHERS,
    SENT_DRAFT,
    SENT_GENERIC,
)


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

    @property
    def last_round(self) -> int:
        return max(self.records, default=0)


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


def _files_in(target: str, refused: list[dict[str, str]], notes: list[str]) -> list[str]:
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


def rollcall(targets: Sequence[str]) -> tuple[dict[str, Any], int]:
    """Read every rank's file and name the first round where ranks decided differently. (data, exit code):
    0 all agree, 1 a divergence or a rank without a file, 2 unreadable or incompatible files (nothing to compare)."""
    refused: list[dict[str, str]] = []
    notes: list[str] = []
    files: list[RankFile] = []
    for target in targets:
        for path in _files_in(target, refused, notes):
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
    if divergence is not None:
        code = 1
        groups_found: list[dict[str, Any]] = divergence["groups"]
        text = ", ".join(f"{_ranks_text(p['ranks'])} {p['decision']}" for p in groups_found)
        answers.append(f"round {divergence['round']}: {text}")
        data["divergence"] = divergence
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
    data["verdict"] = {0: "agree", 1: "diverge", 2: "unreadable"}[code]
    data["answer"] = "; ".join(answers)
    return data, code


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

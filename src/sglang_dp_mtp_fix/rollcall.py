"""``sglang-dp-mtp-fix rollcall DIR [DIR ...]``: reads every rank's flight-recorder file (layout: ``recfile``; writer:
``recorder``) and names the first round where ranks decided differently."""

from __future__ import annotations

import json
import math
import os
import socket
import stat
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang_dp_mtp_fix.diagnosis import recfile
from sglang_dp_mtp_fix.diagnosis.recfile import (
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
from sglang_dp_mtp_fix.errors import RecorderFileError

SETTLE_S = 1.5  # rollcall watches the entered rounds this long (more than a heartbeat) before judging a stall
MAX_SETTLE_S = 600.0  # --settle's upper bound: a watch, not a wait for ever
POLL_S = 0.25  # how often the watch re-reads the headers
BEHIND_ROUNDS = 2  # ranks of a group are at most one round apart while they take part in every round
# What a file's own fields can be. A round is a collective across processes: none takes under a microsecond, so a
# file's rounds are bounded by its own monotonic clock (the heartbeat's, same host, same clock as the header's start),
# with ROUND_SLACK for the rounds since the last heartbeat (10 s at that rate), and never above MAX_ROUND.
MIN_ROUND_NS = 1_000
ROUND_SLACK = 10_000_000
MAX_ROUND = 1 << 53
EARLIEST_UNIX, LATEST_UNIX = 946_684_800.0, 32_503_680_000.0  # 2000-01-01 to 3000-01-01 UTC
MAX_PID = 1 << 22  # the kernel's PID_MAX_LIMIT on 64-bit


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
    start_unix: float  # 0.0: not a time (named in ``implausible``)
    plugin_version: str
    sglang_version: str
    capacity: int
    entered: int  # the MLP-sync round this rank entered last (recorded or not), as the file says
    records: dict[int, Record] = field(default_factory=dict)
    skipped: int = 0  # slots that held no whole record of their own round (being written, or cut by a kill)
    proc_start: int = 0  # clock ticks since boot (recfile); 0 unknown
    boot_id: bytes = b""
    heartbeat_wall: float = 0.0  # unix s of the last heartbeat; 0: none yet, torn in both reads, or not a time
    heartbeat_ticks: int = 0
    start_mono: int = 0  # monotonic ns at open (the writer's host clock)
    heartbeat_mono: int = 0
    entered_trusted: bool = True  # False: ``entered`` cannot be true (named in ``implausible``)
    entered_watched: int = 0  # the newest entered round the watch read: a live rank's later write-outs
    last_round: int = 0  # the latest round recorded (of the records kept)
    implausible: list[dict[str, Any]] = field(default_factory=list)  # fields that cannot be true: named, not used
    file_id: tuple[int, int] = (0, 0)  # (device, inode): one file named twice is read once


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


def _unix_time(value: float) -> bool:
    return math.isfinite(value) and EARLIEST_UNIX <= value <= LATEST_UNIX


def _read_twice(path: str) -> tuple[bytes, bytes, os.stat_result]:
    """The file's bytes, read twice (a record the writer changed in between is skipped). Never follows a link, never
    blocks on a FIFO, never reads more than the largest file the format allows."""
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
            second = os.pread(fd, limit + 1, 0)
        finally:
            os.close(fd)
    except OSError as exc:
        raise RecorderFileError(f"cannot read: {exc.strerror}") from exc
    return first, second, st


def read_file(path: str) -> RankFile:
    """One rank's file; raises RecorderFileError with the reason. A header field that cannot be true refuses the file;
    a round or time that cannot be true is named in ``implausible`` and not used."""
    first, second, st = _read_twice(path)
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
    dp_rank, dp_size, tp_rank, tp_size, global_rank, pid, start_unix, start_mono, plugin_v, sglang_v, host = h[5:]
    _check_ranks(dp_rank, dp_size, tp_rank, tp_size, pid)
    # The later read's entered round: every record of the first read was written before it (rounds only grow).
    (entered,) = struct.unpack_from("<Q", second, ENTERED_OFFSET)
    rank = RankFile(
        path, _text(host), pid, dp_rank, dp_size, tp_rank, tp_size, global_rank, start_unix, _text(plugin_v),
        _text(sglang_v), capacity, entered, start_mono=start_mono, file_id=(st.st_dev, st.st_ino),
    )  # fmt: skip
    rank.proc_start = PROC_START.unpack_from(second, PROC_START_OFFSET)[0]
    rank.boot_id = second[BOOT_ID_OFFSET : BOOT_ID_OFFSET + BOOT_ID_SIZE]
    for raw in (second, first):  # the later read first; a torn write has two different tick copies
        ticks, wall, mono, ticks_again = HEARTBEAT.unpack_from(raw, HEARTBEAT_OFFSET)
        if ticks == ticks_again:
            if ticks:
                rank.heartbeat_wall, rank.heartbeat_ticks, rank.heartbeat_mono = wall, ticks, mono
            break
    _check_times(rank)
    _read_records(rank, first, second)
    return rank


def _check_ranks(dp_rank: int, dp_size: int, tp_rank: int, tp_size: int, pid: int) -> None:
    """The header's identity, which every verdict is about: refused where it cannot be true."""
    if not (0 < dp_size <= tp_size <= MAX_CAPACITY and tp_size % dp_size == 0 and 0 <= tp_rank < tp_size):
        raise RecorderFileError(f"corrupt header: dp rank {dp_rank} of {dp_size}, tp rank {tp_rank} of {tp_size}")
    if dp_rank != tp_rank // (tp_size // dp_size):
        raise RecorderFileError(
            f"corrupt header: dp rank {dp_rank} is not tp rank {tp_rank}'s (of {tp_size}, dp size {dp_size}: "
            f"{tp_rank // (tp_size // dp_size)})"
        )
    if not 0 < pid <= MAX_PID:
        raise RecorderFileError(f"corrupt header: pid {pid}")


def _name(f: RankFile, name: str, value: Any, reason: str) -> None:
    f.implausible.append({"field": name, "value": value if isinstance(value, int) else repr(value), "reason": reason})


def _check_times(f: RankFile) -> None:
    if not _unix_time(f.start_unix):
        _name(f, "start_unix", f.start_unix, "not a time")
        f.start_unix = 0.0
    if f.heartbeat_ticks and not _unix_time(f.heartbeat_wall):
        _name(f, "heartbeat_wall", f.heartbeat_wall, "not a time")
        f.heartbeat_wall = 0.0
    if f.heartbeat_ticks and f.heartbeat_mono < f.start_mono:
        _name(f, "heartbeat_monotonic_ns", f.heartbeat_mono, "before the file was opened")
        f.heartbeat_mono = 0


def _round_bound(f: RankFile) -> int:
    """The most rounds this file can have entered, by its own monotonic clock (module constants)."""
    elapsed_ns = f.heartbeat_mono - f.start_mono if f.heartbeat_mono else 0
    return min(MAX_ROUND, max(elapsed_ns, 0) // MIN_ROUND_NS + ROUND_SLACK)


def _read_records(f: RankFile, first: bytes, second: bytes) -> None:
    """The ring's whole records (identical in both reads). A round above the entered round (or, where the entered
    round cannot be true, above the file's own clock's bound) is named and dropped: it never becomes another rank's
    blame. At most ``capacity`` records: the reader's work is bounded by the file, whatever the rounds say."""
    bound = _round_bound(f)
    if f.entered > bound:
        _name(f, "entered_round", f.entered, f"more rounds than the file's own clock allows (at most {bound})")
        f.entered_trusted = False
    top = f.entered if f.entered_trusted else bound
    beyond: list[int] = []
    same = first == second
    for slot in range(f.capacity):
        off = HEADER_SIZE + slot * RECORD.size
        raw = first[off : off + RECORD.size]
        if not same and raw != second[off : off + RECORD.size]:
            f.skipped += 1
            continue
        begin, t_ns, tokens, mode, flags, end, bucket, code, stamp = RECORD.unpack(raw)
        if begin == end == 0:
            if raw != bytes(RECORD.size):
                f.skipped += 1
            continue  # never written
        if begin != end or flags > 15 or (code & 3) == 3 or code > 7:
            f.skipped += 1  # cut while being written (or not a record)
            continue
        if end > top or t_ns < 0:
            beyond.append(end)
            continue
        old = f.records.get(end)
        if old is not None and old.t_ns > t_ns:
            continue  # two records of one round (nothing gathered in between): the later one holds
        f.records[end] = Record(end, t_ns, tokens, mode, flags, code if stamp == end else None, bucket)
    if beyond:
        what = f"the entered round {f.entered}" if f.entered_trusted else f"the file's own clock's bound {bound}"
        _name(f, "record_round", max(beyond), f"{len(beyond)} record(s) of a round beyond {what}, or before boot")
    f.last_round = max(f.records, default=0)


def _peek(path: str) -> tuple[int, float, int] | None:
    """The header's heartbeat (ticks, wall) and entered round, read once (the watch); None where unreadable or torn."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            raw = os.pread(fd, HEADER_SIZE, 0)
        finally:
            os.close(fd)
    except OSError:
        return None
    if len(raw) < HEADER_SIZE or raw[:8] != MAGIC:
        return None
    ticks, wall, _mono, ticks_again = HEARTBEAT.unpack_from(raw, HEARTBEAT_OFFSET)
    if ticks != ticks_again:
        return None
    return ticks, wall if _unix_time(wall) else 0.0, struct.unpack_from("<Q", raw, ENTERED_OFFSET)[0]


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


def _read_all(targets: Sequence[str]) -> tuple[list[RankFile], list[dict[str, str]], list[str]]:
    """Every readable file of ``targets`` once (one file named twice, through two names or a link to its directory,
    is one file), with the refused ones and the notes."""
    refused: list[dict[str, str]] = []
    notes: list[str] = []
    files: list[RankFile] = []
    seen: dict[tuple[int, int], str] = {}
    for target in targets:
        for path in files_in(target, refused, notes):
            try:
                f = read_file(path)
            except RecorderFileError as exc:
                refused.append({"file": path, "reason": str(exc)})
                continue
            if f.file_id in seen:
                notes.append(f"{path}: the same file as {seen[f.file_id]} (read once)")
                continue
            seen[f.file_id] = path
            files.append(f)
    return files, refused, notes


def rollcall(targets: Sequence[str], settle_s: float = SETTLE_S) -> tuple[dict[str, Any], int]:
    """Read every rank's file: first the heartbeats (which ranks stopped: frozen or dead), then the decisions (the
    first round where ranks decided differently), then, when no round advances, whether the group stalls outside
    the vote or a rank is many rounds behind. (data, exit code): 0 all agree and nothing stopped, 1 a divergence, a
    stopped rank, a stall, mixed versions or a rank without a file, 2 unreadable or incompatible files, or fields
    that cannot be true (nothing else found). ``settle_s``: how long to watch the heartbeats and the entered rounds
    (0: not watched, no stall judged, e.g. for copied files). Bounded by the records the files hold."""
    files, refused, notes = _read_all(targets)
    data: dict[str, Any] = {"refused": refused, "notes": notes, "ranks": [], "missing_ranks": [], "superseded": []}
    if not files:
        data["verdict"] = "unreadable"
        data["answer"] = "no readable flight-recorder file" + (" (see refused)" if refused else "")
        return data, 2
    newest = _one_file_per_rank(files, data)
    if newest is None:
        return data, 2
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
    code, verdict, answers = _judge(data, ranks, labels, divergence, liveness)
    data["verdict"] = verdict
    data["answer"] = "; ".join(answers)
    return data, code


_ALIVE = {"running": 2, "stopped": 2, "unknown": 1, "dead": 0}


def _liveliest(f: RankFile) -> tuple[Any, ...]:
    """How a file ranks among its rank's files (a restarted server, a copy or a move leaves others): the process
    that runs (or is stopped) first, then the newer heartbeat, the further progress, the later start, the name."""
    return _ALIVE[process_state(f)], f.heartbeat_wall, f.entered, f.start_unix, f.path


def _one_file_per_rank(files: Sequence[RankFile], data: dict[str, Any]) -> dict[int, RankFile] | None:
    """Each rank's liveliest file, of the deployment (dp size, tp size) whose file is liveliest; the others are
    ``superseded``. None (``data`` says why) when two deployments' processes both run: files of two groups."""
    best = max(files, key=_liveliest)
    shape = (best.dp_size, best.tp_size)
    others = [f for f in files if (f.dp_size, f.tp_size) != shape]
    if others and _ALIVE[process_state(best)] == 2 and any(_ALIVE[process_state(f)] == 2 for f in others):
        shapes = sorted({(f.dp_size, f.tp_size) for f in files})
        data["verdict"] = "incompatible"
        data["answer"] = "files from different deployments (dp size, tp size): " + ", ".join(map(str, shapes))
        return None
    if others:
        data["notes"].append(f"{len(others)} file(s) of another deployment (dp size, tp size not {shape}) ignored: "
                             "the newest files are this one's")  # fmt: skip
    newest: dict[int, RankFile] = {}
    for f in sorted((f for f in files if (f.dp_size, f.tp_size) == shape), key=_liveliest):
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
                pending = r == f.last_round and rec.path is None
                keys.setdefault(rec.key(pending), []).append((f, rec, pending))
        # A path not known yet (a rank's latest round) is compared on its votes only.
        votes = {k[:2] for k in keys}
        paths = {k[2:] for k in keys if k[2] is not None}
        if len(votes) > 1 or len(paths) > 1:
            groups = sorted(keys.values(), key=lambda g: (-len(g), labels[g[0][0].path]))
            parts = []
            for g in groups:
                text = _describe(g[0][1], g[0][2], len(votes) > 1)
                parts.append({"ranks": [labels[f.path] for f, _, _ in g], "decision": text, **g[0][1].as_dict()})
            return {"round": r, "groups": parts}, [lo, hi]
    return None, [lo, hi]


def _judge(
    data: dict[str, Any],
    ranks: Sequence[RankFile],
    labels: dict[str, int],
    divergence: dict[str, Any] | None,
    liveness: dict[str, Any],
) -> tuple[int, str, list[str]]:
    """(exit code, verdict, answers) from the fields gathered; ``data`` gets the verdict's own fields."""
    kind = data["rank_kind"].upper()
    answers: list[str] = []
    code, verdict = 0, "agree"
    stopped = [f for f in ranks if liveness["per_rank"][f.path]["stopped"]]
    if stopped:
        code, verdict = 1, "stopped"
        data["stopped_ranks"] = [labels[f.path] for f in stopped]
        for f in stopped:
            answers.append(f"{kind} rank {labels[f.path]} stopped: {_stopped_text(f, liveness['per_rank'][f.path])}")
    if divergence is not None:
        code, verdict = 1, "diverge"
        text = ", ".join(f"{_ranks_text(p['ranks'])} {p['decision']}" for p in divergence["groups"])
        answers.append(f"round {divergence['round']}: {text}")
        data["divergence"] = divergence
    else:
        answers.append(_agreement(data, ranks, labels))
        if not stopped and liveness["advancing"] is False and not liveness["all_stale"]:
            stall = _stall(data, ranks, labels, kind)
            if stall:
                code, verdict = 1, "behind" if "behind_ranks" in data else "stall_outside_vote"
                answers.append(stall)
    if liveness["all_stale"]:
        answers.append(_all_stale_text(liveness))
    if data["missing_ranks"]:
        code = 1
        answers.append(
            f"{kind} {_ranks_text(data['missing_ranks'])} of {data['size']} no file: the plugin or its recorder is not "
            "active there (SGLANG_DP_MTP_FIX=off, not installed, the variable unset), or that node's directory was "
            "not copied here"
        )
    mixed = _mixed_versions(ranks, labels)
    if mixed:
        data["mixed_versions"] = mixed
        code = code or 1
        verdict = "mixed_versions" if verdict == "agree" else verdict
        answers.append(_mixed_text(mixed))
    implausible = [labels[f.path] for f in ranks if f.implausible]
    if implausible:
        answers.append(
            f"{_ranks_text(implausible)}: fields that cannot be true (see implausible), not used: the answer may be "
            "incomplete"
        )
    if (data["refused"] or implausible) and code == 0:
        code = 2
    if data["refused"]:
        answers.append(f"{len(data['refused'])} file(s) refused (see above): the answer may be incomplete")
    if verdict == "agree" and code:
        verdict = {1: "missing", 2: "unreadable"}[code]
    return code, verdict, answers


def _agreement(data: dict[str, Any], ranks: Sequence[RankFile], labels: dict[str, int]) -> str:
    """No divergence: up to which round every rank agrees, and which ranks never entered the latest round recorded
    (the entered round, not the records: a rank that entered a round without a batch there reached it). Each file
    is written out once a second at its own moment, so a live rank's entered round is the newest the watch read."""
    last = {labels[f.path]: f.last_round for f in ranks}
    agreed, top = min(last.values()), max(last.values())
    data["agreed_up_to"] = agreed
    reached = {labels[f.path]: max(f.entered, f.entered_watched) if f.entered_trusted else f.last_round for f in ranks}
    behind = sorted(k for k, v in reached.items() if v < top)
    if behind:
        data["never_reached"] = behind
        text = f"all {len(ranks)} ranks agreed up to round {agreed}; {_ranks_text(behind)} never reached round {top}"
        return text + _write_out_lag(ranks, labels, behind, top)
    if agreed == 0:
        return f"no round recorded yet on any of the {len(ranks)} ranks with a file"
    if agreed < top:
        short = sorted(k for k, v in last.items() if v < top)
        return (
            f"all {len(ranks)} ranks agreed up to round {agreed}; {_ranks_text(short)} entered round {top} without a "
            "record of it (no batch there, or still inside it)"
        )
    return f"all {len(ranks)} ranks agreed up to round {agreed}, the last round of every rank"


def _write_out_lag(ranks: Sequence[RankFile], labels: dict[str, int], behind: list[int], top: int) -> str:
    """How much earlier the behind ranks' files were written out than the newest file that holds ``top`` (same host:
    one clock): within that lag the rank may have reached it. Empty where no such time is known."""
    newest: dict[str, float] = {}
    for f in ranks:
        if f.last_round == top and f.heartbeat_wall:
            newest[f.host] = max(newest.get(f.host, 0.0), f.heartbeat_wall)
    lags = [newest[f.host] - f.heartbeat_wall for f in ranks
            if labels[f.path] in behind and f.heartbeat_wall and f.host in newest]  # fmt: skip
    if not lags or max(lags) <= 0:
        return ""
    lag = max(lags)
    said = f"{lag:.1f} s" if lag >= 0.1 else f"{1000 * lag:.0f} ms"  # in-phase heartbeats lag by tens of ms
    whose = "its file was written out" if len(behind) == 1 else "their files were written out up to"
    return f" ({whose} {said} before the newest)"


def _stall(data: dict[str, Any], ranks: Sequence[RankFile], labels: dict[str, int], kind: str) -> str | None:
    """Every rank alive, no round advances: one rank many rounds behind, or a stall outside the vote. Only entered
    rounds that can be true are compared (a corrupt one is never another rank's blame)."""
    entered = {labels[f.path]: f.entered for f in ranks if f.entered_trusted}
    if not entered:
        return None
    top = max(entered.values())
    behind = sorted(k for k, v in entered.items() if top - v >= BEHIND_ROUNDS)
    if behind:
        data["behind_ranks"] = behind
        return (
            f"no round advances and {kind} {_ranks_text(behind)} {'are' if len(behind) > 1 else 'is'} many rounds "
            f"behind (entered {', '.join(str(entered[k]) for k in behind)}; the others up to {top}): that rank "
            "stopped taking part in MLP-sync rounds while the others went on (a sync it skipped, or a collective "
            "outside the sync that only the others issue)"
        )
    if top == 0:
        return None
    return (
        f"every rank alive (heartbeats ticking), none advances, all in round {top} with the same decisions: a stall "
        "outside the vote. Check where the ranks wait (py-spy dump --pid <pid> --native), e.g. a lazily loaded kernel "
        "on the first target-verify or draft step (sglang#33642: every scheduler in cuModuleLoadData; start with "
        "CUDA_MODULE_LOADING=EAGER), a collective outside the MLP sync, or a stuck device"
    )


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


def _mixed_text(mixed: dict[str, dict[str, list[int]]]) -> str:
    parts = []
    for what, by in mixed.items():
        name = "plugin" if what == "plugin" else "SGLang"
        parts.append(f"{name} " + ", ".join(f"{v} on {_ranks_text(r)}" for v, r in by.items()))
    return (
        f"the files come from different versions ({'; '.join(parts)}): one launch runs one version (an older file of "
        "a rank that recorded nothing this time, or a mixed install); the rounds are compared all the same"
    )


def _all_stale_text(liveness: dict[str, Any]) -> str:
    if liveness["watched_s"]:
        since = f"no rank's heartbeat ticked in {liveness['watched_s']:.1f} s"
    else:
        since = f"the newest {liveness['newest_heartbeat_age_s']:.0f} s ago"
    return (
        f"every heartbeat stopped ({since}): the server is down, or these are copies (read the files on their own "
        "nodes to tell frozen from dead)"
    )


def _watch(ranks: Sequence[RankFile], settle_s: float, known: set[str]) -> tuple[set[str], bool, float]:
    """Re-read the headers for ``settle_s``: whose heartbeat counter ticks (each file's own counter, never a clock
    compared across hosts) and whether any entered round moves. A rank not seen ticking, and not ``known`` stopped or
    dead on this host, is watched up to ``HEARTBEAT_STALE_S`` (a loaded host skips a few ticks)."""
    first = {f.path: (f.heartbeat_ticks, f.entered) for f in ranks}
    ticked: set[str] = set()
    advancing = False
    start = time.monotonic()
    settle_end, tick_end = start + settle_s, start + max(settle_s, HEARTBEAT_STALE_S)
    while True:
        now = time.monotonic()
        waiting = any(f.path not in ticked and f.path not in known for f in ranks)
        if now >= tick_end or (now >= settle_end and not waiting):
            return ticked, advancing, now - start
        time.sleep(max(0.0, min(POLL_S, (settle_end if now < settle_end else tick_end) - now)))
        for f in ranks:
            seen = _peek(f.path)
            if seen is None:
                continue
            ticks, wall, entered = seen
            if ticks and ticks != first[f.path][0]:
                ticked.add(f.path)
                f.heartbeat_ticks, f.heartbeat_wall = ticks, wall
            advancing |= entered != first[f.path][1]
            if f.entered_trusted and f.entered < entered <= f.entered + ROUND_SLACK:
                f.entered_watched = max(f.entered_watched, entered)


def _liveness(ranks: Sequence[RankFile], settle_s: float) -> dict[str, Any]:
    """Heartbeats first. Watched (``settle_s`` > 0): a rank whose counter does not tick while another's does has
    stopped. Not watched: heartbeat wall times are compared only between files of one host (one clock). On this
    host and boot the process table answers at once (stopped, gone)."""
    states = {f.path: process_state(f) for f in ranks}
    known = {p for p, s in states.items() if s in ("stopped", "dead")}
    watched = settle_s > 0
    ticked, advancing, watched_s = _watch(ranks, settle_s, known) if watched else (set(), False, 0.0)
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


def _stopped_text(f: RankFile, live: dict[str, Any]) -> str:
    since = f.heartbeat_wall or f.start_unix
    when = time.strftime("%H:%M:%S", time.gmtime(since)) + " UTC" if since else "(no time recorded)"
    what = {
        "stopped": f"frozen (pid {f.pid} is stopped: SIGSTOP or a debugger)",
        "dead": f"dead (pid {f.pid} is gone)",
        "running": f"frozen (pid {f.pid} runs, but its heartbeat thread stopped)",
        "unknown": "its heartbeat stopped (another host or boot: whether frozen or dead is told on its node)",
    }[live["process"]]
    beat = "heartbeat" if f.heartbeat_wall else "no heartbeat since the file opened at"
    if live["stale_by"] == "counter":
        behind = "no tick while the others ticked"
    elif live["heartbeat_behind_s"] is not None:
        behind = f"{live['heartbeat_behind_s']:.0f} s before the freshest"
    else:
        behind = "no time recorded"
    return (
        f"{what}; {beat} {when}, {behind}; last entered round {f.entered}, last recorded {f.last_round} (host {f.host})"
    )


def _decode_or_idle_modes() -> frozenset[int]:
    """SGLang's DECODE and IDLE ForwardMode values (what the counters count), without importing SGLang."""
    return _MODES


# ForwardMode values (stable since 0.5.x: EXTEND=1, DECODE=2, MIXED=3, IDLE=4; checked by the tests).
_MODES = frozenset({2, 4})


def escape(text: str) -> str:
    """``text`` with every character a terminal would act on (control characters, escapes) shown as an escape: a
    file's fields and names are never printed raw."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def rollcall_lines(data: dict[str, Any]) -> list[str]:
    """The text report, one entry a line (not yet escaped)."""
    kind = "DP" if data.get("rank_kind", "dp") == "dp" else "TP"
    lines = []
    if data.get("size"):
        lines.append(f"sglang-dp-mtp-fix rollcall: {len(data['ranks'])} of {data['size']} {kind} ranks have a file")
    for r in data["ranks"]:
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(r["started"])) if r["started"] else "unknown"
        skipped = f", {r['skipped']} half-written" if r["skipped"] else ""
        lines.append(
            f"  {kind} rank {r['rank']}: last round {r['last_round']} ({r['records']} rounds kept{skipped}, "
            f"last entered {r['entered_round']}); "
            f"host {r['host']} pid {r['pid']}, started {started}, plugin {r['plugin_version']} on SGLang "
            f"{r['sglang_version']}"
        )
        for bad in r["implausible"]:
            lines.append(f"    cannot be true, not used: {bad['field']} {bad['value']}: {bad['reason']}")
    for m in data["missing_ranks"]:
        lines.append(f"  {kind} rank {m}: NO FILE")
    for path in data["superseded"]:
        lines.append(f"  ignored (the rank's other file is its live or newest one): {path}")
    for ref in data["refused"]:
        lines.append(f"  refused {ref['file']}: {ref['reason']}")
    for note in data["notes"]:
        lines.append(f"  {note}")
    lines.append(data["answer"])
    return lines


def print_rollcall(data: dict[str, Any]) -> None:
    for line in rollcall_lines(data):
        print(escape(line))


def rollcall_json(data: dict[str, Any]) -> str:
    """Strict JSON (no NaN or Infinity: the reader keeps no time that is not one)."""
    return json.dumps(data, indent=2, allow_nan=False)

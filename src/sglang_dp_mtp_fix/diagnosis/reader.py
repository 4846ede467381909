"""The flight-recorder files read back (layout: ``recfile``; writer: ``recorder``): each rank's file, whole records
only, fields that cannot be true named and not used, and the headers watched for a while (whose heartbeat ticks,
whose entered round moves). Deciding from what is read: ``verdicts``."""

from __future__ import annotations

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
    PATH_GRAPH,
    PATH_NAMES,
    PROC_START,
    PROC_START_OFFSET,
    RECORD,
    ROUND_MASK,
    RUNNER_GATHERS,
    SENT_DRAFT,
    SENT_GENERIC,
    WORDS,
    path_check,
    sync_check,
)
from sglang_dp_mtp_fix.errors import RecorderFileError

POLL_S = 0.25  # how often the watch re-reads the headers
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
    path: int | None  # None: no draft path recorded for this round (or ``path_damaged``)
    bucket: int
    path_damaged: bool = False  # a path was recorded but fails its check: unknown, compared on the votes only

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


# How alive a file's writer is (``process_state``): running or stopped (a debugger) above unknown (another host or
# boot) above dead
ALIVE = {"running": 2, "stopped": 2, "unknown": 1, "dead": 0}


def liveliest(f: RankFile) -> tuple[Any, ...]:
    """How a file ranks among its rank's files (a restarted server, a copy or a move leaves others): the process
    that runs (or is stopped) first, then the newer heartbeat, the further progress, the later start, the name.
    ``rollcall`` and the stall line's peer scan pick a rank's file by it."""
    return ALIVE[process_state(f)], f.heartbeat_wall, f.entered, f.start_unix, f.path


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def _unix_time(value: float) -> bool:
    return math.isfinite(value) and EARLIEST_UNIX <= value <= LATEST_UNIX


# One byte past the largest file the format allows: a longer file is seen as padded, and never read whole
_WHOLE = HEADER_SIZE + MAX_CAPACITY * RECORD.size + 1


def _read_twice(path: str, nbytes: int = _WHOLE) -> tuple[bytes, bytes, os.stat_result]:
    """The file's first ``nbytes``, read twice (a record the writer changed in between is skipped). Never follows a
    link, never blocks on a FIFO."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise RecorderFileError(f"cannot read: {exc.strerror}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise RecorderFileError("not a regular file (a link, a FIFO or a device is never opened)")
    if st.st_size < HEADER_SIZE:
        raise RecorderFileError(f"truncated: {st.st_size} bytes, the header alone is {HEADER_SIZE}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            first = os.pread(fd, nbytes, 0)
            second = os.pread(fd, nbytes, 0)
        finally:
            os.close(fd)
    except OSError as exc:
        raise RecorderFileError(f"cannot read: {exc.strerror}") from exc
    return first, second, st


def read_file(path: str) -> RankFile:
    """One rank's file; raises RecorderFileError with the reason. A header field that cannot be true refuses the file;
    a round or time that cannot be true is named in ``implausible`` and not used."""
    first, second, st = _read_twice(path)
    rank = _header(path, first, second, st, (len(first), len(second)))
    _read_records(rank, first, second)
    return rank


def read_header(path: str) -> RankFile:
    """One rank's header alone, no records (``records`` empty): the stall line's peer scan, which runs in the thread
    that writes the heartbeat and must not stop it for long (a whole file costs ~100x a header)."""
    first, second, st = _read_twice(path, HEADER_SIZE)
    return _header(path, first, second, st, (st.st_size, st.st_size))


def _header(path: str, first: bytes, second: bytes, st: os.stat_result, sizes: tuple[int, int]) -> RankFile:
    """The header of a file read twice (``sizes``: the file's length in each read)."""
    if len(first) < HEADER_SIZE:
        raise RecorderFileError(f"truncated: {len(first)} bytes, the header alone is {HEADER_SIZE}")
    h = HEADER.unpack_from(first, 0)
    magic, version, header_size, record_size, capacity = h[:5]
    if magic != MAGIC:
        if magic == b"\0" * 8 and first[8:12] != b"\0" * 4:
            raise RecorderFileError("header incomplete (the process stopped while it created the file)")
        raise RecorderFileError(f"not a flight-recorder file (starts with {magic!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION or header_size != HEADER_SIZE or record_size != RECORD.size:
        # Formats 1-3 share the header's first fields: the writer's plugin version is named where the size agrees
        writer = "the plugin version that wrote it"
        if header_size == HEADER_SIZE:
            writer = f"plugin {_text(h[13])}'s rollcall"
        raise RecorderFileError(
            f"format {version} (header {header_size} B, records {record_size} B): this rollcall reads format "
            f"{FORMAT_VERSION} ({HEADER_SIZE} B, {RECORD.size} B); read it with {writer}"
        )
    if not 1 <= capacity <= MAX_CAPACITY:
        raise RecorderFileError(f"corrupt header: capacity {capacity}")
    want = HEADER_SIZE + capacity * RECORD.size
    if sizes != (want, want):
        raise RecorderFileError(f"truncated or padded: {sizes[0]} bytes, the header promises {want}")
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
    damaged: list[int] = []  # rounds of records whose check fails: a flipped bit, never a decision
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
        if begin != end & ROUND_MASK:
            f.skipped += 1  # cut while being written (or not a record)
            continue
        words = WORDS.unpack(raw)
        if end != begin | sync_check(words[1], words[2]) or flags > 15:
            damaged.append(begin)
            continue
        if begin > top or t_ns < 0:
            beyond.append(begin)
            continue
        old = f.records.get(begin)
        if old is not None and old.t_ns > t_ns:
            continue  # two records of one round (nothing gathered in between): the later one holds
        recorded = stamp & ROUND_MASK == begin  # a draft path recorded for this round
        path_damaged = recorded and (stamp != begin | path_check(words[4]) or (code & 3) == 3 or code > 7)
        if path_damaged:
            damaged.append(begin)  # the votes hold; the path is unknown (compared on the votes only)
        path = code if recorded and not path_damaged else None
        f.records[begin] = Record(begin, t_ns, tokens, mode, flags, path, bucket, path_damaged)
    if beyond:
        what = f"the entered round {f.entered}" if f.entered_trusted else f"the file's own clock's bound {bound}"
        _name(f, "record_round", max(beyond), f"{len(beyond)} record(s) of a round beyond {what}, or before boot")
    if damaged:
        reason = f"{len(damaged)} record(s) that fail their check (a flipped bit; the first named): not compared"
        _name(f, "record_check", min(damaged), reason)
    f.last_round = max(f.records, default=0)


def peek(path: str) -> tuple[int, float, int] | None:
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


def read_all(targets: Sequence[str]) -> tuple[list[RankFile], list[dict[str, str]], list[str]]:
    """Every readable file of ``targets`` once (one file named twice, through two names or a link to its directory,
    is one file), with the refused ones and the notes."""
    refused: list[dict[str, str]] = []
    notes: list[str] = []
    files: list[RankFile] = []
    seen: dict[tuple[int, int], str] = {}
    visited: dict[str, str] = {}  # by real path: a refused file named twice is refused once
    for target in targets:
        for path in files_in(target, refused, notes):
            real = os.path.realpath(path)
            if real in visited:
                notes.append(f"{path}: the same file as {visited[real]} (read once)")
                continue
            visited[real] = path
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


def watch(ranks: Sequence[RankFile], settle_s: float, known: set[str]) -> tuple[set[str], bool, float]:
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
            seen = peek(f.path)
            if seen is None:
                continue
            ticks, wall, entered = seen
            if ticks and ticks != first[f.path][0]:
                ticked.add(f.path)
                f.heartbeat_ticks, f.heartbeat_wall = ticks, wall
            advancing |= entered != first[f.path][1]
            if f.entered_trusted and f.entered < entered <= f.entered + ROUND_SLACK:
                f.entered_watched = max(f.entered_watched, entered)

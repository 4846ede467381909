"""Decision flight recorder (``SGLANG_DP_MTP_FIX_RECORDER_DIR``) and its reader, ``sglang-dp-mtp-fix rollcall``.

A hung rank's main thread is blocked in C and cannot run a Python signal handler, so the record is kept current in a
file another process can read at any time: each patched scheduler keeps the decisions of its last ``CAPACITY``
MLP-sync rounds in a fixed-size ring, a shared memory map of one file in that directory
(``sglang-dp-mtp-fix-<host>-dp<R>-<pid>.rec``). A round costs a handful of plain stores into the map: no syscall, no
flush; the kernel's page cache makes them visible to a reader on the same host while the process runs, hangs or
after it was killed. Copy the directories of every node together to read a whole group.

Decided at load like the counters (``stats``): with the variable unset ``instrument`` returns the vote wrappers
unchanged and nothing is created. The directory follows the report files' rules (``report.create_in_directory``).

Rounds: every rank takes part in every MLP-sync round, and SGLang builds the local row (``_get_local_tensor``) once per
gathered round on every rank, so counting there numbers the rounds alike on every rank (idle schedulers poll: many
rounds reach no batch). A round is recorded when its gathered result reaches a batch on this rank; the header keeps
the round the rank entered last.

File (little endian): a ``HEADER_SIZE`` header, magic written last, its last word the round entered; then
``capacity`` records of ``RECORD``, written in turn. A round's record is one ``pack_into`` that starts and ends with
the round number (struct writes the fields in order), so a record cut by a kill has two different copies and is
detected, never taken for an older one. The draft path is known later in the round (the draft runner's
``can_run_graph``): a second ``pack_into`` whose last field is the round again. The reader reads the file twice and
keeps only records identical in both reads (a record being written meanwhile is skipped).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import json
import logging
import mmap
import os
import re
import secrets
import socket
import stat
import struct
import time
import weakref
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from sglang_dp_mtp_fix import recfile
from sglang_dp_mtp_fix._version import __version__
from sglang_dp_mtp_fix.config import RECORDER_DIR_ENV, Config
from sglang_dp_mtp_fix.errors import RecorderFileError as RecorderFileError  # re-exported: its old home

logger = logging.getLogger("sglang_dp_mtp_fix")

MAGIC = b"SDMFREC1"
FORMAT_VERSION = recfile.FORMAT_VERSION
CAPACITY = 256
HEADER_SIZE = 256
# magic, version, header size, record size, capacity, dp rank, dp size, tp rank, tp size, global rank, pid,
# start (unix s), start (monotonic ns), plugin version, SGLang version, host
HEADER = struct.Struct("<8sIIIIiiiiiidq32s32s64s")
_ENTERED_OFFSET = HEADER_SIZE - 8  # the header's last word: the round this rank entered last (kept current)
# round (begin), monotonic ns, local tokens, forward mode, flags, 2 pad, round (end) | bucket, path, 3 pad, path stamp
RECORD = struct.Struct("<QqiBB2xQiB3xQ")
# The two writes of a round, each one ``pack_into``; struct writes the fields in order, so the copy of the round
# written last tells a whole write from a cut one.
_SYNC = struct.Struct("<QqiBB2xQ")  # at the record's offset 0
_PATH = struct.Struct("<iB3xQ")  # at offset _SYNC.size
FILE_GLOB = re.compile(r"^sglang-dp-mtp-fix-.*\.rec$")
MAX_CAPACITY = 1 << 16

# flags
SENT_GENERIC, GROUP_GENERIC, SENT_DRAFT, GROUP_DRAFT = 1, 2, 4, 8
# path byte: 0 none recorded, 1 graph, 2 eager; + RUNNER_GATHERS when the draft runner gathers (its bucket is common)
PATH_GRAPH, PATH_EAGER, RUNNER_GATHERS = 1, 2, 4
VOTE_ATTR = "can_run_dp_draft_cuda_graph"

_UNSET: Any = object()
load_problem: str | None = None  # set by ``instrument`` when the directory is refused (the plugin reports it)
_active: Recorder | None = None


def file_name(dp_rank: int) -> str:
    """A new name per file: the PID alone can be an earlier process's (a restarted container)."""
    return recfile.file_name(dp_rank, os.getpid(), secrets.token_hex(4))


def _ranks(info: Any) -> tuple[int, int, int, int, int]:
    """(dp rank, dp size, tp rank, tp size, global rank) of this scheduler; -1 where unknown."""
    dp_size = int(getattr(info, "dp_size", -1) or -1)
    tp_rank = tp_size = global_rank = -1
    try:
        from sglang.srt.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        tp_rank, tp_size = int(group.rank_in_group), int(group.world_size)
    except Exception:  # noqa: BLE001 - a header field, not a reason to stop
        pass
    try:
        import torch.distributed as dist

        global_rank = dist.get_rank() if dist.is_initialized() else -1
    except Exception:  # noqa: BLE001
        pass
    per_dp = tp_size // dp_size if dp_size > 0 and tp_size > 0 and tp_size % dp_size == 0 else 0
    dp_rank = tp_rank // per_dp if per_dp and tp_rank >= 0 else -1
    return dp_rank, dp_size, tp_rank, tp_size, global_rank


class Recorder:
    """One scheduler's ring. Until its file is open the stores go to a private buffer of the same shape."""

    def __init__(self, directory: str, capacity: int = CAPACITY):
        self.directory = directory
        self.capacity = capacity
        self.size = HEADER_SIZE + capacity * RECORD.size
        self.round = 0  # rounds counted (the round in progress)
        self.recorded_round = 0  # the round of the latest record
        self.path_round = 0  # the round whose draft path is recorded
        self.sent_generic = SENT_GENERIC
        self.next_offset = HEADER_SIZE  # where the next record goes
        self.last_offset = HEADER_SIZE
        self.buf: Any = bytearray(self.size)
        self.entered = ctypes.c_uint64.from_buffer(self.buf, _ENTERED_OFFSET)
        self.opened = False
        self.path: str | None = None

    def open(self, info: Any, ranks: tuple[int, int, int, int, int] | None = None) -> None:
        """Create the file (first round, when the ranks are known; ``ranks`` given: tests). A problem is one WARNING
        line: the recorder then keeps writing to its private buffer (nothing recorded, the server unaffected)."""
        self.opened = True
        from sglang_dp_mtp_fix import report

        dp_rank, dp_size, tp_rank, tp_size, global_rank = ranks or _ranks(info)
        path: str | None = None
        try:
            fd, path = report.create_in_directory(self.directory, RECORDER_DIR_ENV, file_name(dp_rank), os.O_RDWR)
            try:
                os.ftruncate(fd, self.size)
                # Every block now: a full disk or a quota fails here (ENOSPC, EDQUOT), not as a SIGBUS when a later
                # round first touches an unallocated page of the map.
                os.posix_fallocate(fd, 0, self.size)
                mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except Exception as exc:  # noqa: BLE001 - diagnostics must never crash the host
            if path is not None:  # no half-made file left for rollcall to refuse
                with contextlib.suppress(OSError):
                    os.unlink(path)
            logger.warning("sglang-dp-mtp-fix: flight recorder off on this scheduler: %s", exc)
            return
        HEADER.pack_into(
            mm, 0, b"\0" * 8, FORMAT_VERSION, HEADER_SIZE, RECORD.size, self.capacity, dp_rank, dp_size, tp_rank,
            tp_size, global_rank, os.getpid(), time.time(), time.monotonic_ns(), __version__.encode()[:32],
            _sglang_version().encode()[:32], socket.gethostname().encode()[:64],
        )  # fmt: skip
        recfile.PROC_START.pack_into(mm, recfile.PROC_START_OFFSET, recfile.proc_start_ticks())
        mm[recfile.BOOT_ID_OFFSET : recfile.BOOT_ID_OFFSET + recfile.BOOT_ID_SIZE] = recfile.boot_id()
        mm[0:8] = MAGIC  # last: a reader never takes a half-written header for a whole one
        entered = ctypes.c_uint64.from_buffer(mm, _ENTERED_OFFSET)
        entered.value = self.entered.value
        self.buf, self.entered, self.path = mm, entered, path
        _open_recorders.add(self)
        logger.info("sglang-dp-mtp-fix: flight recorder: %s (last %d MLP-sync rounds)", path, self.capacity)

    def detach(self) -> None:
        """After a fork, in the child: the parent's map is the parent's. The child's next round is its first: it opens
        a file of its own (``instrument``'s ``_get_local_tensor`` opens at round 1)."""
        self.buf = bytearray(self.size)  # the inherited map is dropped, never closed (the parent's ctypes view)
        self.entered = ctypes.c_uint64.from_buffer(self.buf, _ENTERED_OFFSET)
        self.path, self.opened = None, False
        self.round = self.recorded_round = self.path_round = 0
        self.next_offset = self.last_offset = HEADER_SIZE

    def close(self) -> None:
        """Tests: unmap the file (its content stays)."""
        buf, self.buf = self.buf, bytearray(self.size)
        self.entered = ctypes.c_uint64.from_buffer(self.buf, _ENTERED_OFFSET)  # drops the map's last export
        if isinstance(buf, mmap.mmap):
            buf.close()

    # -- a round's stores (hot path: one pack_into each, no syscall) ---------------------------------------------
    def enter(self) -> None:
        """A new MLP-sync round (counted on every rank alike, module doc)."""
        n = self.round = self.round + 1
        self.entered.value = n

    def sync(self, tokens: int, mode: int, flags: int) -> None:
        """This round's decisions, once the gathered result reached a batch on this rank."""
        r = self.recorded_round = self.round
        off = self.last_offset = self.next_offset
        self.next_offset = off + RECORD.size if off + RECORD.size < self.size else HEADER_SIZE
        _SYNC.pack_into(self.buf, off, r, time.monotonic_ns(), tokens, mode, flags, r)

    def draft_path(self, path: int, bucket: int) -> None:
        """The draft path of the round in progress (into its record, when it has one)."""
        r = self.path_round = self.round
        if self.recorded_round == r:
            _PATH.pack_into(self.buf, self.last_offset + _SYNC.size, bucket, path, r)


_open_recorders: weakref.WeakSet[Recorder] = weakref.WeakSet()


def _detach_after_fork() -> None:
    for rec in list(_open_recorders):
        rec.detach()
    _open_recorders.clear()


os.register_at_fork(after_in_child=_detach_after_fork)


def _sglang_version() -> str:
    from sglang_dp_mtp_fix.report import sglang_version

    return sglang_version()


def _bucket(runner: Any, forward_batch: Any) -> int:
    """The captured batch size the draft graph would replay at: the smallest of ``capture_bs`` (sorted by SGLang) at
    or above the size SGLang's ``can_run_graph`` checks (the gathered maximum when the runner gathers, else the local
    batch size); that size itself where the runner has no ``capture_bs``."""
    if runner.require_mlp_tp_gather:
        counts = getattr(forward_batch, "original_global_num_tokens_cpu", None) or forward_batch.global_num_tokens_cpu
        size = int(max(counts))
    else:
        size = int(forward_batch.batch_size)
    sizes = getattr(runner, "capture_bs", None)
    if sizes:
        i = bisect.bisect_left(sizes, size)
        if i < len(sizes):
            return int(sizes[i])
    return size


_L = TypeVar("_L", bound=Callable[..., Any])
_U = TypeVar("_U", bound=Callable[..., Any])
_G = TypeVar("_G", bound=Callable[..., Any])


def instrument(
    config: Config,
    local_row: _L,
    update_batch: _U,
    runner_gate: _G,
    decode_field: str,
    generic_field: str,
    local_vote: ContextVar[bool | None],
) -> tuple[_L, _U, _G]:
    """The vote's three wrappers, recording when ``SGLANG_DP_MTP_FIX_RECORDER_DIR`` is set; unchanged otherwise.

    Decided at load: without the variable the vote path carries no recording code at all."""
    global load_problem, _active
    load_problem = None
    _active = None
    if not config.recorder_dir:
        return local_row, update_batch, runner_gate
    problem = check_directory(config.recorder_dir)
    if problem:
        load_problem = f"sglang-dp-mtp-fix: flight recorder off: {problem}"
        return local_row, update_batch, runner_gate
    rec = _active = Recorder(config.recorder_dir)
    record_size, end, pack_sync, monotonic_ns = RECORD.size, rec.size, _SYNC.pack_into, time.monotonic_ns

    # SGLang's own signatures, not (*args, **kwargs): forwarding those costs ~0.7 us a frame on the bench host, the
    # recorder's whole budget. Their callers (all_gather, finalize_local, prepare_mlp_sync_batch_raw) are fingerprinted
    # premises of the vote, so the calls they make are known: (device=..., [dtype]) and (batch, info, require_mlp_tp_
    # gather, [skip by position] | skip_global_metadata=).
    def _get_local_tensor(self: Any, device: Any, dtype: Any = _UNSET) -> Any:
        n = rec.round = rec.round + 1  # once per gathered round on every rank (module doc)
        if n == 1:
            rec.open(self)
        rec.entered.value = n
        rec.sent_generic = SENT_GENERIC if getattr(self, decode_field) else 0
        if dtype is _UNSET:
            return local_row(self, device)
        return local_row(self, device, dtype)

    def _update_gather_batch(
        batch: Any, mlp_sync_info: Any, require_mlp_tp_gather: Any, skip: Any = _UNSET, **kwargs: Any
    ) -> Any:
        if skip is _UNSET:  # 0.5.18+ pass skip_global_metadata= by keyword, <= 0.5.17 skip_all_gather by position
            result = update_batch(batch, mlp_sync_info, require_mlp_tp_gather, **kwargs)
        else:
            result = update_batch(batch, mlp_sync_info, require_mlp_tp_gather, skip, **kwargs)
        flags = rec.sent_generic
        if getattr(batch, generic_field, False):
            flags |= GROUP_GENERIC
        if local_vote.get() is not False:
            flags |= SENT_DRAFT
        if getattr(batch, VOTE_ATTR, True):
            flags |= GROUP_DRAFT
        # Recorder.sync, inlined (a method call is a tenth of the budget here)
        r = rec.recorded_round = rec.round
        off = rec.last_offset = rec.next_offset
        rec.next_offset = off + record_size if off + record_size < end else HEADER_SIZE
        pack_sync(rec.buf, off, r, monotonic_ns(), mlp_sync_info.num_tokens, batch.forward_mode, flags, r)
        return result

    def can_run_graph(self: Any, forward_batch: Any) -> Any:
        ok = runner_gate(self, forward_batch)
        if rec.path_round != rec.round:  # the round's first draft decision is its draft path
            gathers = RUNNER_GATHERS if self.require_mlp_tp_gather else 0
            if ok:
                rec.draft_path(PATH_GRAPH | gathers, _bucket(self, forward_batch))
            else:
                rec.draft_path(PATH_EAGER | gathers, -1)
        return ok

    for outer, inner in (
        (_get_local_tensor, local_row),
        (_update_gather_batch, update_batch),
        (can_run_graph, runner_gate),
    ):
        functools.update_wrapper(outer, inner)
    return cast(_L, _get_local_tensor), cast(_U, _update_gather_batch), cast(_G, can_run_graph)


def active() -> Recorder | None:
    return _active


def check_directory(directory: str) -> str | None:
    """The report-file rules, checked at load: exists, a directory, not a symbolic link."""
    where = f"{RECORDER_DIR_ENV}={directory}"
    try:
        st = os.lstat(directory)
    except OSError as exc:
        return f"{where}: {exc.strerror} (the plugin never creates the directory)"
    if stat.S_ISLNK(st.st_mode):
        return f"{where} is a symbolic link; refusing to follow it (point the variable at the real one)"
    if not stat.S_ISDIR(st.st_mode):
        return f"{where} is not a directory"
    return None


# ---------------------------------------------------------------------------------------------------------------
# Reading: ``sglang-dp-mtp-fix rollcall DIR [DIR ...]``
# ---------------------------------------------------------------------------------------------------------------


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
        path = {None: "unknown", 0: "none", PATH_GRAPH: "graph", PATH_EAGER: "eager"}.get(
            None if self.path is None else self.path & 3, "?"
        )
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
    (entered,) = struct.unpack_from("<Q", first, _ENTERED_OFFSET)
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

"""Decision flight recorder (``SGLANG_DP_MTP_FIX_RECORDER_DIR``): the writer, inside each patched scheduler. The
file's layout: ``recfile``; its reader and verdicts: ``rollcall``; the heartbeat and the stall line: ``monitor``.

A hung rank's main thread is blocked in C and cannot run a Python signal handler, so the record is kept current in a
file another process can read at any time: each patched scheduler keeps the decisions of its last ``CAPACITY``
MLP-sync rounds in a fixed-size ring in its own memory (a round costs a handful of plain stores: no syscall), and the
monitor thread writes the whole ring out to one file in that directory once a heartbeat (``monitor``; ``flush``). The
thread runs while the main thread is blocked in a collective, so the file stays current while a rank hangs; after a
kill or a freeze it holds the ring as of the last heartbeat: at worst the last ~1 s of rounds are missing
(``HEARTBEAT_PERIOD_S`` plus the write). Nothing done to the file from outside reaches the process (issue 45; a file
mapping shared with the file would die of SIGBUS when the file is truncated): a truncated file is written whole
again, a deleted or replaced one is created anew, a failed write is one WARNING line. Copy the directories of every
node together to read a whole group.

Decided at load like the counters (``stats``): with the variable unset ``instrument`` returns the vote wrappers
unchanged and nothing is created. The directory follows the report files' rules (``report.create_in_directory``).

Rounds: every rank takes part in every MLP-sync round, and SGLang builds the local row (``_get_local_tensor``) once per
gathered round on every rank, so counting there numbers the rounds alike on every rank (idle schedulers poll: many
rounds reach no batch). A round is recorded when its gathered result reaches a batch on this rank; the header keeps
the round the rank entered last.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import functools
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, TypeVar, cast

from sglang_dp_mtp_fix._version import __version__
from sglang_dp_mtp_fix.config import RECORDER_DIR_ENV
from sglang_dp_mtp_fix.diagnosis import recfile
from sglang_dp_mtp_fix.diagnosis.recfile import (
    CAPACITY,
    CHECK_SHIFT,
    ENTERED_OFFSET,
    FLAGS_SHIFT,
    FORMAT_VERSION,
    GROUP_DRAFT,
    GROUP_GENERIC,
    HEADER,
    HEADER_SIZE,
    HEARTBEAT,
    HEARTBEAT_OFFSET,
    MAGIC,
    MODE_SHIFT,
    PATH,
    PATH_EAGER,
    PATH_GRAPH,
    PATH_SHIFT,
    RECORD,
    ROUND_MASK,
    RUNNER_GATHERS,
    SENT_DRAFT,
    SENT_GENERIC,
    SYNC,
    U32,
)
from sglang_dp_mtp_fix.sglang_versions import sglang_version

logger = logging.getLogger("sglang_dp_mtp_fix")

VOTE_ATTR = "can_run_dp_draft_cuda_graph"

_UNSET: Any = object()
load_problem: str | None = None  # set by ``instrument`` when the directory is refused (the plugin reports it)
_active: Recorder | None = None
# The settings (``configure``, from the plugin's ``diagnosis.wiring``): the directory, and what runs when the active
# recorder's file opens (the monitor's thread: the heartbeat that writes the file out)
_directory: str | None = None
_on_open: Callable[[], object] | None = None


def configure(directory: str | None, on_open: Callable[[], object] | None = None) -> None:
    """At load, before the vote is built: the directory (None: no recorder) and what to start once the file opens."""
    global _directory, _on_open
    _directory, _on_open = directory, on_open


def file_name(dp_rank: int) -> str:
    """A new name per file: the PID alone can be an earlier process's (a restarted container)."""
    return recfile.file_name(dp_rank, os.getpid(), secrets.token_hex(4))


def scheduler_dp_rank(scheduler: Any) -> int:
    """This scheduler's DP rank once SGLang's groups exist (-1 unknown)."""
    return _ranks(getattr(scheduler, "server_args", None))[0]


def _ranks(info: Any) -> tuple[int, int, int, int, int]:
    """(dp rank, dp size, tp rank, tp size, global rank) of this scheduler; -1 where unknown."""
    # ServerArgs and MLPSyncBatchInfo up to 0.5.21 call it dp_size; MLPSyncBatchInfo from 0.5.22 num_dp_ranks
    dp_size = int(getattr(info, "dp_size", None) or getattr(info, "num_dp_ranks", -1) or -1)
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
    """One scheduler's ring, in this process's own memory; the monitor thread writes it out to the file (``flush``)."""

    def __init__(self, directory: str, capacity: int = CAPACITY):
        self.directory = directory
        self.capacity = capacity
        self.size = HEADER_SIZE + capacity * RECORD.size
        self.round = 0  # rounds counted (the round in progress)
        self.recorded_round = 0  # the round of the latest record
        self.path_round = 0  # the round whose draft path is recorded
        self.sent_generic = SENT_GENERIC
        self.word = self.size // 8 - RECORD_WORDS  # the latest record's first word (none yet: the next goes first)
        self._use(bytearray(self.size))
        self.opened = False
        self.path: str | None = None
        self.dp_rank = -1
        self._ranks = (-1, -1, -1, -1, -1)
        self._fd: int | None = None
        # the recorder's start (wall, monotonic ns), stamped into every file it makes: a file made again carries the
        # ring and the heartbeat of the same run, so a later start would put that heartbeat before the file's opening
        self._start: tuple[float, int] | None = None
        # the last write-out problem logged, by kind (one line each, not one a second): the exception's type and errno,
        # never its text, which names a new random file each try
        self._problem: tuple[str, int | None] | None = None
        self._lock = threading.Lock()  # flush (monitor thread) against close/open (main thread)

    @property
    def tp_rank(self) -> int:
        return self._ranks[2]

    def open(self, info: Any, ranks: tuple[int, int, int, int, int] | None = None) -> None:
        """Create the file (first round, when the ranks are known; ``ranks`` given: tests). A problem is one WARNING
        line: the recorder then keeps writing to its buffer alone (nothing recorded, the server unaffected)."""
        self.opened = True
        self._ranks = ranks or _ranks(info)
        self.dp_rank = self._ranks[0]
        try:
            with self._lock:
                self._create()
        except Exception as exc:  # noqa: BLE001 - diagnostics must never crash the host
            logger.warning("sglang-dp-mtp-fix: flight recorder off on this scheduler: %s", exc)
            return
        _open_recorders.add(self)
        if self is _active and _on_open is not None:
            _on_open()  # the heartbeat and the write-out (once per process; again in a forked child)
        logger.info("sglang-dp-mtp-fix: flight recorder: %s (last %d MLP-sync rounds)", self.path, self.capacity)

    def _create(self) -> None:
        """A new file holding the ring as it is now (at open; again when the file was deleted or replaced)."""
        from sglang_dp_mtp_fix import report

        dp_rank, dp_size, tp_rank, tp_size, global_rank = self._ranks
        fd, path = report.create_in_directory(self.directory, RECORDER_DIR_ENV, file_name(dp_rank), os.O_RDWR)
        try:
            os.ftruncate(fd, self.size)
            # Every block now: a full disk or a quota fails here (ENOSPC, EDQUOT), at open, as one warning line
            os.posix_fallocate(fd, 0, self.size)
            buf = self.buf
            # a copy left at the old path is superseded by this file through its heartbeat (rollcall's liveliest)
            start_unix, start_mono = self._start or (time.time(), time.monotonic_ns())
            HEADER.pack_into(
                buf, 0, b"\0" * 8, FORMAT_VERSION, HEADER_SIZE, RECORD.size, self.capacity, dp_rank, dp_size,
                tp_rank, tp_size, global_rank, os.getpid(), start_unix, start_mono,
                __version__.encode()[:32], sglang_version().encode()[:32], socket.gethostname().encode()[:64],
            )  # fmt: skip
            recfile.PROC_START.pack_into(buf, recfile.PROC_START_OFFSET, recfile.proc_start_ticks())
            buf[recfile.BOOT_ID_OFFSET : recfile.BOOT_ID_OFFSET + recfile.BOOT_ID_SIZE] = recfile.boot_id()
            _write_all(fd, bytes(buf), 0)
            buf[0:8] = MAGIC
            _write_all(fd, MAGIC, 0)  # last: a reader never takes a half-written header for a whole one
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):  # no half-made file left for rollcall to refuse
                os.unlink(path)
            raise
        old, self._fd, self.path, self._start = self._fd, fd, path, (start_unix, start_mono)
        if old is not None:
            os.close(old)

    def flush(self) -> None:
        """Write the ring out (the monitor thread, once a heartbeat; ``close``). Whatever was done to the file from
        outside costs at most a WARNING line: truncated or appended to, it is written whole again at its size; deleted,
        moved or replaced (our inode is no longer at our path), a new file takes its place; a write that fails is
        tried again at the next tick."""
        with self._lock:
            if self._fd is None:
                return
            problem: tuple[str, int | None] | None = None
            try:
                st = os.fstat(self._fd)
                if st.st_nlink == 0 or not _still_named(self.path, st):
                    gone = self.path
                    self._create()
                    logger.warning("sglang-dp-mtp-fix: flight recorder file %s was deleted, moved or replaced; now %s",
                                   gone, self.path)  # fmt: skip
                else:
                    if st.st_size != self.size:  # appended to (or cut): the ring's own size again
                        os.ftruncate(self._fd, self.size)
                    _write_all(self._fd, bytes(self.buf), 0)  # a snapshot: the main thread goes on storing
            except Exception as exc:  # noqa: BLE001 - a diagnostic write never takes the scheduler down
                problem = (type(exc).__name__, getattr(exc.__cause__ or exc, "errno", None))
                if problem != self._problem:
                    logger.warning("sglang-dp-mtp-fix: flight recorder file %s not written (tried again): %s",
                                   self.path, exc)  # fmt: skip
            self._problem = problem

    def heartbeat(self, ticks: int) -> None:
        """The monitor thread's heartbeat (about once a second) into the header, then the ring written out: the two
        reach the file together, and this module stays the file's one writer."""
        HEARTBEAT.pack_into(self.buf, HEARTBEAT_OFFSET, ticks, time.time(), time.monotonic_ns(), ticks)
        self.flush()

    def path_of(self, round_: int) -> tuple[str, int | None]:
        """The draft path and bucket recorded for ``round_`` when it is the latest record (the stall line)."""
        if round_ == 0 or round_ != self.recorded_round:
            return "none", None
        bucket, code, stamp = PATH.unpack_from(self.buf, self.word * 8 + SYNC.size)
        if stamp & ROUND_MASK != round_:
            return "unknown", None  # no draft-runner decision recorded for it (yet, or no graph runner)
        return recfile.PATH_NAMES.get(code & 3, "?"), bucket

    def detach(self) -> None:
        """After a fork, in the child: the parent's file is the parent's. The child's next round is its first: it opens
        a file of its own (``instrument``'s ``_get_local_tensor`` opens at round 1)."""
        self._lock = threading.Lock()  # the parent's may have been held by its monitor thread at the fork
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # the child's copy of the descriptor; the parent's stays open
        self._fd = None
        self._use(bytearray(self.size))
        self.path, self.opened, self._start = None, False, None
        self.round = self.recorded_round = self.path_round = 0
        self.word = self.size // 8 - RECORD_WORDS

    def close(self) -> None:
        """Write the ring out a last time and close the file (its content stays)."""
        self.flush()
        with self._lock:
            fd, self._fd = self._fd, None
            if fd is not None:
                os.close(fd)
        _open_recorders.discard(self)

    def _use(self, buf: bytearray) -> None:
        """Write into ``buf`` from now on, through its view as 64-bit words (``recfile``: the record's words)."""
        self.buf = buf
        self.u64 = memoryview(buf).cast("Q")

    # -- a round's stores (hot path: plain stores into process memory, no syscall) --------------------------------
    def enter(self) -> None:
        """A new MLP-sync round (counted on every rank alike, module doc)."""
        n = self.round = self.round + 1
        self.u64[ENTERED_WORD] = n

    def sync(self, tokens: int, mode: int, flags: int) -> None:
        """This round's decisions, once the gathered result reached a batch on this rank (``instrument`` inlines it)."""
        r = self.recorded_round = self.round
        w = self.word + RECORD_WORDS
        if w * 8 >= self.size:
            w = HEADER_WORDS
        u64, self.word = self.u64, w
        t, word = time.monotonic_ns(), tokens & U32 | mode << MODE_SHIFT | flags << FLAGS_SHIFT
        u64[w] = r
        u64[w + 1] = t
        u64[w + 2] = word
        u64[w + 3] = r | recfile.sync_check(t, word)

    def draft_path(self, path: int, bucket: int) -> None:
        """The draft path of the round in progress (into its record, when it has one)."""
        r = self.path_round = self.round
        if self.recorded_round == r:
            w, word = self.word, bucket & U32 | path << PATH_SHIFT
            self.u64[w + 4] = word
            self.u64[w + 5] = r | word.bit_count() << CHECK_SHIFT  # recfile.path_check


ENTERED_WORD, HEADER_WORDS, RECORD_WORDS = ENTERED_OFFSET // 8, HEADER_SIZE // 8, RECORD.size // 8
_open_recorders: weakref.WeakSet[Recorder] = weakref.WeakSet()


def _still_named(path: str | None, st: os.stat_result) -> bool:
    """Is our file still at ``path``? A moved file (``mv *.rec archive/``, a hard link then an unlink) keeps its links
    elsewhere: writing on would feed a file nobody looks for, and rollcall would call the rank missing."""
    try:
        here = os.lstat(path) if path else None
    except OSError:
        return False
    return here is not None and (here.st_dev, here.st_ino) == (st.st_dev, st.st_ino)


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _detach_after_fork() -> None:
    for rec in list(_open_recorders):
        rec.detach()
    _open_recorders.clear()


def _flush_at_exit() -> None:
    """An ordinary exit writes the latest rounds out (a kill cannot: the file then lags by up to one heartbeat)."""
    for rec in list(_open_recorders):
        with contextlib.suppress(Exception):
            rec.flush()


os.register_at_fork(after_in_child=_detach_after_fork)
atexit.register(_flush_at_exit)


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
    local_row: _L,
    update_batch: _U,
    runner_gate: _G,
    decode_field: str,
    generic_field: str,
    local_vote: ContextVar[bool | None],
) -> tuple[_L, _U, _G]:
    """The vote's three wrappers, recording when ``SGLANG_DP_MTP_FIX_RECORDER_DIR`` is set (``configure``); unchanged
    otherwise. Decided at load: without the variable the vote path carries no recording code at all."""
    global load_problem, _active
    load_problem, _active = None, None
    if not _directory:
        return local_row, update_batch, runner_gate
    problem = check_directory(_directory)
    if problem:
        load_problem = f"sglang-dp-mtp-fix: flight recorder off: {problem}"
        return local_row, update_batch, runner_gate
    rec = _active = Recorder(_directory)
    end_word, monotonic_ns = rec.size // 8, time.monotonic_ns

    # SGLang's own signatures, not (*args, **kwargs): forwarding those costs ~0.7 us a frame on the bench host, the
    # recorder's whole budget. Their callers (all_gather, finalize_local, prepare_mlp_sync_batch_raw) are fingerprinted
    # premises of the vote, so the calls they make are known: (device=..., [dtype]) and (batch, info, require_mlp_tp_
    # gather, [skip by position] | skip_global_metadata=).
    def _get_local_tensor(self: Any, device: Any, dtype: Any = _UNSET) -> Any:
        n = rec.round = rec.round + 1  # once per gathered round on every rank (module doc)
        if n == 1:
            rec.open(self)
        rec.u64[ENTERED_WORD] = n
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
        w = rec.word + RECORD_WORDS
        if w >= end_word:
            w = HEADER_WORDS
        u64, rec.word, t = rec.u64, w, monotonic_ns()
        word = mlp_sync_info.num_tokens & U32 | batch.forward_mode << MODE_SHIFT | flags << FLAGS_SHIFT
        u64[w] = r
        u64[w + 1] = t
        u64[w + 2] = word
        u64[w + 3] = r | (t ^ word).bit_count() << CHECK_SHIFT  # recfile.sync_check
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
    """The report-file rules (``report.check_directory``), checked at load: exists, a directory, not a link."""
    from sglang_dp_mtp_fix import report
    from sglang_dp_mtp_fix.errors import ReportFileError

    try:
        report.check_directory(directory, RECORDER_DIR_ENV)
    except ReportFileError as exc:
        return str(exc)
    return None

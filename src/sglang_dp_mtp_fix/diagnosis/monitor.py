"""Liveness of a patched scheduler, kept by one daemon thread per process, never by the main thread (the main thread is
what stops): the heartbeat in the flight-recorder file's header (``recfile``) and the stall line in SGLang's log.

Heartbeat: about once a second the thread hands the recorder its tick (``recorder.Recorder.heartbeat``), which writes
wall and monotonic time into its ring's header and the ring out to its file (when ``SGLANG_DP_MTP_FIX_RECORDER_DIR``
is set): the recorder is the file's one writer.
A rank blocked in a collective keeps ticking; a frozen, killed or OOM-killed process stops, which is what ``rollcall``
reads first.

Stall line (``SGLANG_DP_MTP_FIX_STALL_S``, recorder or not): the vote's sync-entry wrapper counts MLP-sync rounds
entered and finished in ``PROGRESS`` (three plain stores a round); the thread compares them each tick. A rank that has
not finished a round for ``stall_s`` seconds logs one WARNING line in ``key=value`` form, and one line when a round
finishes again; ``where`` says where it stopped: inside a round (entered, not finished: blocked in the gather), after
one that handed it a batch (in the forward), or between rounds while idle. An idle rank's loop comes back to the
sync entry at least once a second, asleep (``--sleep-on-idle``) or not, so an idle rank is stalled when its loop
stays away for ``stall_s`` (at least ``IDLE_FLOOR_S``): its group stopped (issue 45: a peer frozen while the group
was idle holds the live rank in the request broadcast, outside any round). A paused engine is not judged.

The thread never raises into SGLang (every tick is guarded), is a daemon (it ends with the process) and is restarted
in a forked child when the child's own recorder opens its file (``recorder.configure``'s ``on_open``, set by
``wiring``), never shared with the parent.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from sglang_dp_mtp_fix.diagnosis import reader, recfile

logger = logging.getLogger("sglang_dp_mtp_fix")


class Progress:
    """MLP-sync rounds of this process, written by the main thread only (the vote's sync-entry wrapper)."""

    __slots__ = ("entered", "finished", "busy")

    def __init__(self) -> None:
        self.entered = 0  # sync-entry calls begun
        self.finished = 0  # the last one that returned
        self.busy = False  # it returned a batch: the group had work (an idle rank gets an IDLE batch then)


PROGRESS = Progress()
# A forced stop (tests): every wait is bounded by this, so the thread always ends
_TICK_S = recfile.HEARTBEAT_PERIOD_S
# The least an idle rank's loop may stay away before it counts as stopped: an idle sleeper's 1 s poll, on each of two
# ranks in turn, on a loaded host
IDLE_FLOOR_S = 5.0


class Monitor:
    """The thread's state (one per process). ``tick`` is one pass: tests call it directly with a clock."""

    def __init__(self, stall_s: float | None, dp_rank: int = -1) -> None:
        self.stall_s = stall_s
        self.dp_rank = dp_rank
        self.ticks = 0
        self.seen_finished = PROGRESS.finished
        self.last_change = time.monotonic()
        self.stalled_since: float | None = None
        self.stalls = 0
        self.on_tick: Callable[[float, bool], None] | None = None  # metrics: (seconds since a round, new stall)
        self.scheduler: weakref.ref[Any] | None = None  # read for its paused flag only (the Scheduler seam sets it)
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    # -- the heartbeat ------------------------------------------------------------------------------------------
    def beat(self) -> None:
        from sglang_dp_mtp_fix.diagnosis import recorder

        rec = recorder.active()
        if rec is None or rec.path is None:
            return
        self.ticks += 1
        rec.heartbeat(self.ticks)  # the recorder writes it, with the ring: the file has one writer

    # -- the stall watcher --------------------------------------------------------------------------------------
    def watch(self, now: float) -> None:
        p = PROGRESS
        finished, entered, busy = p.finished, p.entered, p.busy
        new_stall = False
        if finished != self.seen_finished:
            if self.stalled_since is not None:
                logger.warning("%s", self.recovery_line(now))
                self.stalled_since = None
            self.seen_finished, self.last_change = finished, now
        elif self.stall_s is not None and self.stalled_since is None:
            where = "inside_mlp_sync" if entered != finished else "after_mlp_sync" if busy else "between_rounds"
            threshold = self.stall_s if where != "between_rounds" else self.idle_threshold(finished)
            if threshold is not None and now - self.last_change >= threshold:
                self.stalled_since = self.last_change
                self.stalls += 1
                new_stall = True
                logger.warning("%s", self.stall_line(now, where))
        if self.on_tick is not None:
            self.on_tick(now - self.last_change, new_stall)

    def idle_threshold(self, finished: int) -> float | None:
        """An idle rank's loop comes back to the sync entry at least once a second (the idle sleeper of
        ``--sleep-on-idle`` polls for 1 s at most), and every pass waits for every rank of the TP group (the request
        broadcast): a loop that stays away is stopped with its group (issue 45). None: not judged (no round yet, or
        the engine paused on request, whose loop skips the round)."""
        assert self.stall_s is not None
        if finished == 0 or self.engine_paused():
            return None
        return max(self.stall_s, IDLE_FLOOR_S)

    def engine_paused(self) -> bool:
        scheduler = self.scheduler() if self.scheduler is not None else None
        return bool(getattr(scheduler, "_engine_paused", False))

    def _round_fields(self) -> dict[str, Any]:
        from sglang_dp_mtp_fix.diagnosis import recorder

        rec = recorder.active()
        fields: dict[str, Any] = {"dp_rank": self.dp_rank}
        if rec is not None and rec.path is not None:
            fields["dp_rank"] = rec.dp_rank
            fields["round"] = rec.round
            fields["last_decided_round"] = rec.recorded_round or "none"
            path, bucket = rec.path_of(rec.recorded_round)
            fields["draft_path"] = path
            fields["bucket"] = bucket if bucket is not None and bucket >= 0 else "none"
        else:
            fields["sync_call"] = PROGRESS.entered  # no recorder: the sync-entry calls of this process
        return fields

    def stall_line(self, now: float, where: str) -> str:
        fields = self._round_fields()
        fields["where"] = where
        fields["stalled_s"] = f"{now - self.last_change:.1f}"
        fields["stall_s"] = f"{self.stall_s:g}"
        stale, live, unread = peer_heartbeats()
        fields["stale_peers"] = ",".join(stale) or "none"
        fields["live_peers"] = ",".join(live) or "none"
        if unread:
            fields["peer_files_unread"] = unread
        return "sglang-dp-mtp-fix: stall: " + " ".join(f"{k}={v}" for k, v in fields.items())

    def recovery_line(self, now: float) -> str:
        fields = self._round_fields()
        since = now if self.stalled_since is None else self.stalled_since
        fields["stalled_s"] = f"{now - since:.1f}"
        return "sglang-dp-mtp-fix: stall over: " + " ".join(f"{k}={v}" for k, v in fields.items())

    # -- the thread ---------------------------------------------------------------------------------------------
    def tick(self) -> None:
        self.beat()
        self.watch(time.monotonic())

    def run(self) -> None:
        while not self.stop_event.wait(_TICK_S):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - liveness must never take the scheduler down
                logger.debug("sglang-dp-mtp-fix: monitor tick failed", exc_info=True)

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="sglang-dp-mtp-fix-monitor", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(5 * _TICK_S)


# The peer scan runs in the thread that writes the heartbeat: it stops after this long (a quarter of a tick) and says
# how many files it left unread. Newest first: a live peer's file is written every tick, an earlier launch's never.
PEER_SCAN_BUDGET_S = 0.25


def peer_heartbeats(
    now_wall: float | None = None, clock: Callable[[], float] = time.monotonic
) -> tuple[list[str], list[str], int]:
    """The other ranks' heartbeats readable in this host's recorder directory: (stale, live), as ``dp<R>(...)``, and
    the number of files left unread when the scan's budget ran out (20,000 files of earlier launches paused the
    heartbeat ~4.7 s when each was read whole)."""
    from sglang_dp_mtp_fix.diagnosis import recorder

    rec = recorder.active()
    if rec is None or rec.path is None:
        return [], [], 0
    now_wall = time.time() if now_wall is None else now_wall
    deadline = clock() + PEER_SCAN_BUDGET_S
    paths = _newest_first(reader.files_in(rec.directory))
    newest: dict[int, tuple[tuple[Any, ...], reader.RankFile]] = {}  # each peer's liveliest file, with its key
    unread = 0
    for n, path in enumerate(paths):
        if clock() > deadline:
            unread = len(paths) - n
            break
        try:
            f = reader.read_header(path)
        except Exception:  # noqa: BLE001 - a peer's unreadable file is just not named
            continue
        if f.tp_rank == rec.tp_rank:  # this rank's own files (its live one, an earlier launch's) are never a peer
            continue
        key = reader.liveliest(f)  # rollcall's rule: a file made again keeps its run's start, so the start ties
        if f.tp_rank in newest and newest[f.tp_rank][0] > key:
            continue
        newest[f.tp_rank] = key, f
    stale, live = [], []
    for _, f in sorted(newest.values(), key=lambda kf: kf[1].tp_rank):
        age = now_wall - f.heartbeat_wall if f.heartbeat_wall else None
        name = f"dp{f.dp_rank}" if f.dp_size == f.tp_size else f"tp{f.tp_rank}"
        if age is None or age > recfile.HEARTBEAT_STALE_S:
            stale.append(f"{name}(pid={f.pid},heartbeat_age_s={'none' if age is None else f'{age:.1f}'},"
                         f"state={reader.process_state(f)})")  # fmt: skip
        else:
            live.append(name)
    return stale, live, unread


def _newest_first(paths: list[str]) -> list[str]:
    def modified(path: str) -> int:
        try:
            return os.lstat(path).st_mtime_ns
        except OSError:
            return 0

    return sorted(paths, key=modified, reverse=True)


_monitor: Monitor | None = None
_stall_s: float | None = None
_dp_rank = -1


def configure(stall_s: float | None) -> None:
    """At load (``wiring``): the stall threshold. The vote's sync-entry wrapper writes ``PROGRESS``."""
    global _stall_s
    _stall_s = stall_s


def start(dp_rank: int | None = None, scheduler: Any = None) -> Monitor:
    """Start this process's thread (once; again in a forked child). ``dp_rank``: for the stall line without a
    recorder; ``scheduler``: whether its engine is paused (the Scheduler seam knows both)."""
    global _monitor, _dp_rank
    if dp_rank is not None:
        _dp_rank = dp_rank
    if _monitor is None:
        _monitor = Monitor(_stall_s, _dp_rank)
        _monitor.start()
    elif dp_rank is not None:
        _monitor.dp_rank = dp_rank
    if scheduler is not None:
        try:
            _monitor.scheduler = weakref.ref(scheduler)
        except TypeError:  # a scheduler without weak references: its pause is not seen, the watcher runs on
            pass
    return _monitor


def active() -> Monitor | None:
    return _monitor


def stop() -> None:
    """Tests (the plugin's ``restore``): end the thread and forget the counters."""
    global _monitor
    if _monitor is not None:
        _monitor.stop()
    _monitor = None
    PROGRESS.entered = PROGRESS.finished = 0
    PROGRESS.busy = False


def _forget_after_fork() -> None:
    global _monitor
    _monitor = None  # the parent's thread does not exist in the child


os.register_at_fork(after_in_child=_forget_after_fork)

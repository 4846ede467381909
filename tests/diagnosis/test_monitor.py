"""The monitor thread (issue 33): the heartbeat in the recorder file, and the stall line; with ``rollcall``'s
liveness verdicts on real writer processes (the recorder's own code, no SGLang: a main thread held in a blocking
call stands for a rank blocked in a collective)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path

import pytest

from sglang_dp_mtp_fix import rollcall
from sglang_dp_mtp_fix.config import STALL_ENV, load_config
from sglang_dp_mtp_fix.diagnosis import monitor, reader, recfile

HELD_WRITER = """
import sys, threading
from contextvars import ContextVar
from sglang_dp_mtp_fix.diagnosis import recorder, wiring
from sglang_dp_mtp_fix.config import Config

rank, rounds = int(sys.argv[2]), int(sys.argv[3])
same = lambda *a, **k: None
wiring.configure(Config(recorder_dir=sys.argv[1], stall_s=None))  # the plugin's settings, as register() sets them
recorder.instrument(same, same, same, "d", "g", ContextVar("v"))
rec = recorder.active()
rec.open(None, ranks=(rank, 2, rank, 2, rank))  # starts the monitor thread (the heartbeat)
for _ in range(rounds):
    rec.enter()
    rec.sync(2, 2, recorder.SENT_GENERIC | recorder.GROUP_DRAFT)
    rec.draft_path(recorder.PATH_GRAPH, 8)
print("open", flush=True)
threading.Event().wait()  # the main thread held, as in a collective that never returns
"""


class Writers:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.procs: list[subprocess.Popen] = []

    def start(self, rank: int, rounds: int) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(HELD_WRITER), str(self.directory), str(rank), str(rounds)],
            stdout=subprocess.PIPE,
        )
        self.procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == b"open\n"
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)


@pytest.fixture
def writers(tmp_path):
    w = Writers(tmp_path)
    yield w
    w.stop()


def wait_heartbeats(directory: Path, count: int, ticks: int = 2, timeout: float = 30) -> list[reader.RankFile]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = [reader.read_file(p) for p in reader.files_in(str(directory))]
        if len(got) == count and all(f.heartbeat_ticks >= ticks for f in got):
            return got
        time.sleep(0.2)
    raise AssertionError(f"no {count} ticking heartbeats in {directory} within {timeout} s")


def test_held_ranks_keep_ticking_then_rollcall_names_the_frozen_and_the_dead_rank(writers, tmp_path):
    writers.start(0, 10)
    one = writers.start(1, 10)
    wait_heartbeats(tmp_path, 2)
    # (c) both alive, held in the same round, the same decisions: a stall outside the vote
    data, code = rollcall.rollcall([str(tmp_path)])
    assert code == 1 and data["verdict"] == "stall_outside_vote", data["answer"]
    assert "all in round 10 with the same decisions: a stall outside the vote" in data["answer"]
    assert "CUDA_MODULE_LOADING=EAGER" in data["answer"] and "sglang#33642" in data["answer"]
    assert all(r["process"] == "running" and not r["stopped"] for r in data["ranks"])
    # (b) frozen: SIGSTOP stops its heartbeat thread with it
    os.kill(one.pid, signal.SIGSTOP)
    try:
        data, code = rollcall.rollcall([str(tmp_path)])
        assert code == 1 and data["verdict"] == "stopped" and data["stopped_ranks"] == [1], data["answer"]
        assert f"DP rank 1 stopped: frozen (pid {one.pid} is stopped: SIGSTOP or a debugger)" in data["answer"]
        frozen_at = reader.read_file(next(r["file"] for r in data["ranks"] if r["rank"] == 1)).heartbeat_ticks
        time.sleep(recfile.HEARTBEAT_STALE_S + 1)
        f1 = reader.read_file(next(r["file"] for r in data["ranks"] if r["rank"] == 1))
        assert f1.heartbeat_ticks == frozen_at  # no tick while stopped ...
        data, code = rollcall.rollcall([str(tmp_path)], settle_s=0)
        assert data["ranks"][1]["heartbeat_behind_s"] > recfile.HEARTBEAT_STALE_S, data["ranks"]  # ... rank 0 ticks
    finally:
        os.kill(one.pid, signal.SIGCONT)
    # (b) dead
    one.kill()
    one.wait(30)
    data, code = rollcall.rollcall([str(tmp_path)], settle_s=0)
    assert (
        code == 1
        and data["stopped_ranks"] == [1]
        and f"DP rank 1 stopped: dead (pid {one.pid} is gone)" in (data["answer"])
    ), data["answer"]


def test_rollcall_names_a_rank_many_rounds_behind(writers, tmp_path):
    writers.start(0, 40)
    writers.start(1, 12)
    wait_heartbeats(tmp_path, 2)
    data, code = rollcall.rollcall([str(tmp_path)])
    assert code == 1 and data["verdict"] == "behind" and data["behind_ranks"] == [1], data["answer"]
    assert "DP rank [1] is many rounds behind (entered 12; the others up to 40)" in data["answer"]


# --- the stall watcher, one tick at a time ----------------------------------------------------------------------


@pytest.fixture
def progress():
    saved = (monitor.PROGRESS.entered, monitor.PROGRESS.finished, monitor.PROGRESS.busy)
    yield monitor.PROGRESS
    monitor.PROGRESS.entered, monitor.PROGRESS.finished, monitor.PROGRESS.busy = saved


def test_one_stall_line_per_stall_and_one_recovery_line(progress, caplog):
    caplog.set_level(logging.WARNING, "sglang_dp_mtp_fix")
    progress.entered = progress.finished = 7
    m = monitor.Monitor(stall_s=10, dp_rank=1)
    m.watch(0.0)
    progress.entered = 8  # round 8 entered, never finished: blocked in the gather
    m.last_change = 0.0
    for t in (1.0, 5.0, 9.9):
        m.watch(t)
    assert not caplog.records
    for t in (10.0, 11.0, 30.0):
        m.watch(t)
    (line,) = (r.getMessage() for r in caplog.records)
    assert line.startswith("sglang-dp-mtp-fix: stall: dp_rank=1 sync_call=8 where=inside_mlp_sync stalled_s=10.0 ")
    assert "stall_s=10 stale_peers=none live_peers=none" in line and m.stalls == 1
    progress.finished = 8
    m.watch(31.0)
    assert [r.getMessage() for r in caplog.records][1] == (
        "sglang-dp-mtp-fix: stall over: dp_rank=1 sync_call=8 stalled_s=31.0"
    )
    progress.entered = 9
    m.watch(45.0)
    assert m.stalls == 2 and len(caplog.records) == 3  # a new stall is a new line


def fields(line: str) -> dict[str, str]:
    head, _, rest = line.partition(": stall: ")
    return dict(kv.split("=", 1) for kv in rest.split())


def test_an_idle_rank_whose_loop_comes_back_is_not_stalled_one_whose_loop_stopped_is(progress, caplog):
    """Issue 45: an idle rank's loop comes back to the sync entry at least once a second; one that stays away is
    stopped with its group (a peer frozen while idle). Before, an idle rank was never judged (seen failing: no line)."""
    caplog.set_level(logging.WARNING, "sglang_dp_mtp_fix")
    progress.entered = progress.finished = 3
    progress.busy = False  # its last round handed it nothing: idle
    m = monitor.Monitor(stall_s=2)
    m.watch(0.0)
    for t in range(1, 30):  # idle rounds, asleep a second each (--sleep-on-idle): the loop comes back
        progress.entered = progress.finished = progress.finished + 1
        m.watch(float(t))
    assert not caplog.records
    m.watch(29.0 + monitor.IDLE_FLOOR_S - 0.1)  # away for stall_s, but under the floor an idle loop may sleep
    assert not caplog.records
    m.watch(29.0 + monitor.IDLE_FLOOR_S)
    (line,) = (r.getMessage() for r in caplog.records)
    assert fields(line)["where"] == "between_rounds" and float(fields(line)["stalled_s"]) == monitor.IDLE_FLOOR_S


def test_a_busy_rank_is_stalled_after_stall_s_a_paused_idle_engine_never(progress, caplog):
    class Scheduler:
        _engine_paused = True  # SGLang's pause: its loop skips the round

    caplog.set_level(logging.WARNING, "sglang_dp_mtp_fix")
    progress.entered = progress.finished = 3
    progress.busy = False
    m = monitor.Monitor(stall_s=10)
    scheduler = Scheduler()
    m.scheduler = weakref.ref(scheduler)
    m.last_change = 0.0
    m.watch(100.0)
    assert not caplog.records
    progress.busy = True  # its last round had work: it is in the forward and never came back
    m.watch(101.0)
    assert fields(caplog.records[0].getMessage())["where"] == "after_mlp_sync"


def test_no_idle_stall_before_the_first_round(progress, caplog):
    caplog.set_level(logging.WARNING, "sglang_dp_mtp_fix")
    progress.entered = progress.finished = 0
    progress.busy = False
    m = monitor.Monitor(stall_s=10)
    m.last_change = 0.0
    m.watch(1000.0)  # the scheduler never reached its loop (a slow start is SGLang's watchdog's, not ours)
    assert not caplog.records


def test_stall_off_logs_nothing_and_the_metrics_hook_sees_every_tick(progress, caplog, mocker):
    caplog.set_level(logging.WARNING, "sglang_dp_mtp_fix")
    progress.entered, progress.finished = 2, 1
    m = monitor.Monitor(stall_s=None)
    m.on_tick = mocker.Mock()
    m.last_change = 0.0
    m.watch(1000.0)
    assert not caplog.records
    m.on_tick.assert_called_once_with(1000.0, False)


def test_the_thread_survives_a_failing_tick_and_stops_with_stop(monkeypatch, mocker):
    monkeypatch.setattr(monitor, "_TICK_S", 0.01)
    m = monitor.Monitor(stall_s=None)
    failing = mocker.patch.object(m, "tick", side_effect=RuntimeError("boom"))
    m.start()
    deadline = time.monotonic() + 10
    while failing.call_count < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert failing.call_count >= 3 and m.thread is not None and m.thread.daemon and m.thread.is_alive()
    m.stop()
    assert not m.thread.is_alive()


def test_a_scheduler_without_weak_references_still_gets_its_watcher(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(monitor, "_TICK_S", 0.01)
    try:
        m = monitor.start(dp_rank=1, scheduler=SimpleNamespace(_engine_paused=True))  # before: TypeError
        assert m.thread is not None and m.thread.is_alive() and m.dp_rank == 1 and not m.engine_paused()
    finally:
        monitor.stop()


def test_a_forked_child_starts_without_the_parents_monitor(monkeypatch):
    monkeypatch.setattr(monitor, "_TICK_S", 0.01)
    m = monitor.start()
    try:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.write(w, b"none" if monitor.active() is None else b"kept")
            finally:
                os._exit(0)
        os.close(w)
        assert os.read(r, 8) == b"none"
        os.waitpid(pid, 0)
        assert monitor.active() is m
    finally:
        monitor.stop()


@pytest.mark.parametrize(
    ("raw", "want"), [(None, 60.0), ("", 60.0), ("15", 15.0), ("2.5", 2.5), ("off", None), ("OFF", None)]
)
def test_stall_seconds_parse(raw, want):
    env = {} if raw is None else {STALL_ENV: raw}
    assert load_config([], env).stall_s == want


@pytest.mark.parametrize("raw", ["0", "-5", "1e3", "inf", "nan", "soon", "0.5", "100000"])
def test_stall_seconds_bad_input_is_a_clear_error(raw):
    error = load_config([], {STALL_ENV: raw}).error or ""
    assert f"{STALL_ENV}={raw!r} is not understood; accepted values: seconds" in error


def test_the_stall_lines_peers_are_never_this_ranks_own_older_files(tmp_path, monkeypatch):
    """Issue 54, finding 9: every stall line named this rank's own file from an earlier launch as a dead peer."""
    from sglang_dp_mtp_fix.diagnosis import recorder

    def rank_file(rank: int, pid: int) -> None:
        rec = recorder.Recorder(str(tmp_path), 4)
        rec.open(None, ranks=(rank, 2, rank, 2, rank))
        rec.close()
        raw = bytearray(Path(rec.path or "").read_bytes())
        fields = list(recfile.HEADER.unpack_from(raw, 0))
        fields[10] = pid  # an earlier launch's process (header field 10: the writer's pid)
        recfile.HEADER.pack_into(raw, 0, *fields)
        Path(rec.path or "").write_bytes(bytes(raw))

    rank_file(0, 1)  # this rank, an earlier launch
    rank_file(1, 1)  # the peer, an earlier launch too: stale
    me = recorder.Recorder(str(tmp_path), 4)
    me.open(None, ranks=(0, 2, 0, 2, 0))
    try:
        monkeypatch.setattr(recorder, "_active", me)
        stale, live, unread = monitor.peer_heartbeats()
        assert [s.split("(")[0] for s in stale] == ["dp1"] and live == [] and unread == 0, stale
    finally:
        me.close()


def test_the_stall_lines_peer_scan_reads_the_newest_files_first_and_stops_at_its_budget(tmp_path, monkeypatch):
    """Issue 54 (lower-harm): the scan read every file whole, in the thread that writes the heartbeat: 20,000 files
    of earlier launches paused the heartbeat ~4.7 s. Now headers only, newest first, for PEER_SCAN_BUDGET_S (a clock
    that moves 10 ms a look, so the budget ends after ~25 files, whatever this machine's speed)."""
    import shutil

    from sglang_dp_mtp_fix.diagnosis import recorder

    old = recorder.Recorder(str(tmp_path), 4)
    old.open(None, ranks=(1, 2, 1, 2, 1))
    old.close()
    for i in range(200):  # an earlier launch's files, a day old
        copy = tmp_path / f"sglang-dp-mtp-fix-old-dp1-{i}-00000000.rec"
        shutil.copyfile(old.path or "", copy)
        os.utime(copy, (time.time() - 86400, time.time() - 86400))
    os.unlink(old.path or "")
    peer, me = recorder.Recorder(str(tmp_path), 4), recorder.Recorder(str(tmp_path), 4)
    peer.open(None, ranks=(1, 2, 1, 2, 1))
    me.open(None, ranks=(0, 2, 0, 2, 0))
    ticks = iter(range(10**6))
    try:
        peer.heartbeat(1)
        monkeypatch.setattr(recorder, "_active", me)
        stale, live, unread = monitor.peer_heartbeats(clock=lambda: next(ticks) * 0.01)
        assert live == ["dp1"] and stale == [] and 150 < unread < 200, (stale, live, unread)
    finally:
        peer.close()
        me.close()

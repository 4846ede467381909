"""The decision flight recorder and ``rollcall`` (issue 23).

REAL: SGLang's MLP sync, ``_update_gather_batch``, ``ForwardBatch.init_new`` and ``EAGLEDraftCudaGraphRunner
.can_run_graph`` on the 4 gloo ranks of the shared ``rank_pool`` (the harness's stand-ins: ``harness/standins.py``),
with the plugin applied under ``SGLANG_DP_MTP_FIX_RECORDER_DIR``; the recorder's own file code in the other tests.
The injected divergence is the harness's TEST-ONLY ``_flip_draft_path`` switch: it turns one rank's draft path
around after the group's vote, as a bug elsewhere would.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from support import affected_only, release_free, written

from sglang_dp_mtp_fix import rollcall
from sglang_dp_mtp_fix.config import RECORDER_DIR_ENV
from sglang_dp_mtp_fix.diagnosis import reader, recfile, recorder
from sglang_dp_mtp_fix.errors import RecorderFileError

SEEDED = {"kind": "decode", "seed": True, "num_reqs": 3}


def apply_recording(pool: Any, directory: Path) -> None:
    pool.plugin({"command": "apply", "env": {RECORDER_DIR_ENV: str(directory)}})


def files(directory: Path) -> list[Path]:
    return sorted(directory.glob("sglang-dp-mtp-fix-*.rec"))


# --- on the 4-rank harness (real SGLang sync) --------------------------------------------------------------------


@affected_only
def test_injected_divergence_is_named_by_round_and_rank(rank_pool, tmp_path):
    apply_recording(rank_pool, tmp_path)
    try:
        trace = [[dict(SEEDED) for _ in range(4)] for _ in range(12)]
        trace[4][1] = {"kind": "decode", "seed": False, "num_reqs": 2}  # a seedless round: the vote forces eager
        trace[8][2]["_flip_draft_path"] = True  # round 9 as the recorder counts: rank 2 alone turns eager
        results = rank_pool.run_trace(trace, collective=False)
        assert [r.draft_path for r in results[8]] == ["graph", "graph", "eager", "graph"]  # the switch bites
        assert {r.draft_path for r in results[4]} == {"eager"}
        written(str(tmp_path), 4, 12)
        # the ranks run on (their heartbeats tick): the divergence is named, no rank as stopped (issue 33)
        data, code = rollcall.rollcall([str(tmp_path)])
    finally:
        rank_pool.plugin("restore")
    assert code == 1, data
    assert data["answer"] == (
        "round 9: ranks [0, 1, 3] draft graph (bucket 8), rank [2] eager (after a graph vote: decided outside the vote)"
    )
    assert [r["last_round"] for r in data["ranks"]] == [12] * 4 and not data["missing_ranks"]
    assert data["verdict"] == "diverge" and "stopped_ranks" not in data, data["answer"]
    # The seedless round before it is recorded as what it was: every rank eager, caused by rank 1's own batch.
    rank1 = reader.read_file(str(next(p for p in files(tmp_path) if "-dp1-" in p.name)))
    rank0 = reader.read_file(str(next(p for p in files(tmp_path) if "-dp0-" in p.name)))
    assert (
        rank1.records[5].as_dict()["draft_vote_sent"] is False and rank1.records[5].as_dict()["draft_path"] == "eager"
    )
    assert (
        rank0.records[5].as_dict()["draft_vote_sent"] is True
        and rank0.records[5].as_dict()["draft_vote_group"] is False
    )


@affected_only
def test_patched_arm_agrees_and_records_what_each_rank_did(rank_pool, tmp_path):
    from sglang_dp_mtp_fix.harness.fuzz import random_round

    rng = random.Random(23)
    trace = [random_round(rng, 4) for _ in range(60)]
    apply_recording(rank_pool, tmp_path)
    try:
        results = rank_pool.run_trace(trace, collective=False)
        written(str(tmp_path), 4, 60)
        data, code = rollcall.rollcall([str(tmp_path)], settle_s=0)
        by_rank = {f.dp_rank: f for f in map(reader.read_file, map(str, files(tmp_path)))}
    finally:
        rank_pool.plugin("restore")
    assert code == 0, data["answer"]
    assert data["answer"] == "all 4 ranks agreed up to round 60, the last round of every rank"
    recorded = 0
    for i, round_results in enumerate(results):
        for r in round_results:
            rec = by_rank[r.rank].records.get(i + 1)
            if not r.ran:
                continue
            recorded += 1
            got = rec.as_dict()
            assert got["draft_path"] == ("graph" if r.runner_graph else "eager"), (i, r, got)
            assert got["draft_vote_group"] == r.draft_vote and got["decode_vote_group"] == r.decode_graph
            assert got["tokens"] == r.num_tokens, (got, r)
    assert recorded > 100


@affected_only
def test_mixed_group_names_the_rank_without_a_file(rank_pool, tmp_path):
    from sglang_dp_mtp_fix.harness.pool import RankError

    command = {"command": "apply", "env": {RECORDER_DIR_ENV: str(tmp_path)}}
    rank_pool.plugin([command, command, command, "restore"])  # rank 3 runs without the plugin
    try:
        with pytest.raises(RankError, match="MixedDeploymentError"):
            rank_pool.run_trace([[dict(SEEDED) for _ in range(4)]], collective=False)
        data, code = rollcall.rollcall([str(tmp_path)], settle_s=0)
    finally:
        rank_pool.plugin("restore")
    assert code == 1 and data["missing_ranks"] == [3], data
    assert "DP rank [3] of 4 no file: the plugin or its recorder is not active there" in data["answer"]


def test_unset_builds_no_recording_code_and_creates_nothing(restored, tmp_path, monkeypatch):
    from sglang.srt.managers.scheduler_components import dp_attn
    from support import expected_status

    if expected_status() != "applied":
        pytest.skip("the vote is not applied on this release")
    monkeypatch.delenv(RECORDER_DIR_ENV, raising=False)
    restored.register()

    def vote_layer():  # draft_token_counts stacks on the vote's wrapper: look one layer in
        outer = dp_attn._update_gather_batch
        assert "draft_token_counts" in outer.__code__.co_filename
        return outer.__wrapped__

    assert recorder.active() is None and recorder.__file__ not in vote_layer().__code__.co_filename
    assert "draft_graph_vote" in vote_layer().__code__.co_filename
    restored.restore()
    monkeypatch.setenv(RECORDER_DIR_ENV, str(tmp_path))
    restored.register()
    assert recorder.active() is not None
    assert vote_layer().__code__.co_filename == recorder.__file__  # the recording wrapper is live
    assert files(tmp_path) == []  # created at the first MLP-sync round, when the ranks are known


def test_a_refused_directory_is_one_warning_and_strict_stops(restored, tmp_path, monkeypatch, caplog):
    from support import expected_status

    from sglang_dp_mtp_fix.errors import StrictModeAbort

    if expected_status() != "applied":
        pytest.skip("the vote is not applied on this release")
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    monkeypatch.setenv(RECORDER_DIR_ENV, str(link))
    restored.register()
    assert recorder.active() is None
    assert "flight recorder off: SGLANG_DP_MTP_FIX_RECORDER_DIR directory " in caplog.text
    assert "symbolic link" in caplog.text
    restored.restore()
    monkeypatch.setenv("SGLANG_DP_MTP_FIX", "strict")
    with pytest.raises(StrictModeAbort, match="symbolic link"):
        restored.register()


# --- the file and its reader --------------------------------------------------------------------------------------

GRAPH, EAGER = recorder.PATH_GRAPH | recorder.RUNNER_GATHERS, recorder.PATH_EAGER | recorder.RUNNER_GATHERS
ALL_YES = recorder.SENT_GENERIC | recorder.GROUP_GENERIC | recorder.SENT_DRAFT | recorder.GROUP_DRAFT


def write_rank(directory: Path, rank: int, size: int, paths: list[int], capacity: int = 16) -> recorder.Recorder:
    rec = recorder.Recorder(str(directory), capacity)
    rec.open(None, ranks=(rank, size, rank, size, rank))
    for path in paths:
        rec.enter()
        rec.sync(2, 2, ALL_YES)
        rec.draft_path(path, 8 if path & 3 == recorder.PATH_GRAPH else -1)
    rec.close()
    return rec


def test_a_round_stored_as_words_is_the_record_layout_byte_for_byte(tmp_path):
    """The writer stores 64-bit words (``recfile``, below ``RECORD``); the reader unpacks ``RECORD``: the same bytes, a
    negative bucket and a tokens count above 16 bits included, in a ring that has wrapped."""
    import struct

    rec = recorder.Recorder(str(tmp_path), 4)
    rec.open(None, ranks=(0, 1, 0, 1, 0))
    try:
        for path, bucket in [(GRAPH, 8)] * 5 + [(EAGER, -1)]:  # round 6 goes to the ring's second slot
            rec.enter()
            rec.sync(70_000 + rec.round, 7, ALL_YES)
            rec.draft_path(path, bucket)
        off = recfile.HEADER_SIZE + recfile.RECORD.size
        raw = bytes(rec.buf[off : off + recfile.RECORD.size])
    finally:
        rec.close()
    (ns,) = struct.unpack_from("<q", raw, 8)
    word = 70_006 | 7 << recfile.MODE_SHIFT | ALL_YES << recfile.FLAGS_SHIFT
    path_word = -1 & recfile.U32 | EAGER << recfile.PATH_SHIFT
    end, stamp = 6 | recfile.sync_check(ns, word), 6 | recfile.path_check(path_word)
    assert raw == recfile.RECORD.pack(6, ns, 70_006, 7, ALL_YES, end, -1, EAGER, stamp)
    assert 0 < ns <= time.monotonic_ns()


WRITER = """
import sys
from contextvars import ContextVar
from sglang_dp_mtp_fix.diagnosis import recorder, wiring
from sglang_dp_mtp_fix.config import Config

same = lambda *a, **k: None
wiring.configure(Config(recorder_dir=sys.argv[1], stall_s=None))  # the plugin's settings, as register() sets them
recorder.instrument(same, same, same, "d", "g", ContextVar("v"))
rec = recorder.active()  # the process's recorder, as a scheduler has it: open starts the heartbeat's write-out
rec.open(None, ranks=(3, 4, 3, 4, 3))
print("open", flush=True)
while True:
    rec.enter()
    rec.sync(rec.round % 1000, 2, recorder.SENT_GENERIC | recorder.GROUP_DRAFT)
    rec.draft_path(recorder.PATH_GRAPH, rec.round % 1000)
"""


class Writer:
    """A writer process (``WRITER``) and a wait for its file to move on."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(WRITER), str(directory)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline() == b"open\n"

    def newest(self) -> reader.RankFile | None:
        got = []
        for path in files(self.directory):
            try:
                got.append(reader.read_file(str(path)))
            except (OSError, RecorderFileError):  # cut by the test's own truncation, until rewritten
                continue
        return max(got, key=lambda f: (f.start_unix, f.last_round), default=None)

    def past(self, round_: int, timeout: float = 30) -> reader.RankFile:
        """Until the newest file of the writer holds a record after ``round_`` (the writer alive all along)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the writer died: {self.proc.returncode}, {self.proc.stderr.read()[-2000:]!r}")
            f = self.newest()
            if f is not None and f.last_round > round_:
                return f
            time.sleep(0.05)
        raise AssertionError(f"no record after round {round_} within {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def test_a_rank_killed_mid_run_leaves_a_readable_file(tmp_path):
    writer = Writer(tmp_path)
    try:
        writer.past(5000, 60)  # readable while it writes, too
        os.kill(writer.proc.pid, signal.SIGKILL)
        assert writer.proc.wait(30) == -signal.SIGKILL
    finally:
        writer.stop()
    dead = reader.read_file(str(files(tmp_path)[0]))
    assert dead.last_round > 5000 and dead.pid == writer.proc.pid and dead.dp_rank == 3
    assert len(dead.records) + dead.skipped == dead.capacity and dead.skipped <= 1  # at most the record being written
    for r, rec in dead.records.items():
        assert rec.tokens == r % 1000 and (rec.path is None or rec.bucket == r % 1000), rec


def test_the_writer_survives_its_file_truncated_chmodded_replaced_and_deleted(tmp_path):
    """Issue 45: what a log cleaner, ``: > file``, ``chmod`` or a copy tool does to a live file. Before, the ring was
    a shared map of the file: the truncation killed the writer with SIGBUS (seen: the writer died, -7)."""
    writer = Writer(tmp_path)
    try:
        first = writer.past(100)
        os.truncate(first.path, 0)
        again = writer.past(first.last_round)  # written whole again, in place
        assert again.path == first.path and os.path.getsize(first.path) == file_size(again)
        os.chmod(first.path, 0)
        chmodded = writer.past(again.last_round)
        assert chmodded.path == first.path
        os.chmod(first.path, 0o644)
        copy = tmp_path / "copy.tmp"
        copy.write_bytes(Path(first.path).read_bytes())
        os.replace(copy, first.path)  # a copy tool's replacement: our inode has no name left
        replaced = writer.past(chmodded.last_round)
        assert replaced.path != first.path and replaced.pid == writer.proc.pid
        data, _ = rollcall.rollcall([str(tmp_path)], settle_s=0)  # the copy left behind is an older file
        assert data["ranks"][0]["file"] == replaced.path and data["superseded"] == [first.path], data
        os.unlink(replaced.path)
        recreated = writer.past(replaced.last_round)
        assert recreated.path not in (first.path, replaced.path) and recreated.entered > replaced.entered
        assert writer.proc.poll() is None
    finally:
        writer.stop()


def file_size(f: reader.RankFile) -> int:
    return recfile.HEADER_SIZE + f.capacity * recfile.RECORD.size


def test_the_variable_takes_an_absolute_path_or_nothing():
    from sglang_dp_mtp_fix.config import load_config

    assert load_config([], {RECORDER_DIR_ENV: "/abs/dir"}).recorder_dir == "/abs/dir"
    assert load_config([], {RECORDER_DIR_ENV: " "}).recorder_dir is None
    error = load_config([], {RECORDER_DIR_ENV: "rel"}).error or ""
    assert f"{RECORDER_DIR_ENV}='rel' is not an absolute path" in error


# --- hardening (issue 33): a recorder that can never crash its scheduler -----------------------------------------

FULL_DISK_WRITER = """
import sys
from sglang_dp_mtp_fix.diagnosis import recorder
rec = recorder.Recorder(sys.argv[1])
rec.open(None, ranks=(0, 2, 0, 2, 0))
for _ in range(2 * rec.capacity):  # every slot of the ring, twice
    rec.enter()
    rec.sync(2, 2, recorder.SENT_GENERIC)
    rec.draft_path(recorder.PATH_GRAPH, 8)
print("rounds done, file", rec.path, flush=True)
"""


def test_a_full_filesystem_is_the_recorder_off_warning_never_a_sigbus(tmp_path):
    """A tmpfs of 8 KiB (two pages; the file needs four) in a private mount namespace (``unshare -rm``: no mount is
    left behind on the host). A sparse file (ftruncate alone) let the scheduler die with SIGBUS when the ring reached
    its first unallocated page (seen: rc -7 on the code before issue 33)."""
    import shutil

    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("no user+mount namespaces here (unshare -rm): no small filesystem to fill")
    mnt = tmp_path / "small"
    mnt.mkdir()
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(FULL_DISK_WRITER))
    shell = f'mount -t tmpfs -o size=8k tmpfs "{mnt}" && exec "{sys.executable}" "{script}" "{mnt}"'
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", shell], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])  # before: -7 (SIGBUS)
    assert "rounds done, file None" in proc.stdout, proc.stdout
    assert "flight recorder off on this scheduler" in proc.stderr and "No space left" in proc.stderr, proc.stderr


def test_a_stale_file_of_a_reused_pid_neither_turns_the_recorder_off_nor_is_read_as_current(tmp_path):
    """A restarted container reuses PIDs: the earlier process's file may carry this process's PID. Two recorders of
    one process stand for the two processes (same PID, same rank)."""
    old = write_rank(tmp_path, 0, 1, [EAGER] * 3)
    time.sleep(0.01)  # the new process starts later
    new = write_rank(tmp_path, 0, 1, [GRAPH] * 5)
    assert old.path and new.path and new.path != old.path  # before: the second open failed (O_EXCL), recorder off
    data, code = rollcall.rollcall([str(tmp_path)], settle_s=0)
    assert code == 0 and data["ranks"][0]["file"] == new.path and data["superseded"] == [old.path], data


def one_rank_recording(directory: Path, rounds: int) -> recorder.Recorder:
    """A 16-record recorder of a 1-rank group, its file open, ``rounds`` rounds recorded (no draft path)."""
    rec = recorder.Recorder(str(directory), 16)
    rec.open(None, ranks=(0, 1, 0, 1, 0))
    for _ in range(rounds):
        rec.enter()
        rec.sync(2, 2, ALL_YES)
    return rec


def test_a_forked_child_never_writes_into_the_parents_ring(tmp_path):
    rec = one_rank_recording(tmp_path, 3)
    try:
        assert rec.path is not None
        before = Path(rec.path).read_bytes()
        pid = os.fork()
        if pid == 0:  # the child: rounds of its own, then out without running pytest's teardown
            try:
                for _ in range(40):
                    rec.enter()
                    rec.sync(7, 2, ALL_YES)
                    rec.draft_path(recorder.PATH_EAGER, -1)
                rec.flush()  # the write-out: the child has no file of its own, and never the parent's
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert Path(rec.path).read_bytes() == before  # before: the child's rounds landed in the parent's file
    finally:
        rec.close()


@release_free  # the writer reads no SGLang
def test_the_writer_makes_a_new_file_when_its_file_is_moved_away_and_repairs_an_appended_one(tmp_path):
    """Issue 54, finding 2: ``mv *.rec archive/`` (nothing deletes old files), or a hard link then an unlink. Before,
    the writer kept writing to the moved inode, made no new file and said nothing: rollcall then called the rank
    missing. An appended-to file kept its tail for good."""
    writer = Writer(tmp_path)
    try:
        first = writer.past(10)
        archive = tmp_path / "archive"
        archive.mkdir()
        os.rename(first.path, archive / Path(first.path).name)
        moved = writer.past(first.last_round)
        assert moved.path != first.path and Path(moved.path).parent == tmp_path
        os.link(moved.path, archive / "linked.rec")
        os.unlink(moved.path)
        relinked = writer.past(moved.last_round)
        assert relinked.path not in (first.path, moved.path) and Path(relinked.path).parent == tmp_path
        with open(relinked.path, "ab") as f:
            f.write(b"\xff" * 4096)
        deadline = time.monotonic() + 30
        while os.path.getsize(relinked.path) != file_size(relinked) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.getsize(relinked.path) == file_size(relinked)
        data, _ = rollcall.rollcall([str(tmp_path)], settle_s=0)  # the writer's one rank: read from its live file
        assert [r["file"] for r in data["ranks"]] == [relinked.path], data
        writer.stop()
        assert b"was deleted, moved or replaced" in writer.proc.stderr.read()
    finally:
        writer.stop()


def test_a_file_that_cannot_be_made_again_is_one_warning_not_one_a_second(tmp_path, monkeypatch, caplog):
    """Issue 54, finding 9: the file deleted and the directory unwritable gave a WARNING every second (each try names
    a new random file, so the text never repeated)."""
    import errno
    import secrets

    from sglang_dp_mtp_fix import report
    from sglang_dp_mtp_fix.errors import ReportFileError

    def refused(directory: str, env_name: str, name: str, flags: int = os.O_WRONLY) -> tuple[int, str]:
        # STAND-IN: an unwritable directory (these tests run as root, whom permissions do not stop)
        path = f"{directory}/{secrets.token_hex(4)}.rec"
        raise ReportFileError(f"cannot create {path}: Permission denied") from PermissionError(errno.EACCES, "")

    rec = recorder.Recorder(str(tmp_path), 4)
    rec.open(None, ranks=(0, 1, 0, 1, 0))
    try:
        os.unlink(rec.path or "")
        monkeypatch.setattr(report, "create_in_directory", refused)
        with caplog.at_level(logging.WARNING, logger="sglang_dp_mtp_fix"):
            for _ in range(3):
                rec.flush()
        assert len([r for r in caplog.records if "not written" in r.getMessage()]) == 1, caplog.text
    finally:
        monkeypatch.undo()
        rec.close()


@release_free  # the writer reads no SGLang
def test_a_file_made_again_reads_true_before_its_next_heartbeat(tmp_path):
    """Issue 54, finding 9: the file made again got a new start, later than the heartbeat it carries over, so for
    about a second a healthy rank's file read "heartbeat before the file was opened" (a field that cannot be true)."""
    rec = one_rank_recording(tmp_path, 5)
    try:
        rec.heartbeat(1)
        first = reader.read_file(rec.path or "")
        os.unlink(rec.path or "")
        rec.heartbeat(2)  # the write-out makes the file again
        again = reader.read_file(rec.path or "")
        assert again.path != first.path and again.implausible == [], again.implausible
        assert (again.start_unix, again.start_mono, again.entered) == (first.start_unix, first.start_mono, 5)
    finally:
        rec.close()

"""``rollcall``: the reader and its verdicts, on files written by the real writer (``recorder.Recorder``)."""

from __future__ import annotations

import json
import os
import random
import struct
import threading
import time
from pathlib import Path

import pytest
from diagnosis.test_recorder import EAGER, GRAPH, files, write_rank
from support import release_free

from sglang_dp_mtp_fix import __version__, cli, rollcall
from sglang_dp_mtp_fix.diagnosis import reader, recfile, recorder, verdicts
from sglang_dp_mtp_fix.errors import RecorderFileError


def run_rollcall(capsys, *args: str) -> tuple[int, str]:
    code = cli.main(["rollcall", "--settle", "0", *args])
    return code, capsys.readouterr().out


def test_rollcall_exit_codes_text_and_json(tmp_path, capsys):
    agree, split, bad, mixed = (tmp_path / n for n in ("agree", "split", "bad", "mixed"))
    for d in (agree, split, bad, mixed):
        d.mkdir()
    for rank in range(2):
        write_rank(agree, rank, 2, [GRAPH] * 20)  # 20 rounds through a 16-slot ring: the last 16 are compared
        write_rank(split, rank, 2, [GRAPH] * 6 + [EAGER if rank else GRAPH] + [GRAPH] * 3)
    write_rank(mixed, 0, 2, [GRAPH] * 3)
    write_rank(mixed, 1, 4, [GRAPH] * 3)
    (bad / "sglang-dp-mtp-fix-x-dp0-1.rec").write_bytes(b"garbage")
    code, out = run_rollcall(capsys, str(agree))
    assert code == 0 and out.endswith("all 2 ranks agreed up to round 20, the last round of every rank\n"), out
    assert "DP rank 0: last round 20 (16 rounds kept, last entered 20)" in out
    code, out = run_rollcall(capsys, str(split), "--json")
    data = json.loads(out)
    assert code == 1 and data["divergence"]["round"] == 7 and data["verdict"] == "diverge"
    assert data["answer"] == "round 7: rank [0] draft graph (bucket 8), rank [1] eager (after a graph vote: decided " \
        "outside the vote)"  # fmt: skip
    code, out = run_rollcall(capsys, str(bad))
    assert code == 2 and "refused" in out and "truncated: 7 bytes" in out, out
    code, out = run_rollcall(capsys, str(mixed))
    assert code == 2 and "files from different deployments" in out, out
    code, out = run_rollcall(capsys, str(agree / "nothing-here"))
    assert code == 2 and "no such file" in out.lower(), out
    # One directory per node, read together; a rank still behind is named.
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir(), node1.mkdir()
    write_rank(node0, 0, 2, [GRAPH] * 5)
    write_rank(node1, 1, 2, [GRAPH] * 4)
    code, out = run_rollcall(capsys, str(node0), str(node1))
    assert code == 0 and "all 2 ranks agreed up to round 4; rank [1] never reached round 5" in out, out
    code, out = run_rollcall(capsys, str(node0))
    assert code == 1 and "DP rank [1] of 2 no file" in out, out


def test_forward_mode_values_are_sglangs():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    assert verdicts._MODES == {ForwardMode.DECODE.value, ForwardMode.IDLE.value}


def test_reader_refuses_truncated_garbage_and_foreign_files_and_reads_the_rest(tmp_path):
    good = tmp_path / "good"
    good.mkdir()
    for rank in range(2):
        write_rank(good, rank, 2, [GRAPH] * 10)
    valid = files(good)[0].read_bytes()
    junk = tmp_path / "junk"
    junk.mkdir()
    rng = random.Random(0)
    cases: dict[str, bytes] = {}
    for n in (0, 1, 8, 100, 255, 256, 257, len(valid) // 2, len(valid) - 1):
        cases[f"trunc{n}"] = valid[:n]
    cases["padded"] = valid + b"\0"
    for i in range(150):
        size = rng.choice((rng.randrange(0, 600), len(valid)))
        prefix = recfile.MAGIC if i % 2 else b""
        cases[f"garbage{i}"] = (prefix + rng.randbytes(size))[: max(size, len(prefix))]
    for i in range(300):
        flipped = bytearray(valid)
        for _ in range(rng.randrange(1, 4)):
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        cases[f"flip{i}"] = bytes(flipped)
    outcomes = {"read": 0, "refused": 0}
    for name, content in cases.items():
        path = junk / f"sglang-dp-mtp-fix-{name}.rec"
        path.write_bytes(content)
        try:
            reader.read_file(str(path))
            outcomes["read"] += 1
        except RecorderFileError:
            outcomes["refused"] += 1
    assert all(outcomes.values()), outcomes  # both kinds happen: the cases reach past the first check
    os.mkfifo(junk / "sglang-dp-mtp-fix-fifo.rec")  # never opened (would block)
    (junk / "sglang-dp-mtp-fix-link.rec").symlink_to(files(good)[0])
    (junk / "sglang-dp-mtp-fix-dir.rec").mkdir()
    for name in ("fifo", "link", "dir"):
        with pytest.raises(RecorderFileError, match="not a regular file"):
            reader.read_file(str(junk / f"sglang-dp-mtp-fix-{name}.rec"))
    (junk / "foreign.rec").write_bytes(b"PK\x03\x04" + bytes(2000))  # e.g. a zip someone named .rec
    with pytest.raises(RecorderFileError, match="not a flight-recorder file"):
        reader.read_file(str(junk / "foreign.rec"))
    with pytest.raises(RecorderFileError, match="truncated or padded: 300 bytes, the header promises 1024"):
        (junk / "t.rec").write_bytes(valid[:300])
        reader.read_file(str(junk / "t.rec"))
    # The good ranks are still read beside all of it (only the two good files are whole ranks of one deployment: the
    # bit-flipped copies that still read are rank 0's file again, older or newer, or another shape).
    data, code = rollcall.rollcall([str(good), str(junk)], settle_s=0)
    assert len(data["refused"]) >= outcomes["refused"] and code in (1, 2), data["answer"]
    data, code = rollcall.rollcall([str(good)], settle_s=0)
    assert code == 0 and len(data["ranks"]) == 2


# --- what the files hold bounds the reader; a field that cannot be true is named, never another rank's blame ------

ALL_YES = recorder.SENT_GENERIC | recorder.GROUP_GENERIC | recorder.SENT_DRAFT | recorder.GROUP_DRAFT
START_MONO = 56  # HEADER's monotonic start (ns), after magic, 4 u32, 6 i32 and the unix start
HOST = recfile.HEADER.size - 64


def patch(path: Path, offset: int, fmt: str, *values: object) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, *values))


def record_offset(path: Path, round_: int) -> int:
    """The file offset of ``round_``'s record (the ring's slot that holds it)."""
    raw = path.read_bytes()
    for off in range(recfile.HEADER_SIZE, len(raw), recfile.RECORD.size):
        if struct.unpack_from("<Q", raw, off)[0] == round_:
            return off
    raise AssertionError(f"no record of round {round_} in {path}")


def set_round(path: Path, offset: int, round_: int) -> None:
    """Both copies of the round of the record at ``offset``, the last with its check (``recfile``): a round that
    cannot be true in a record that is whole."""
    words = recfile.WORDS.unpack_from(path.read_bytes(), offset)
    patch(path, offset, "<Q", round_)
    patch(path, offset + 24, "<Q", round_ | recfile.sync_check(words[1], words[2]))


def rank_file(directory: Path, rank: int) -> Path:
    return next(p for p in files(directory) if f"-dp{rank}-" in p.name)


def idle_group(directory: Path, idle_to: int, ranks: int = 2, capacity: int = 16) -> None:
    """Every rank records 8 rounds, idles (the counter advances, nothing recorded) up to round ``idle_to - 8``, then
    records 8 more; each file's heartbeat says it has been open long enough for that many rounds (2 us a round)."""
    for rank in range(ranks):
        rec = recorder.Recorder(str(directory), capacity)
        rec.open(None, ranks=(rank, ranks, rank, ranks, rank))
        for i in range(16):
            if i == 8:
                rec.round = max(rec.round, idle_to - 8)
            rec.enter()
            rec.sync(2, 2, ALL_YES)
            rec.draft_path(GRAPH, 8)
        rec.close()
        path = Path(rec.path or "")
        (start_mono,) = struct.unpack_from("<q", path.read_bytes(), START_MONO)
        patch(path, recfile.HEARTBEAT_OFFSET, "<QdqQ", 1, time.time(), start_mono + idle_to * 2000, 1)


# Not a speed measurement: a guard against readers that never end. Each broken reader these tests were written
# against took minutes or never finished; a sound one takes well under a second. The bound is loose so that a
# contended CI machine cannot trip it (a 1 s bound once failed a landing at 1.24 s).
NEVER_ENDS_S = 20.0


def timed_rollcall(capsys, directory: Path, *args: str) -> tuple[int, str, float]:
    t0 = time.monotonic()
    code, out = run_rollcall(capsys, str(directory), *args)
    return code, out, time.monotonic() - t0


@pytest.mark.parametrize("idle_to", [10**8, 10**9])
def test_idle_rounds_cost_nothing(tmp_path, capsys, idle_to):
    """Before: one step per round number between the lowest and the highest (10^7 took 9 s, so 10^8 takes
    minutes; 10^9 never ended)."""
    idle_group(tmp_path, idle_to)
    code, out, took = timed_rollcall(capsys, tmp_path)
    assert code == 0 and out.endswith(f"all 2 ranks agreed up to round {idle_to}, the last round of every rank\n")
    assert took < NEVER_ENDS_S, took


@release_free
def test_a_full_65536_record_ring_is_read_in_linear_time(tmp_path, capsys):
    """Before: the latest round was looked up once per record (quadratic: a 65,536-record file did not finish)."""
    for rank in range(2):
        write_rank(tmp_path, rank, 2, [GRAPH] * (recfile.MAX_CAPACITY + 5), capacity=recfile.MAX_CAPACITY)
    code, out, took = timed_rollcall(capsys, tmp_path, "--json")
    data = json.loads(out)
    assert code == 0 and data["ranks"][0]["records"] == recfile.MAX_CAPACITY, data["answer"]
    assert took < NEVER_ENDS_S, took


@pytest.mark.parametrize(
    ("what", "corrupt"),
    [
        ("round_max_one_copy", lambda p: patch(p, record_offset(p, 20), "<Q", 2**64 - 1)),
        ("round_max", lambda p: set_round(p, record_offset(p, 20), recfile.ROUND_MASK)),
        ("round_ahead", lambda p: set_round(p, record_offset(p, 20), 21)),
        ("entered_max", lambda p: patch(p, recfile.ENTERED_OFFSET, "<Q", 2**64 - 1)),
        ("entered_far", lambda p: patch(p, recfile.ENTERED_OFFSET, "<Q", 10**12)),
    ],
)
def test_a_field_that_cannot_be_true_is_named_and_never_blames_another_rank(tmp_path, capsys, what, corrupt):
    """Before: one corrupted round in rank 0's file made rollcall blame the healthy rank 1 ("never reached round 21"),
    and a round field of 2^64-1 never finished."""
    for rank in range(2):
        write_rank(tmp_path, rank, 2, [GRAPH] * 20)
    corrupt(rank_file(tmp_path, 0))
    code, out, took = timed_rollcall(capsys, tmp_path, "--json")
    data = json.loads(out)
    assert took < NEVER_ENDS_S, took
    assert "never_reached" not in data and "behind_ranks" not in data and "divergence" not in data, data["answer"]
    rank0, rank1 = data["ranks"]
    assert rank1["implausible"] == [] and (rank0["implausible"] or what == "round_max_one_copy"), data["ranks"]
    # a record cut in one copy is a half-written record (skipped); one whose copies agree on a round that cannot be
    # true is named
    assert code == (0 if what == "round_max_one_copy" else 2), data["answer"]
    code, out = run_rollcall(capsys, str(tmp_path))
    assert "cannot be true, not used: " in out or what == "round_max_one_copy", out


@pytest.mark.parametrize(
    ("offset", "fmt", "value"),
    [
        (48, "<d", float("nan")), (48, "<d", float("inf")), (48, "<d", -1e300), (48, "<d", 1e300),
        (recfile.HEARTBEAT_OFFSET, "<QdqQ", (3, float("nan"), 5, 3)),
        (recfile.HEARTBEAT_OFFSET, "<QdqQ", (3, float("-inf"), 5, 3)),
        (recfile.HEARTBEAT_OFFSET, "<QdqQ", (3, 1e19, -1, 3)),
    ],
)  # fmt: skip
def test_time_fields_that_are_not_times_give_no_traceback_and_strict_json(tmp_path, capsys, offset, fmt, value):
    """Before: a time.gmtime traceback, and --json printed NaN/Infinity (not JSON)."""
    for rank in range(2):
        write_rank(tmp_path, rank, 2, [GRAPH] * 3)
    patch(rank_file(tmp_path, 1), offset, fmt, *(value if isinstance(value, tuple) else (value,)))
    code, out = run_rollcall(capsys, str(tmp_path), "--json")

    def refuse(token: str) -> None:
        raise AssertionError(f"not strict JSON: {token}")

    data = json.loads(out, parse_constant=refuse)
    assert code == 2 and data["ranks"][1]["implausible"] and not data["ranks"][0]["implausible"], data
    code, out = run_rollcall(capsys, str(tmp_path))
    assert code == 2 and "cannot be true, not used: " in out, out


def test_every_printed_field_is_escaped(tmp_path, capsys):
    """Before: host and version fields from a file reached the terminal raw (escape sequences included)."""
    for rank in range(2):
        write_rank(tmp_path, rank, 2, [GRAPH] * 3)
    patch(rank_file(tmp_path, 1), HOST, "64s", b"evil\x1b]0;pwned\x07\x1b[2J\r\nhost")
    weird = tmp_path / "sglang-dp-mtp-fix-\x1b[31m.rec"
    weird.write_bytes(b"junk")
    code, out = run_rollcall(capsys, str(tmp_path))
    assert not any(not c.isprintable() for c in out.replace("\n", "")), repr(out)
    assert "evil\\x1b]0;pwned\\x07\\x1b[2J\\r\\nhost" in out and "sglang-dp-mtp-fix-\\x1b[31m.rec" in out, out
    assert json.loads(run_rollcall(capsys, str(tmp_path), "--json")[1])["ranks"][1]["host"].startswith("evil\x1b")


def test_one_file_named_twice_is_read_once_and_a_bad_dp_rank_is_refused(tmp_path, capsys):
    """Before: the same file named twice was "an older file" of itself; a negative DP rank was reported as is."""
    for rank in range(2):
        write_rank(tmp_path, rank, 2, [GRAPH] * 3)
    one = rank_file(tmp_path, 0)
    code, out = run_rollcall(capsys, str(tmp_path), str(one), "--json")
    data = json.loads(out)
    assert code == 0 and data["superseded"] == [] and data["notes"] == [f"{one}: the same file as {one} (read once)"]
    patch(one, 24, "<i", -1)
    code, out = run_rollcall(capsys, str(tmp_path))
    assert code == 1 and f"refused {one}: corrupt header: dp rank -1 is not tp rank 0's" in out, out


def test_mixed_versions_are_named(tmp_path, capsys):
    """Before: files of different plugin and SGLang versions were compared as one group without a word."""
    for rank in range(2):
        write_rank(tmp_path, rank, 2, [GRAPH] * 3)
    patch(rank_file(tmp_path, 1), 64, "32s32s", b"0.0.1", b"0.5.99")
    code, out = run_rollcall(capsys, str(tmp_path), "--json")
    data = json.loads(out)
    assert code == 1 and data["verdict"] == "mixed_versions" and set(data["mixed_versions"]) == {"plugin", "sglang"}
    assert data["mixed_versions"]["plugin"]["0.0.1"] == [1] and "different versions (plugin " in data["answer"]


class Ticker:
    """A heartbeat that ticks in a file (the monitor's store), ``skew_s`` off this host's clock."""

    def __init__(self, path: Path, skew_s: float) -> None:
        self.path, self.skew_s, self.stop = path, skew_s, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        ticks = 0
        while not self.stop.wait(0.05):
            ticks += 1
            patch(self.path, recfile.HEARTBEAT_OFFSET, "<QdqQ", ticks, time.time() + self.skew_s, 1, ticks)


@release_free
def test_liveness_is_each_files_own_counter_never_a_clock_of_another_host(tmp_path, capsys, monkeypatch):
    """Before: a live rank on a node whose clock is 60 s behind was called stopped (wall times compared across
    hosts)."""
    for rank in range(2):
        write_rank(tmp_path, rank, 2, [GRAPH] * 3)
    far = rank_file(tmp_path, 1)
    patch(far, HOST, "64s", b"node-b")
    tickers = [Ticker(rank_file(tmp_path, 0), 0.0), Ticker(far, -60.0)]
    try:
        code, out = run_rollcall(capsys, str(tmp_path), "--settle", "0.5", "--json")
        data = json.loads(out)
        assert not any(r["stopped"] for r in data["ranks"]) and "stopped_ranks" not in data, data["answer"]
        assert all(r["heartbeat_ticked"] for r in data["ranks"]), data["ranks"]
        assert code == 1 and data["verdict"] == "stall_outside_vote", data["answer"]  # ticking, no round advances
        code, out = run_rollcall(capsys, str(tmp_path), "--json")  # not watched: no clock compared across hosts
        assert "stopped_ranks" not in json.loads(out), out
        tickers[1].stop.set()  # node-b's rank stops ticking: named (by its counter) after the watch
        tickers[1].thread.join()
        monkeypatch.setattr(reader, "HEARTBEAT_STALE_S", 1.0)  # the watch's bound
        monkeypatch.setattr(verdicts, "HEARTBEAT_STALE_S", 1.0)  # and the liveness verdict's
        code, out = run_rollcall(capsys, str(tmp_path), "--settle", "0.5", "--json")
        data = json.loads(out)
        assert code == 1 and data["stopped_ranks"] == [1], data["answer"]
        assert "DP rank 1 stopped: its heartbeat stopped (another host or boot" in data["answer"], data["answer"]
        assert "no tick while the others ticked" in data["answer"]
    finally:
        for t in tickers:
            t.stop.set()
            t.thread.join()


def write_out(directory: Path, rank: int, ticks: int, wall: float) -> None:
    """A heartbeat's write-out of ``rank``'s file at ``wall`` (its monotonic time 1 s after the file opened)."""
    path = rank_file(directory, rank)
    (start_mono,) = struct.unpack_from("<q", path.read_bytes(), START_MONO)
    patch(path, recfile.HEARTBEAT_OFFSET, "<QdqQ", ticks, wall, start_mono + 10**9, ticks)


def copied_files_answer(directory: Path, capsys, ranks: dict[int, tuple[int, float]]) -> tuple[int, dict]:
    """``rollcall --json`` over files of ``rank: (rounds, seconds since its write-out)``, not watched (copied files)."""
    now = time.time()
    for rank, (rounds, age) in ranks.items():
        write_rank(directory, rank, 3, [GRAPH] * rounds)
        write_out(directory, rank, 1, now - age)
    code, out = run_rollcall(capsys, str(directory), "--json")
    return code, json.loads(out)


@release_free
def test_the_write_out_lag_is_against_the_newest_file_that_holds_the_round(tmp_path, capsys):
    """Two files hold round 5, written out at different moments: the lag is counted from the newer one. Before: from
    whichever file came last (rank 1's, 0.6 s older), so 0.4 s instead of 1.0 s."""
    code, data = copied_files_answer(tmp_path, capsys, {0: (5, 0.0), 1: (5, 0.6), 2: (4, 1.0)})
    assert code == 0 and data["never_reached"] == [2], data["answer"]
    assert "rank [2] never reached round 5 (its file was written out 1.0 s before the newest)" in data["answer"]


@release_free
def test_a_lag_under_a_tenth_of_a_second_is_said_in_ms_for_several_ranks(tmp_path, capsys):
    """Eight ranks' heartbeats start together and stay in phase, so a busy group's files are written out within tens of
    ms and 17-ms rounds still leave some a round behind. Before: "(their files were up to written out 0.0 s before the
    newest)" (a real DP8 soak on a GPU, 2026-12-07)."""
    code, data = copied_files_answer(tmp_path, capsys, {0: (5, 0.0), 1: (4, 0.04), 2: (4, 0.01)})
    assert code == 0 and data["never_reached"] == [1, 2], data["answer"]
    assert (
        "ranks [1, 2] never reached round 5 (their files were written out up to 40 ms before the newest)"
        in (data["answer"])
    ), data["answer"]


@release_free
def test_a_live_rank_whose_file_lags_by_a_write_out_is_not_named_behind(tmp_path, capsys):
    """Files are written out once a second, each at its own moment: rank 1's file still says round 4 when rank 0's
    says 5, and says 5 on its next write-out. Before: "rank [1] never reached round 5" on a healthy group (seen in a
    real soak, read right after traffic). The watch re-reads the entered rounds, so a rank that gets there while
    watched is not named; a copy (not watched) still is, with its write-out lag beside it."""
    write_rank(tmp_path, 0, 2, [GRAPH] * 5)
    write_rank(tmp_path, 1, 2, [GRAPH] * 4)

    def beat(rank: int, ticks: int, wall: float) -> None:
        write_out(tmp_path, rank, ticks, wall)

    now = time.time()
    beat(0, 1, now)
    beat(1, 1, now - 0.6)
    code, out = run_rollcall(capsys, str(tmp_path), "--json")  # copies: not watched
    data = json.loads(out)
    assert code == 0 and data["never_reached"] == [1], data["answer"]
    assert "rank [1] never reached round 5 (its file was written out 0.6 s before the newest)" in data["answer"]
    stop = threading.Event()

    def live() -> None:  # rank 0 ticks; rank 1's next write-out says round 5
        for ticks in range(2, 1000):
            beat(0, ticks, time.time())
            if ticks == 3:
                patch(rank_file(tmp_path, 1), recfile.ENTERED_OFFSET, "<Q", 5)
                beat(1, 2, time.time())
            if stop.wait(0.1):
                return

    thread = threading.Thread(target=live, daemon=True)
    thread.start()
    try:
        code, out = run_rollcall(capsys, str(tmp_path), "--settle", "0.6", "--json")
    finally:
        stop.set()
        thread.join()
    data = json.loads(out)
    assert code == 0 and "never_reached" not in data, data["answer"]
    assert "rank [1] entered round 5 without a record of it" in data["answer"], data["answer"]


START_UNIX = 48  # HEADER's unix start (s), before START_MONO


@release_free
def test_a_rank_is_read_from_its_liveliest_file_not_the_one_that_started_last(tmp_path, capsys):
    """Two files of DP rank 1 from one running process: a stale one that says it started later (a clock corrected,
    or a copy), and the one whose heartbeat is newer and that holds every round. rollcall reads the second (the
    running process, then the heartbeat, then the progress). Before: the later start won, and rank 1 "never reached"
    round 8 (or a tie went to listing order)."""
    now = time.time()
    write_rank(tmp_path, 0, 2, [GRAPH] * 8)
    write_out(tmp_path, 0, 1, now)
    write_rank(tmp_path, 1, 2, [GRAPH] * 3)
    (stale,) = [p for p in files(tmp_path) if "-dp1-" in p.name]
    write_rank(tmp_path, 1, 2, [GRAPH] * 8)
    (live,) = [p for p in files(tmp_path) if "-dp1-" in p.name and p != stale]
    for path, wall, start in ((stale, now - 60, now + 30), (live, now, now - 30)):
        (start_mono,) = struct.unpack_from("<q", path.read_bytes(), START_MONO)
        patch(path, recfile.HEARTBEAT_OFFSET, "<QdqQ", 1, wall, start_mono + 10**9, 1)
        patch(path, START_UNIX, "<d", start)
    code, out = run_rollcall(capsys, str(tmp_path), "--json")
    data = json.loads(out)
    assert code == 0 and data["superseded"] == [str(stale)], data["answer"]
    assert data["answer"].startswith("all 2 ranks agreed up to round 8"), data["answer"]


@release_free
def test_older_files_of_another_deployment_are_set_aside_with_a_note(tmp_path, capsys):
    """Yesterday's files of a DP4 group beside today's DP2 group, whose processes are gone: today's group is judged
    and the others are named in a note. Before: "files from different deployments", exit 2, until someone deleted
    them. Two deployments whose processes both run stay refused (test_rollcall_exit_codes_text_and_json)."""
    for rank in range(2):
        write_rank(tmp_path, rank, 2, [GRAPH] * 5)
    for rank in range(4):
        write_rank(tmp_path, rank, 4, [GRAPH] * 3)
    now = time.time()
    for path in files(tmp_path):
        dp4 = struct.unpack_from("<i", path.read_bytes(), 28)[0] == 4  # the header's dp size
        (start_mono,) = struct.unpack_from("<q", path.read_bytes(), START_MONO)
        patch(path, recfile.HEARTBEAT_OFFSET, "<QdqQ", 1, now - (86400 if dp4 else 0), start_mono + 10**9, 1)
        if dp4:  # a process that is gone: another PID's start time
            patch(path, recfile.PROC_START_OFFSET, "<Q", 1)
    code, out = run_rollcall(capsys, str(tmp_path), "--json")
    data = json.loads(out)
    assert code == 0 and data["size"] == 2, data["answer"]
    assert data["notes"] == ["4 file(s) of another deployment (dp size, tp size not (2, 2)) ignored: the newest "
                             "files are this one's"]  # fmt: skip


@release_free
def test_a_split_between_two_ranks_is_found_where_a_third_ring_no_longer_reaches(tmp_path, capsys):
    """Ranks 0 and 1 hold round 3, where they took different draft paths; rank 2's smaller ring holds only rounds
    7-10. The split is named. Before: only rounds every ring held were compared, and "all 3 ranks agreed"."""
    for rank in range(2):
        write_rank(tmp_path, rank, 3, [GRAPH] * 2 + [EAGER if rank else GRAPH] + [GRAPH] * 7)
    write_rank(tmp_path, 2, 3, [GRAPH] * 10, capacity=4)
    code, out = run_rollcall(capsys, str(tmp_path), "--json")
    data = json.loads(out)
    assert code == 1 and data["divergence"]["round"] == 3, data["answer"]
    assert [g["ranks"] for g in data["divergence"]["groups"]] == [[0], [1]], data["divergence"]


@release_free
@pytest.mark.parametrize(
    ("what", "bit"),
    [
        ("group_draft_vote", 8 * 16 + recfile.FLAGS_SHIFT + 3),  # word 2: the group's draft vote (GROUP_DRAFT)
        ("draft_path", 8 * 32 + recfile.PATH_SHIFT),  # word 4: the draft path graph -> none (no draft step)
    ],
)
def test_a_flipped_bit_is_a_damaged_record_never_a_divergence(tmp_path, capsys, what, bit):
    """Issue 54 (lower-harm): the records had no check, so one bit flipped in rank 0's round 7 (a disk, memory, a
    stray write) read as that rank deciding otherwise: "diverge", exit 1, blaming a rank that did nothing."""
    for rank in range(2):
        write_rank(tmp_path, rank, 2, [GRAPH] * 10)
    path = rank_file(tmp_path, 0)
    offset = record_offset(path, 7) + bit // 8
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 1 << bit % 8
    path.write_bytes(bytes(raw))
    code, out = run_rollcall(capsys, str(tmp_path), "--json")
    data = json.loads(out)
    assert "divergence" not in data and code == 2, data["answer"]
    (named,) = data["ranks"][0]["implausible"]
    assert named["field"] == "record_check" and named["value"] == 7, named
    assert data["ranks"][1]["implausible"] == [], data["ranks"][1]


@release_free
def test_a_file_of_another_format_names_the_plugin_version_that_reads_it(tmp_path, capsys):
    """Before: "use the plugin version that wrote it", on a bad night with nothing to say which one that was."""
    write_rank(tmp_path, 0, 1, [GRAPH] * 3)
    (path,) = files(tmp_path)
    patch(path, 8, "<I", recfile.FORMAT_VERSION - 1)  # the header's format version, as an older plugin wrote it
    code, out = run_rollcall(capsys, str(tmp_path), "--json")
    (refused,) = json.loads(out)["refused"]
    assert code == 2 and f"read it with plugin {__version__}'s rollcall" in refused["reason"], refused


@release_free
def test_a_refused_file_named_twice_is_refused_once(tmp_path, capsys):
    """Before: the directory given twice (a shell glob, a copy-paste) listed every refused file twice."""
    write_rank(tmp_path, 0, 1, [GRAPH] * 3)
    (path,) = files(tmp_path)
    patch(path, 8, "<I", recfile.FORMAT_VERSION - 1)
    code, out = run_rollcall(capsys, str(tmp_path), str(tmp_path), "--json")
    data = json.loads(out)
    assert [r["file"] for r in data["refused"]] == [str(path)] and code == 2, data["refused"]
    assert data["notes"] == [f"{path}: the same file as {path} (read once)"], data["notes"]

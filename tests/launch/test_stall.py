"""A DP rank that stops, in a real CPU launch (issue 33): the tier's shape (DP attention 2, PD decode, NEXTN MTP) with
the flight recorder and a short ``SGLANG_DP_MTP_FIX_STALL_S``. One launch serves the four checks, in order:

0. Both ranks alive, held in the same round (the test-only ``probes/launch_hold_probe`` holds DP rank 0's main thread
   before its batch; its peer blocks in the forward's collectives): ``rollcall`` says the stall is outside the vote;
1. SIGSTOP DP rank 1's scheduler with a request in flight on each rank: within STALL_S + 5 s DP rank 0's log has the
   stall line naming its round, and ``rollcall`` exits 1 naming DP rank 1 as frozen;
2. SIGCONT: DP rank 0 logs the recovery line, the requests in flight complete and a new one is served;
2b. (issue 45; the launch sleeps on idle, ``--sleep-on-idle``) the group idle for longer than the idle threshold: no
   stall line; then SIGSTOP DP rank 1 while idle and send DP rank 0 a request: DP rank 0's stall line,
   ``where=between_rounds``, within the threshold + 5 s; SIGCONT serves the request;
3. SIGKILL DP rank 1's scheduler: ``rollcall`` names it dead.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
from launchlib import base_env, post_generate, start_server
from releases import AFFECTED, LAUNCHES_HERE, NOT_YET, SGLANG_VERSION, SUPERSEDED
from soaklib import probe_pythonpath

from sglang_dp_mtp_fix import rollcall
from sglang_dp_mtp_fix.diagnosis import reader
from sglang_dp_mtp_fix.diagnosis.monitor import IDLE_FLOOR_S
from sglang_dp_mtp_fix.diagnosis.recfile import HEARTBEAT_PERIOD_S, HEARTBEAT_STALE_S

# A patched release, and one where SGLang's own vote decides (upstream_vote_watch)
STALL_RELEASES = ("0.5.20", "0.5.23")
pytestmark = [
    pytest.mark.skipif(
        SGLANG_VERSION not in LAUNCHES_HERE,
        reason=f"SGLang {SGLANG_VERSION} does not launch on CPU here yet: {NOT_YET.get(SGLANG_VERSION, 'not tried')}",
    ),
    pytest.mark.skipif(
        SGLANG_VERSION not in (*AFFECTED, *SUPERSEDED),
        reason="the stall watcher rides on a draft vote (the plugin's, or SGLang's own from 0.5.21)",
    ),
    # One launch in CI's budget; LAUNCH_STALL_ANY_RELEASE=1 runs it on any release that launches (0.5.17 was run so)
    pytest.mark.skipif(
        SGLANG_VERSION not in STALL_RELEASES and not os.environ.get("LAUNCH_STALL_ANY_RELEASE"),
        reason=f"one launch in CI: the stall scenario runs on {', '.join(STALL_RELEASES)}",
    ),
]

# The stall line names a peer as stale once its heartbeat is older than HEARTBEAT_STALE_S: with STALL_S equal to it,
# a peer that beat just before its SIGSTOP can still read as live when the line comes. Three heartbeat periods later.
STALL_S = int(HEARTBEAT_STALE_S + 3 * HEARTBEAT_PERIOD_S)
STOPPED_RANK, LIVE_RANK = 1, 0
STALL_LINE = re.compile(rf"sglang-dp-mtp-fix: stall: (?P<fields>dp_rank={LIVE_RANK} [^\n]*)")
RECOVERY_LINE = re.compile(rf"sglang-dp-mtp-fix: stall over: (?P<fields>dp_rank={LIVE_RANK} [^\n]*)")
ANY_STALL_LINE = re.compile(r"sglang-dp-mtp-fix: stall: (?P<fields>dp_rank=[^\n]*)")
IN_FLIGHT_TOKENS = 96
# An idle rank's threshold (monitor.IDLE_FLOOR_S at least), and the idle watch: past it by two ticks
IDLE_THRESHOLD_S = max(STALL_S, IDLE_FLOOR_S)
IDLE_WATCH_S = IDLE_THRESHOLD_S + 2 * HEARTBEAT_PERIOD_S


def _fields(text: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in text.split())


def _request(port: int, rank: int, room: int, tokens: int) -> dict:
    body = {
        "routed_dp_rank": rank,
        "bootstrap_host": "2.2.2.2",  # SGLang's fake-transfer marker (PD decode), never contacted
        "bootstrap_room": room,
        "input_ids": [1, 5 + room % 50, 6, 7],
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
    }
    return post_generate(port, body, timeout=240)


def _wait_for(what: str, predicate, timeout: float, log=lambda: ""):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.2)
    pytest.fail(f"{what}: not within {timeout:g} s; log tail:\n{log()[-3000:]}")


@dataclass
class StallRun:
    stopped_pid: int
    stall_after_s: float
    stall_fields: dict[str, str]
    recovery_fields: dict[str, str]
    held: tuple[dict, int]
    frozen: tuple[dict, int]
    in_flight: list[dict]
    after: dict
    dead: tuple[dict, int]
    log: str  # from the stop to phase 2b
    idle: IdleRun
    notes: list[str] = field(default_factory=list)


@dataclass
class IdleRun:
    """Phase 2b (issue 45): the group idle and asleep (``--sleep-on-idle``), then DP rank 1 frozen while idle."""

    rounds_per_s: list[float]  # each rank's entered rounds per second while idle: asleep, yet its loop comes back
    asleep_lines: list[dict[str, str]]  # stall lines of any rank while the group slept (none)
    stall_after_s: float
    stall_fields: dict[str, str]
    recovery_fields: dict[str, str]
    waiting_done_while_frozen: bool
    served: dict


def _idle_freeze(server, ranks: dict[int, reader.RankFile], stopped_pid: int) -> IdleRun:  # noqa: ANN001
    """The group idle, every rank asleep between rounds, longer than any stall threshold: no stall line. Then DP rank
    1 frozen while idle and a request sent to DP rank 0: its stall line, where=between_rounds; SIGCONT serves it."""
    mark = len(server.log)
    before = [reader.read_file(ranks[r].path).entered for r in (0, 1)]
    t0 = time.monotonic()
    time.sleep(IDLE_WATCH_S)  # the only wait that is a duration: the absence of a line is what is checked
    after = [reader.read_file(ranks[r].path).entered for r in (0, 1)]
    rates = [(a - b) / (time.monotonic() - t0) for a, b in zip(after, before, strict=True)]
    asleep = [_fields(m["fields"]) for m in ANY_STALL_LINE.finditer(server.log, mark)]
    mark = len(server.log)
    os.kill(stopped_pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(_request, server.port, LIVE_RANK, 6200, 8)
            try:
                match = _wait_for("the idle stall line", lambda: STALL_LINE.search(server.log, mark),
                                  IDLE_THRESHOLD_S + 20, lambda: server.log)  # fmt: skip
                stall_after_s = time.monotonic() - stopped_at
                done_while_frozen = waiting.done()
            finally:
                os.kill(stopped_pid, signal.SIGCONT)
            recovery = _wait_for("the idle recovery line", lambda: RECOVERY_LINE.search(server.log, mark), 60,
                                 lambda: server.log)  # fmt: skip
            served = waiting.result(timeout=240)
    finally:
        os.kill(stopped_pid, signal.SIGCONT)
    return IdleRun(rates, asleep, stall_after_s, _fields(match["fields"]), _fields(recovery["fields"]),
                   done_while_frozen, served)  # fmt: skip


def _written_out(path: str) -> reader.RankFile:
    """The file once written out after this call (two heartbeats: the ring goes out with each, issue 45), so it holds
    every round its rank ran before the call."""
    ticks = reader.read_file(path).heartbeat_ticks
    return _wait_for("a write-out", lambda: (f := reader.read_file(path)).heartbeat_ticks >= ticks + 2 and f, 30)


def _hold_both_in_one_round(server, ranks: dict[int, reader.RankFile], hold_file) -> tuple[dict, int]:  # noqa: ANN001
    """Phase 0: hold DP rank 0 before its batch while a request decodes on each rank; once neither rank's entered
    round moves, ``rollcall`` (its own settle window) must find both alive in one round. Released before the return,
    and shorter than STALL_S, so no stall line of its own."""

    def entered() -> tuple[int, ...]:
        return tuple(reader.read_file(ranks[r].path).entered for r in (0, 1))

    def written() -> tuple[tuple[int, ...], tuple[int, ...]]:  # (entered, heartbeat ticks) of both files
        files = [reader.read_file(ranks[r].path) for r in (0, 1)]
        return tuple(f.entered for f in files), tuple(f.heartbeat_ticks for f in files)

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(_request, server.port, rank, 5000 + rank, 48) for rank in (0, 1)]
        base = entered()
        _wait_for("both ranks decoding", lambda: min(a - b for a, b in zip(entered(), base, strict=True)) > 2, 120,
                  lambda: server.log)  # fmt: skip
        hold_file.touch()
        try:
            held_marker = hold_file.with_name(hold_file.name + ".held")
            _wait_for("the probe holding DP rank 0", held_marker.exists, 60, lambda: server.log)
            last = [written()]

            def settled() -> bool:  # its peer has reached the same round's forward and waits there
                time.sleep(0.5)
                last.append(written())
                same = list(itertools.takewhile(lambda w: w[0] == last[-1][0], reversed(last)))
                # unchanged across two write-outs of each file (the ring goes out with each heartbeat: issue 45)
                return len(same) > 2 and all(a - b >= 2 for a, b in zip(same[0][1], same[-1][1], strict=True))

            _wait_for("the held ranks' rounds to stop moving", settled, 30, lambda: server.log)
            held = rollcall.rollcall([os.path.dirname(ranks[0].path)])
        finally:
            hold_file.unlink()
        outputs = [f.result(timeout=240) for f in futures]
    assert [len(o["output_ids"]) for o in outputs] == [48, 48], outputs  # released: both complete
    return held


@pytest.fixture(scope="module")
def run(gaps_path, launch_tmp, launch_timings) -> StallRun:
    rec_dir = launch_tmp / "stall-recorder"
    rec_dir.mkdir()
    hold_file = launch_tmp / "stall-hold"
    path = probe_pythonpath(gaps_path, launch_tmp / "hold-probe-entry-point", "launch_hold_probe")
    env = base_env(path, SGLANG_DP_MTP_FIX_RECORDER_DIR=str(rec_dir), SGLANG_DP_MTP_FIX_STALL_S=str(STALL_S),
                   LAUNCH_HOLD_PROBE_FILE=str(hold_file), LAUNCH_HOLD_PROBE_RANK=str(LIVE_RANK))  # fmt: skip
    env["SGLANG_PLUGINS"] += ",launch_hold_probe"
    # Asleep on idle: the idle phase shows a sleeping group raises no stall line (issue 45)
    server = start_server("stall", launch_tmp, env, extra_args=["--sleep-on-idle"])
    stopped_pid = None
    try:
        t0 = time.monotonic()
        if not server.wait_ready():
            pytest.fail(f"stall: server never became ready; log tail:\n{server.log[-4000:]}")
        launch_timings["stall_ready"] = round(server.ready_s or 0, 1)

        def files() -> dict[int, reader.RankFile]:
            got = {}
            for path in reader.files_in(str(rec_dir)):
                f = reader.read_file(path)
                got[f.dp_rank] = f
            return got if set(got) == {0, 1} and all(f.heartbeat_ticks for f in got.values()) else {}

        ranks = _wait_for("both ranks' recorder files with a heartbeat", files, 60, lambda: server.log)
        held = _hold_both_in_one_round(server, ranks, hold_file)
        stopped_pid = ranks[STOPPED_RANK].pid
        base = _written_out(ranks[STOPPED_RANK].path).last_round  # after phase 0
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(_request, server.port, rank, 6000 + rank, IN_FLIGHT_TOKENS) for rank in (0, 1)]
            # Both ranks decode: rounds with a batch are recorded on the rank that will stop
            _wait_for(
                "rank 1 decoding",
                lambda: reader.read_file(ranks[STOPPED_RANK].path).last_round > base + 3,
                120,
                lambda: server.log,
            )
            # A warm-up forward slower than STALL_S on this busy host logs a stall and a recovery of its own: only
            # the log after the stop is read
            mark = len(server.log)
            os.kill(stopped_pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                match = _wait_for("the stall line", lambda: STALL_LINE.search(server.log, mark), STALL_S + 20,
                                  lambda: server.log)  # fmt: skip
                stall_after_s = time.monotonic() - stopped_at
                frozen = rollcall.rollcall([str(rec_dir)])
                assert not any(f.done() for f in futures), "the requests finished while a rank was stopped"
            finally:
                os.kill(stopped_pid, signal.SIGCONT)
            recovery = _wait_for("the recovery line", lambda: RECOVERY_LINE.search(server.log, mark), 60,
                                 lambda: server.log)  # fmt: skip
            in_flight = [f.result(timeout=240) for f in futures]
        after = _request(server.port, STOPPED_RANK, 6100 + STOPPED_RANK, 8)
        idle_mark, t_idle = len(server.log), time.monotonic()  # phase 2b's lines are its own
        idle = _idle_freeze(server, ranks, stopped_pid)
        launch_timings["stall_idle_phase"] = round(time.monotonic() - t_idle, 1)
        os.kill(stopped_pid, signal.SIGKILL)
        _wait_for("rank 1 gone", lambda: reader.process_state(ranks[STOPPED_RANK]) == "dead", 30)
        dead = rollcall.rollcall([str(rec_dir)], settle_s=0)
        launch_timings["stall"] = round(time.monotonic() - t0, 1)
        return StallRun(stopped_pid, stall_after_s, _fields(match["fields"]), _fields(recovery["fields"]), held,
                        frozen, in_flight, after, dead, server.log[mark:idle_mark], idle)  # fmt: skip
    finally:
        if stopped_pid is not None:
            try:
                os.kill(stopped_pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        server.stop()
        assert not server.group_alive(), "stall: processes left behind"


def test_the_live_rank_logs_the_stall_line_naming_its_round(run):
    f = run.stall_fields
    assert run.stall_after_s <= STALL_S + 5, run.stall_after_s
    # blocked in the gather, or in the forward's own collectives (what this shape does: TP 2 MoE layers)
    assert f["dp_rank"] == str(LIVE_RANK) and int(f["round"]) > 0, f
    assert f["where"] in ("inside_mlp_sync", "after_mlp_sync"), f
    assert float(f["stalled_s"]) >= STALL_S and f["stall_s"] == str(STALL_S), f
    assert int(f["last_decided_round"]) <= int(f["round"]), f
    assert (
        f["stale_peers"].startswith(f"dp{STOPPED_RANK}(pid={run.stopped_pid},")
        and "state=stopped" in (f["stale_peers"])
    ), f
    print("stall line:", " ".join(f"{k}={v}" for k, v in f.items()))


def test_both_ranks_held_alive_in_one_round_is_a_stall_outside_the_vote(run):
    data, code = run.held
    print("rollcall (held):", data["answer"])
    assert code == 1 and data["verdict"] == "stall_outside_vote", data["answer"]
    assert "a stall outside the vote" in data["answer"] and "CUDA_MODULE_LOADING=EAGER" in data["answer"]
    assert all(r["process"] == "running" and not r["stopped"] for r in data["ranks"]), data["ranks"]


def test_rollcall_names_the_frozen_rank(run):
    data, code = run.frozen
    print("rollcall (frozen):", data["answer"])
    assert code == 1 and data["verdict"] == "stopped" and data["stopped_ranks"] == [STOPPED_RANK], data["answer"]
    assert f"DP rank {STOPPED_RANK} stopped: frozen (pid {run.stopped_pid} is stopped" in data["answer"]


def test_sigcont_recovers_and_serves_again(run):
    assert run.recovery_fields["dp_rank"] == str(LIVE_RANK), run.recovery_fields
    assert float(run.recovery_fields["stalled_s"]) >= STALL_S, run.recovery_fields
    assert [len(out["output_ids"]) for out in run.in_flight] == [IN_FLIGHT_TOKENS] * 2
    assert run.after["meta_info"]["dp_rank"] == STOPPED_RANK and len(run.after["output_ids"]) == 8
    assert len(re.findall(f"sglang-dp-mtp-fix: stall: dp_rank={LIVE_RANK} ", run.log)) == 1  # one line a stall


def test_rollcall_names_the_dead_rank(run):
    data, code = run.dead
    print("rollcall (dead):", data["answer"])
    assert code == 1 and STOPPED_RANK in data["stopped_ranks"], data["answer"]
    assert f"DP rank {STOPPED_RANK} stopped: dead (pid {run.stopped_pid} is gone)" in data["answer"]


def test_a_group_asleep_on_idle_raises_no_stall_line(run):
    """Issue 45: longer than the idle threshold asleep (``--sleep-on-idle``), rounds still come (each loop pass waits
    in the idle sleeper's poll), far fewer than a spinning loop's; no rank logs a stall."""
    print("idle rounds per second (asleep):", [round(r, 1) for r in run.idle.rounds_per_s])
    assert all(0 < r < 20 for r in run.idle.rounds_per_s), run.idle.rounds_per_s
    assert run.idle.asleep_lines == [], run.idle.asleep_lines


def test_a_rank_frozen_while_the_group_is_idle_is_a_stall_between_rounds(run):
    """Issue 45: DP rank 1 frozen while idle, a request sent to DP rank 0: DP rank 0's loop waits outside any round
    (in the request broadcast over the TP group), and its stall line comes within the idle threshold plus a few
    seconds. Before, no line came (seen: none in 25 s)."""
    idle = run.idle
    f = idle.stall_fields
    print("idle stall line after", round(idle.stall_after_s, 1), "s:", " ".join(f"{k}={v}" for k, v in f.items()))
    assert f["dp_rank"] == str(LIVE_RANK) and f["where"] == "between_rounds", f
    assert float(f["stalled_s"]) >= IDLE_THRESHOLD_S and idle.stall_after_s <= IDLE_THRESHOLD_S + 5, idle
    assert not idle.waiting_done_while_frozen  # the request waited on the stopped group
    assert idle.recovery_fields["dp_rank"] == str(LIVE_RANK) and len(idle.served["output_ids"]) == 8, idle

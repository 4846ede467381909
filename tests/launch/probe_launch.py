"""Scenario c's launches (``test_vote_probe.py`` says what c asserts): a real CPU launch in the tier's shape with the
test-only vote probe selected, c's request phases routed to chosen DP ranks, the probe's per-round records read back.
A module of its own because the plugin-off launch is shared: c's control and e (kill switch) plus the plugin-off half
of the metrics scenario (``test_launch.py``) read the same launch (``conftest.probe_off``)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import soaklib
from launchlib import (
    METRICS,
    STATS_EVERY,
    base_env,
    post_generate,
    read_report_files,
    read_report_lines,
    settle,
    start_server,
)

PLUGINS = "dp_mtp_fix,launch_cpu_gaps,launch_vote_probe"
EAGER_RANK = 0
EAGER_RID = "vote-probe-eager"
# (rid, DP rank, new tokens): phases sent one after the other, the requests of a phase at once.
PHASES = [
    [("plain-0a", 0, 24), (f"{EAGER_RID}-0a", 0, 8), ("plain-1a", 1, 24), ("plain-1b", 1, 8)],
    [(f"{EAGER_RID}-0b", 0, 6)],
    [("plain-1c", 1, 6)],
]
CPU_NO_OVERLAP = "Overlap schedule is not implemented for speculative decoding on CPU."  # SGLang's own warning
# The short soak: one release, in c's patched launch. ~200 decode batches per rank (LAUNCH_SOAK_BATCHES overrides), a
# malformed request every 10 requests (each kind once by request 30: 200 batches took 62 requests, 60 took 34; at
# every 25 or 15 the third kind did not come), forced rounds at 10 %, a fixed draw.
SOAK_RELEASE = "0.5.20"
SOAK_BATCHES = int(os.environ.get("LAUNCH_SOAK_BATCHES", "200"))
SOAK_RATE, SOAK_SEED, SOAK_MALFORMED_EVERY = 0.1, 24, 10


@dataclass
class ProbeLaunch:
    log: str
    outputs: dict[str, dict]  # rid -> /generate response
    meta: dict[int, dict]  # rank -> the probe's meta line
    drafts: list[dict]  # every draft-step record of both ranks in c's rounds
    soak: tuple[dict, list[str]] | None = None  # the short soak's figures and failed checks (soaklib.analyse)
    report_dir: Path | None = None  # where its processes wrote their report files (the shared plugin-off launch)
    metrics_end: str | None = None  # /metrics after c's phases (the shared plugin-off launch) or after the soak

    def report_lines(self) -> dict[str, list[str]]:
        return read_report_lines(self.log)

    def report_files(self) -> list[dict]:
        assert self.report_dir is not None, "this launch was started without a report directory"
        return read_report_files(self.report_dir)

    def by_round(self) -> dict[int, dict[int, dict]]:
        """round -> rank -> that rank's draft-step record."""
        out: dict[int, dict[int, dict]] = {}
        for rec in self.drafts:
            assert rec["rank"] not in out.get(rec["round"], {}), ("two draft steps in one round", rec)
            out.setdefault(rec["round"], {})[rec["rank"]] = rec
        return out

    def chosen_rounds(self) -> set[int]:
        """The rounds where the eager rank's worker needs a rank-consistent eager draft (what its hook says)."""
        return {r["round"] for r in self.drafts if r["rank"] == EAGER_RANK and r["needs_eager"]}


def _generate(port: int, rid: str, rank: int, room: int, max_new_tokens: int) -> dict:
    body = {
        "rid": rid,
        "routed_dp_rank": rank,
        # PD decode needs a bootstrap peer; "2.2.2.2" is SGLang's fake-transfer marker (never contacted). The room's
        # parity names the same rank, should the router follow the room.
        "bootstrap_host": "2.2.2.2",
        "bootstrap_room": room,
        "input_ids": [1, 5 + room % 50, 6, 7],
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
    }
    return post_generate(port, body, timeout=180)


def probe_launch(
    name: str,
    tmp: Path,
    path: str,
    timings: dict,
    args: Sequence[str] = (),
    soak: bool = False,
    shared: bool = False,
    **extra: str,
) -> ProbeLaunch:
    """``soak``: the short soak after c's phases. ``shared``: the launch also serves e and metrics (``--enable-metrics``
    and /metrics after c's phases, report files, the stats lines asked for)."""
    records = tmp / f"{name}-records"
    records.mkdir()
    probe = {"LAUNCH_VOTE_PROBE_DIR": str(records), "LAUNCH_VOTE_PROBE_EAGER_RANK": str(EAGER_RANK),
             "LAUNCH_VOTE_PROBE_EAGER_RID": EAGER_RID}  # fmt: skip
    report_dir = None
    if soak or shared:
        args = [*args, *METRICS]  # the soak compares the plugin's /metrics counters with the probe's counts
    if soak:
        probe |= soaklib.force_env(SOAK_RATE, SOAK_SEED)
    if shared:
        report_dir = tmp / f"{name}-reports"
        report_dir.mkdir()
        probe |= {"SGLANG_DP_MTP_FIX_REPORT_DIR": str(report_dir), "SGLANG_DP_MTP_FIX_STATS": str(STATS_EVERY)}
    env = base_env(path, SGLANG_PLUGINS=PLUGINS, **probe, **extra)
    server = start_server(name, tmp, env, args)
    outputs: dict[str, dict] = {}
    traffic, metrics_end = None, None
    try:
        t0 = time.monotonic()
        if not server.wait_ready():
            pytest.fail(f"{name}: server never became ready; log tail:\n{server.log[-4000:]}")
        room = 4000
        for phase in PHASES:
            with ThreadPoolExecutor(len(phase)) as pool:
                futures = {}
                for rid, rank, n in phase:
                    room += 2 - (room - rank) % 2  # room % 2 == rank
                    futures[rid] = pool.submit(_generate, server.port, rid, rank, room, n)
                outputs.update({rid: f.result() for rid, f in futures.items()})
        settle(lambda: (server.log_size(), soaklib.records_size(records)))  # the last records and log lines
        if shared:
            metrics_end = server.settled_metrics()
        timings[name] = round(time.monotonic() - t0, 1)
        timings[f"{name}_ready"] = round(server.ready_s or 0, 1)
        if soak:
            pids = {r["rank"]: r["pid"] for r in soaklib.read_records(records) if r["kind"] == "meta"}
            traffic = soaklib.drive(server.port, records, pids, SOAK_BATCHES, seed=SOAK_SEED,
                                    malformed_every=SOAK_MALFORMED_EVERY, timeout=300, max_wall=900)  # fmt: skip
            settle(lambda: (server.log_size(), soaklib.records_size(records)))
            metrics_end = server.settled_metrics()
            assert server.alive(), f"{name}: the server died during the soak; log tail:\n{server.log[-4000:]}"
            timings[f"{name}_soak"] = traffic.wall_s
    finally:
        server.stop()
        assert not server.group_alive(), f"{name}: processes left behind"
    lines = soaklib.read_records(records)
    meta = {rec["rank"]: rec for rec in lines if rec["kind"] == "meta"}
    drafts = [rec for rec in lines if rec["kind"] == "draft"]
    c_rids = {rid for phase in PHASES for rid, _, _ in phase}
    c_last = max((rec["round"] for rec in drafts if c_rids.intersection(rec["rids"])), default=0)
    analysis = soaklib.analyse(lines, traffic, True, metrics_end, after_round=c_last) if traffic else None
    c_drafts = [rec for rec in drafts if (rec["round"] or 0) <= c_last]
    return ProbeLaunch(server.log, outputs, meta, c_drafts, analysis, report_dir, metrics_end)

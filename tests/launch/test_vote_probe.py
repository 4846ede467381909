"""c. The vote through real schedulers: a real CPU launch in the tier's shape (DP attention 2, PD decode, NEXTN MTP),
with the test-only probe ``probes/launch_vote_probe`` selected (its header says what it does and why it is no
stand-in for the plugin): DP rank 0's speculative worker declares, through the upstream hook
``requires_dp_attention_eager_forward``, that its batches holding a request with a chosen rid need a rank-consistent
eager draft; the probe lifts ``--disable-cuda-graph`` for the MLP-sync vote alone (CPU has no graph runner, every
batch still runs eager) and records, per rank, per MLP-sync round, what each draft step's ForwardBatch carries.

Two launches shared by the assertions: patched (the plugin on) and off (``SGLANG_DP_MTP_FIX=off``, the same probe, the
control). Requests are routed to chosen DP ranks (``routed_dp_rank``) in three phases: both ranks busy with the chosen
request on rank 0 among them (chosen rounds with both ranks decoding, then plain rounds once it is done), the chosen
request alone on rank 0 (rank 1 idle: the #32209 case of an idle rank replaying the graph), a plain request alone on
rank 1. Overlap scheduling: SGLang 0.5.20 turns it off for speculative decoding on CPU (asserted below).

The short soak (issue 24; ``bench/soak.py`` is the long one) reuses the patched launch on one release (SOAK_RELEASE):
after c's phases, ``soaklib.drive`` sends ~SOAK_BATCHES decode batches per rank of mixed traffic with the probe
forcing an eager draft on a random rank in ~10 % of the rounds (only for ``soak-`` requests, so c's rounds stay
c's), and malformed requests; c's assertions read c's rounds only, the soak's checks the rounds after them."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import soaklib
from launchlib import METRICS, SHAPE, base_env, post_generate, start_server
from releases import AFFECTED, FULL, LAUNCHES_HERE, NOT_YET, SGLANG_VERSION

pytestmark = [
    pytest.mark.skipif(
        SGLANG_VERSION not in LAUNCHES_HERE,
        reason=f"SGLang {SGLANG_VERSION} does not launch on CPU here yet: {NOT_YET.get(SGLANG_VERSION, 'not tried')}",
    ),
    pytest.mark.skipif(SGLANG_VERSION not in AFFECTED, reason="c needs the plugin applied (an affected release)"),
    # The coverage for c: the three distinct shapes of the vote path's code (0.5.16, 0.5.18 and 0.5.19 share
    # 0.5.17's / 0.5.20's and run a and g); this also keeps CI inside its budget (~3 min per release).
    pytest.mark.skipif(SGLANG_VERSION not in FULL, reason="c runs on 0.5.15.post1, 0.5.17 and 0.5.20"),
    pytest.mark.skipif(
        SGLANG_VERSION == "0.5.15.post1",
        reason="c's probe does not yet observe 0.5.15.post1's draft step (prepare_for_draft is a method of "
        "base_spec_worker.EagleDraftWorkerBase there, not the module function the probe re-points)",
    ),
]

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


@pytest.fixture(scope="session")
def probe_path(gaps_path, tmp_path_factory) -> str:
    """The tier's stand-ins plus the probe (``soaklib.probe_pythonpath``)."""
    return soaklib.probe_pythonpath(gaps_path, tmp_path_factory.mktemp("vote-probe") / "entry-point")


@dataclass
class ProbeLaunch:
    log: str
    outputs: dict[str, dict]  # rid -> /generate response
    meta: dict[int, dict]  # rank -> the probe's meta line
    drafts: list[dict]  # every draft-step record of both ranks in c's rounds
    soak: tuple[dict, list[str]] | None = None  # the short soak's figures and failed checks (soaklib.analyse)

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


def _probe_launch(
    name: str, tmp: Path, path: str, timings: dict, args: Sequence[str] = (), soak: bool = False, **extra: str
) -> ProbeLaunch:
    records = tmp / f"{name}-records"
    records.mkdir()
    probe = {"LAUNCH_VOTE_PROBE_DIR": str(records), "LAUNCH_VOTE_PROBE_EAGER_RANK": str(EAGER_RANK),
             "LAUNCH_VOTE_PROBE_EAGER_RID": EAGER_RID}  # fmt: skip
    if soak:
        probe |= soaklib.force_env(SOAK_RATE, SOAK_SEED)
        args = [*args, *METRICS]  # the soak compares the plugin's /metrics counters with the probe's counts
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
        time.sleep(1.0)  # the last records and log lines flush
        timings[name] = round(time.monotonic() - t0, 1)
        timings[f"{name}_ready"] = round(server.ready_s or 0, 1)
        if soak:
            pids = {r["rank"]: r["pid"] for r in soaklib.read_records(records) if r["kind"] == "meta"}
            traffic = soaklib.drive(server.port, records, pids, SOAK_BATCHES, seed=SOAK_SEED,
                                    malformed_every=SOAK_MALFORMED_EVERY, timeout=300, max_wall=900)  # fmt: skip
            time.sleep(1.0)
            metrics_end = server.scrape_metrics()
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
    return ProbeLaunch(server.log, outputs, meta, [rec for rec in drafts if (rec["round"] or 0) <= c_last], analysis)


@pytest.fixture(scope="module")
def patched(probe_path, launch_tmp, launch_timings) -> ProbeLaunch:
    return _probe_launch("c-patched", launch_tmp, probe_path, launch_timings, soak=SGLANG_VERSION == SOAK_RELEASE)


@pytest.fixture(scope="module")
def off(probe_path, launch_tmp, launch_timings) -> ProbeLaunch:
    return _probe_launch("c-off", launch_tmp, probe_path, launch_timings, SGLANG_DP_MTP_FIX="off")


def would_be_graph(rec: dict) -> bool:
    """The draft path this rank would take with a captured draft graph: ``EAGLEDraftCudaGraphRunner.can_run_graph``
    reads the generic vote (``can_run_decode_cuda_graph``; the batch sizes here are within any capture list) and,
    with the plugin, its vote (absent: the runner has no such gate); ``EagleDraftWorker.draft`` then falls back to
    eager on its own when this rank's batch needs it (the seedless guard, which the declared need stands for)."""
    return rec["generic"] and rec["vote"] is not False and not rec["needs_eager"]


def assert_probe_saw_a_real_cpu_launch(launch: ProbeLaunch, plugin_on: bool) -> None:
    assert set(launch.meta) == {0, 1}, launch.log[-4000:]
    for rank, meta in launch.meta.items():
        assert meta["worker"] == "EAGLEWorkerV2", meta
        # c declares the need on rank 0 only; the soak's forcing on every rank
        assert meta["hook_on_instance"] == (rank == EAGER_RANK or launch.soak is not None), meta
        assert meta["hook_on_class"] == plugin_on, meta  # the plugin adds the hook to EAGLEWorkerV2; off: nothing
        assert not meta["draft_graph_runner"] and not meta["target_decode_graph_runner"], meta  # CPU: no graphs
    assert {r["rank"] for r in launch.drafts} == {0, 1}
    for rec in launch.drafts:
        assert rec["round"] is not None, rec  # every draft step's batch came through the counted MLP sync
        assert rec["disable_cuda_graph_given"] is True, rec  # the tier's --disable-cuda-graph reached the vote ...
        assert not rec["graph_runner"] and not rec["can_run"], rec  # ... and every draft step ran eager anyway
    for rid, rank, n in (req for phase in PHASES for req in phase):
        out = launch.outputs[rid]
        assert out["meta_info"]["dp_rank"] == rank and len(out["output_ids"]) == n, (rid, out["meta_info"])
    assert "Traceback" not in launch.log, launch.log[-4000:]


def assert_rounds_line_up_and_cover_the_cases(launch: ProbeLaunch) -> None:
    rounds = launch.by_round()
    assert all(set(per_rank) == {0, 1} for per_rank in rounds.values()), {
        r: sorted(p) for r, p in rounds.items() if set(p) != {0, 1}
    }
    chosen = launch.chosen_rounds()
    mode = {r: {rank: rec["mode"] for rank, rec in per_rank.items()} for r, per_rank in rounds.items()}
    both = {"DECODE"}
    # chosen rounds with rank 1 decoding and with rank 1 idle; plain rounds with both ranks decoding
    assert any(set(mode[r].values()) == both for r in chosen), mode
    assert any(mode[r] == {0: "DECODE", 1: "IDLE"} for r in chosen), mode
    assert any(set(mode[r].values()) == both for r in set(rounds) - chosen), mode
    for rec in launch.drafts:
        assert rec["generic"] is True, rec  # the lifted generic vote: yes on every rank, every round
        # the chosen rounds are exactly those where rank 0's batch holds the marked request (its hook's answer)
        assert rec["needs_eager"] == (rec["rank"] == EAGER_RANK and any(x.startswith(EAGER_RID) for x in rec["rids"]))


# --- patched: every rank's draft ForwardBatch carries the group vote -------------------------------------------------


def test_c_patched_probe_runs_in_a_real_cpu_launch(patched):
    assert_probe_saw_a_real_cpu_launch(patched, plugin_on=True)
    assert_rounds_line_up_and_cover_the_cases(patched)


def test_c_patched_plugin_asks_the_eager_ranks_worker_every_decode_round(patched):
    for rec in patched.drafts:
        if patched.meta[rec["rank"]]["hook_on_instance"] and rec["mode"] == "DECODE":
            # asked through the instance attribute (the probe's hook records the call), before that round's sync
            assert rec["asked"] is not None and rec["asked"] == rec["needs_eager"] == rec["plugin_flag"], rec
        else:
            assert rec["asked"] is None, rec  # idle batches are built inside the sync; rank 1 has no hook unless soak
        # the plugin's mark on the batch: the hook's answer on rank 0, its own predicate (no DSA: False) on rank 1,
        # the class default on idle batches
        assert rec["plugin_flag"] == rec["needs_eager"], rec


def test_c_patched_group_vote_is_false_in_exactly_the_chosen_rounds_on_every_rank(patched):
    chosen = patched.chosen_rounds()
    assert chosen, "no chosen round: the eager rank never decoded the marked request"
    wrong = [(r["rank"], r["round"], r["mode"], r["vote"]) for r in patched.drafts
             if r["vote"] != (r["round"] not in chosen)]  # fmt: skip
    assert not wrong, (sorted(chosen), wrong)


def test_c_patched_ranks_would_take_the_same_draft_path_every_round(patched):
    split = {r: {k: would_be_graph(v) for k, v in p.items()} for r, p in patched.by_round().items()}
    assert all(len(set(paths.values())) == 1 for paths in split.values()), {
        r: p for r, p in split.items() if len(set(p.values())) > 1
    }
    assert {r for r, paths in split.items() if not paths[0]} == patched.chosen_rounds()


# --- control: the same probe with the plugin off -------------------------------------------------------------------


def test_c_off_probe_runs_in_a_real_cpu_launch(off):
    assert_probe_saw_a_real_cpu_launch(off, plugin_on=False)
    assert_rounds_line_up_and_cover_the_cases(off)


def test_c_off_no_vote_is_carried_and_nobody_asks_the_worker(off):
    assert all(r["vote"] is None and r["asked"] is None and r["plugin_flag"] is None for r in off.drafts)


def test_c_off_ranks_split_in_exactly_the_chosen_rounds(off):
    """#32209's first failure mode: the rank needing eager drafts eagerly, the other rank would replay the graph."""
    rounds = off.by_round()
    chosen = off.chosen_rounds()
    assert chosen
    for r, per_rank in rounds.items():
        paths = {rank: would_be_graph(rec) for rank, rec in per_rank.items()}
        assert paths == ({0: False, 1: True} if r in chosen else {0: True, 1: True}), (r, per_rank)


# --- overlap scheduling ----------------------------------------------------------------------------------------------


def test_c_overlap_scheduling_is_off_on_cpu_by_sglangs_own_rule(patched, off):
    """The tier asks for overlap (SGLang's default: no --disable-overlap-schedule), SGLang turns it off for speculative
    decoding on CPU with this warning (``_disable_overlap_schedule_for_cpu``), so c runs without overlap. Should a
    release allow it, this fails and c needs an overlap arm."""
    assert "--disable-overlap-schedule" not in SHAPE
    for launch in (patched, off):
        assert CPU_NO_OVERLAP in launch.log
        assert not any(meta["enable_overlap"] for meta in launch.meta.values()), launch.meta


# --- the short soak (issue 24), in the patched launch on SOAK_RELEASE ------------------------------------------------

soak_only = pytest.mark.skipif(SGLANG_VERSION != SOAK_RELEASE, reason=f"the short soak runs on {SOAK_RELEASE} only")


@soak_only
def test_soak_every_request_exact_every_round_one_path_counters_equal_the_probe(patched):
    """Mixed traffic (1-16 in flight, both ranks, varied max_new_tokens), forced eager rounds on random ranks:
    ``soaklib.analyse`` lists every check that failed (requests lost or not exactly their tokens, a round where the
    ranks would take different draft paths or the group vote is not "eager" exactly in the forced rounds, /metrics
    counters unequal to the probe's counts, ...)."""
    figures, failures = patched.soak
    print("short soak:", json.dumps({k: v for k, v in figures.items() if k not in ("rss_kb_samples", "malformed")}))
    assert not failures, failures
    assert min(figures["decode_batches_per_rank"].values()) >= SOAK_BATCHES, figures["decode_batches_per_rank"]
    assert all(figures["forced_by_rank"].values()) and figures["rounds_ranks_disagree"] == 0, figures
    assert figures["concurrency_targets"]["max"] > 1 and figures["requests_ok"] == figures["requests"] > 0, figures


@soak_only
def test_soak_malformed_requests_get_sglangs_answer_and_the_server_keeps_serving(patched):
    figures, _ = patched.soak
    got = {m["kind"]: m for m in figures["malformed"]}
    assert set(got) == set(soaklib.MALFORMED), figures["malformed"]
    for m in figures["malformed"]:
        assert m["status"] in soaklib.MALFORMED_ANSWER[m["kind"]], m
    # requests sent after the last malformed one were served (analyse checked every request): request n goes out
    # right after malformed n, so the soak may end on it (seen in CI: the last malformed at request 80 of 80)
    assert figures["requests"] >= max(m["after_request"] for m in figures["malformed"]), figures


@soak_only
def test_soak_scheduler_rss_flat(patched):
    figures, _ = patched.soak
    rss = figures["scheduler_rss"]
    assert set(rss) == {0, 1}, rss
    for rank, r in rss.items():
        assert r["end_mb"] - r["start_mb"] <= soaklib.RSS_GROWTH_MB, (rank, r)

"""c. The vote through real schedulers: a real CPU launch in the tier's shape (DP attention 2, PD decode, NEXTN MTP),
with the test-only probe ``probes/launch_vote_probe`` selected (its header says what it does and why it is no
stand-in for the plugin): DP rank 0's speculative worker declares, through the upstream hook
``requires_dp_attention_eager_forward``, that its batches holding a request with a chosen rid need a rank-consistent
eager draft; the probe lifts ``--disable-cuda-graph`` for the MLP-sync vote alone (CPU has no graph runner, every
batch still runs eager) and records, per rank, per MLP-sync round, what each draft step's ForwardBatch carries.

Two launches shared by the assertions: patched (the plugin on) and off (``SGLANG_DP_MTP_FIX=off``, the same probe, the
control; e and the metrics' plugin-off half read it too); how they are run: ``probe_launch.py``. Requests are routed
to chosen DP ranks (``routed_dp_rank``) in three phases: both ranks busy with the chosen request on rank 0 among them
(chosen rounds with both ranks decoding, then plain rounds once it is done), the chosen request alone on rank 0
(rank 1 idle: the #32209 case of an idle rank replaying the graph), a plain request alone on rank 1.
Overlap scheduling: SGLang 0.5.20 turns it off for speculative decoding on CPU (asserted below).

The short soak (issue 24; ``bench/soak.py`` is the long one) reuses the patched launch on one release (SOAK_RELEASE):
after c's phases, ``soaklib.drive`` sends ~SOAK_BATCHES decode batches per rank of mixed traffic with the probe
forcing an eager draft on a random rank in ~10 % of the rounds (only for ``soak-`` requests, so c's rounds stay
c's), and malformed requests; c's assertions read c's rounds only, the soak's checks the rounds after them."""

from __future__ import annotations

import json

import pytest
import soaklib
from launchlib import SHAPE
from probe_launch import (
    CPU_NO_OVERLAP,
    EAGER_RANK,
    EAGER_RID,
    PHASES,
    SOAK_BATCHES,
    SOAK_RELEASE,
    ProbeLaunch,
    probe_launch,
)
from releases import LAUNCHES_HERE, NOT_YET, PROBE, SGLANG_VERSION, runs_on

pytestmark = [
    pytest.mark.skipif(
        SGLANG_VERSION not in LAUNCHES_HERE,
        reason=f"SGLang {SGLANG_VERSION} does not launch on CPU here yet: {NOT_YET.get(SGLANG_VERSION, 'not tried')}",
    ),
    # The three distinct shapes of the vote path's code would be 0.5.15.post1's, 0.5.17's and 0.5.20's (0.5.16,
    # 0.5.18 and 0.5.19 share the latter two and run a and g); 0.5.15.post1 does not launch here (above).
    pytest.mark.skipif(SGLANG_VERSION not in PROBE, reason=f"c {runs_on(PROBE)}"),
]


@pytest.fixture(scope="module")
def patched(probe_path, launch_tmp, launch_timings) -> ProbeLaunch:
    return probe_launch("c-patched", launch_tmp, probe_path, launch_timings, soak=SGLANG_VERSION == SOAK_RELEASE)


@pytest.fixture(scope="module")
def off(probe_off) -> ProbeLaunch:
    """The plugin-off control: the launch e and the metrics' plugin-off half read too (``conftest.probe_off``)."""
    return probe_off


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

soak_only = pytest.mark.skipif(SGLANG_VERSION != SOAK_RELEASE, reason=f"the short soak {runs_on((SOAK_RELEASE,))}")


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

"""Vote counters (SGLANG_DP_MTP_FIX_STATS): exact counts for a scripted trace on 4 real ranks; off by default."""

from __future__ import annotations

from support import affected_only

from sglang_dp_mtp_fix.diagnosis import stats

pytestmark = affected_only

SEEDED = dict(kind="decode", seed=True)
SEEDLESS = dict(kind="decode", seed=False)
NONE = dict(kind="none")
IDLE = dict(kind="idle")

SCRIPT = [
    [SEEDED, SEEDED, SEEDED, SEEDED],  # draft graph everywhere
    [SEEDLESS, NONE, IDLE, SEEDED],  # rank 0 seedless -> everyone eager
    [NONE, NONE, NONE, NONE],  # nothing runs anywhere: no decode batch, nothing counted
    [SEEDED, SEEDLESS, SEEDLESS, NONE],  # ranks 1, 2 seedless
    [SEEDED, NONE, IDLE, NONE],
]


def test_exact_counts_for_a_scripted_trace(rank_pool):
    rank_pool.plugin({"command": "apply", "env": {"SGLANG_DP_MTP_FIX_STATS": "1000"}})
    try:
        for states in SCRIPT:
            rank_pool.round(states)
        totals = [r["stats"] for r in rank_pool.plugin("stats")]
    finally:
        rank_pool.plugin("restore")
    # Each rank counts every round in which it ran a batch (4 of the 5 rounds; round 3 had no batch anywhere).
    common = dict(
        decode_batches=4, generic_graph_true=4, generic_graph_false=0, draft_graph_true=2, draft_graph_false=2,
        eager_runner_refused=0, eager_graphs_off=0,
    )  # fmt: skip
    assert totals[0] == {**common, "eager_own_seedless": 1, "eager_other_rank_vote": 1}
    assert totals[1] == {**common, "eager_own_seedless": 1, "eager_other_rank_vote": 1}
    assert totals[2] == {**common, "eager_own_seedless": 1, "eager_other_rank_vote": 1}
    assert totals[3] == {**common, "eager_own_seedless": 0, "eager_other_rank_vote": 2}


def test_counters_are_off_unless_asked(rank_pool):
    rank_pool.plugin("apply")
    try:
        rank_pool.round([SEEDED, SEEDED, SEEDED, SEEDED])
        assert [r["stats"] for r in rank_pool.plugin("stats")] == [None] * 4
    finally:
        rank_pool.plugin("restore")


def test_a_line_every_n_batches(caplog):
    counters = stats.VoteStats(every=2)
    with caplog.at_level("INFO", logger="sglang_dp_mtp_fix.stats"):
        counters.record(True, True, True)
        assert not caplog.records
        counters.record(True, False, False)
    assert len(caplog.records) == 2  # the votes, then the eager draft steps by reason
    line = caplog.records[0].getMessage()
    assert "last 2 decode batches" in line and "draft vote graph-eligible=1 forced-eager=1" in line
    assert "generic decode vote graph-eligible=2 eager=0" in line and "graph true" not in line
    assert "own seedless batch=1" in line and "another rank's vote=0" in line
    assert counters.window.decode_batches == 0 and counters.total.decode_batches == 2


def test_restore_drops_the_vote_counters(restored, monkeypatch):
    """The counters belong to one application: after ``restore()`` none are active, so a later scheduler (or apply)
    never exports or logs a previous run's counts."""
    monkeypatch.setenv("SGLANG_DP_MTP_FIX_STATS", "1000")
    restored.register()
    assert stats.active() is not None
    restored.restore()
    assert stats.active() is None


def test_eager_draft_steps_by_reason_in_the_summary_and_for_the_exporter(caplog):
    """Issue 33, item 4: the four reasons a draft step runs eager, one count each (VoteStats itself: the runner's
    refusal needs a captured draft graph, which no CPU rank has)."""
    import logging

    caplog.set_level(logging.INFO, "sglang_dp_mtp_fix.stats")
    counters = stats.VoteStats(every=4)
    reasons: list[str] = []
    counters.reason_exporter = reasons.append
    counters.record(True, False, False)  # this rank's batch was seedless: the group went eager
    counters.record(True, False, True)  # another rank's was
    counters.runner_refused()  # the group voted graph, the runner refused (e.g. above the captured sizes)
    counters.record(True, True, True)
    counters.graphs_off = True
    counters.record(True, True, True)  # no CUDA graphs at all on this scheduler
    assert reasons == [stats.REASON_OWN, stats.REASON_GROUP, stats.REASON_REFUSED, stats.REASON_GRAPHS_OFF]
    t = counters.total
    assert (t.eager_own_seedless, t.eager_other_rank_vote, t.eager_runner_refused, t.eager_graphs_off) == (1, 1, 1, 1)
    assert (
        "sglang-dp-mtp-fix eager draft steps by reason (last 4 decode batches): seedless here=1, group vote=1, "
        "runner refused=1, graphs off=1"
    ) in caplog.text


def test_the_runners_own_refusals_are_counted_and_the_votes_no_is_not():
    """The counters stack under the vote's gate (issue 54, item 2): SGLang's refusal is counted, the vote's is not."""
    from types import SimpleNamespace

    from sglang_dp_mtp_fix.patches import draft_graph_vote as vote

    counters = stats.VoteStats(every=None)
    answers = iter([False, True])

    def sglangs_gate(runner: object, forward_batch: object) -> bool:  # STAND-IN: its yes needs a captured draft graph
        return next(answers)

    gate = vote._runner_gate_wrapper(stats.counting_refusals(counters, sglangs_gate))
    runner = SimpleNamespace(require_mlp_sync=True)
    assert gate(runner, SimpleNamespace(**{vote.VOTE_ATTR: True})) is False  # the runner's own no: counted
    assert counters.total.eager_runner_refused == 1
    assert gate(runner, SimpleNamespace(**{vote.VOTE_ATTR: False})) is False  # the group's no: not counted
    assert counters.total.eager_runner_refused == 1
    assert stats.counting_refusals(None, sglangs_gate) is sglangs_gate  # nothing counts: nothing stacked

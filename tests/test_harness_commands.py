"""The rank harness's commands: an unknown one fails on every rank and changes nothing; round results cross the
pool's queue as ``RoundResult``."""

from __future__ import annotations

import pickle

import pytest

from sglang_dp_mtp_fix.harness.decode_round import RoundResult
from sglang_dp_mtp_fix.harness.pool import RankError

STATS_ENV = {"SGLANG_DP_MTP_FIX_STATS": "1000"}


def test_unknown_plugin_command_fails_on_every_rank_and_the_pool_answers_on(rank_pool):
    with pytest.raises(RankError, match="unknown plugin command 'aply'"):
        rank_pool.plugin("aply")
    assert [r["statuses"] for r in rank_pool.plugin("restore")] == [{}] * 4


def test_a_misspelt_command_leaves_the_plugin_applied(rank_pool):
    statuses = rank_pool.plugin({"command": "apply", "env": STATS_ENV})[0]["statuses"]
    try:
        if statuses.get("draft_graph_vote") != "applied":
            pytest.skip(f"the vote is not applied on this release: {statuses}")
        with pytest.raises(RankError, match="unknown plugin command 'restor'"):
            rank_pool.plugin({"command": "restor"})
        # Still applied: the vote counters are still live (a restore would have switched them off).
        assert all(r["stats"] is not None for r in rank_pool.plugin("stats"))
    finally:
        rank_pool.plugin("restore")


def test_unknown_harness_command_is_refused():
    from sglang_dp_mtp_fix.harness import rank

    with pytest.raises(rank.UnknownCommand, match="unknown harness command 'rouns'"):
        rank.handle("rouns", [])
    with pytest.raises(rank.UnknownCommand, match="unknown plugin command 'aply'"):
        rank.plugin("aply")


def test_round_result_survives_the_queue():
    result = RoundResult(rank=1, ran=True, draft_path="eager", draft_rows=12, paths=[(0, 12), (0, 12)])
    assert pickle.loads(pickle.dumps(result)) == result

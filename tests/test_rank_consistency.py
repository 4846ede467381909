"""Rank-consistency property, quick profile, on the real SGLang of this release (4 gloo ranks).

Patched: no random round may split the ranks. Stock (control): the same generator must find a split, and the
shrinker must reduce it to a small round (so the check can fail, and failures are readable)."""

from __future__ import annotations

from conftest import affected_only

from sglang_dp_mtp_fix.harness.fuzz import check_round, run_property

pytestmark = affected_only

QUICK_ROUNDS = 300


def test_patched_ranks_never_split(rank_pool):
    result = run_property(rank_pool, QUICK_ROUNDS, seed=1234, patched=True)
    print(f"patched: {result['violations']} violations in {result['rounds']} random rounds")
    assert result["violations"] == 0, result["first"]


def test_stock_control_finds_and_shrinks_the_split(rank_pool):
    result = run_property(rank_pool, QUICK_ROUNDS, seed=1234, patched=False)
    print(f"stock: {result['violations']} violations in {result['rounds']} random rounds; shrunk: {result['first']}")
    assert result["violations"] > 0
    shrunk = result["first"]["shrunk"]
    decode = [s for s in shrunk if s["kind"] == "decode"]
    assert 1 <= len(decode) <= 2 and any(s.get("seed") is False or s.get("merge_seedless_prebuilt") for s in decode)


def test_checker_flags_generic_refusal_and_splits():
    ok = [{"rank": 0, "ran": True, "draft_path": "eager", "decode_graph": True}]
    assert check_round(ok) is None
    split = ok + [{"rank": 1, "ran": True, "draft_path": "graph", "decode_graph": True}]
    assert "draft paths differ" in check_round(split)
    refused = [{"rank": 0, "ran": True, "draft_path": "eager", "decode_graph": False}]
    assert "generic graph refused" in check_round(refused)


def test_fast_profile_checks_the_same_property(rank_pool):
    """``fuzz --fast`` skips the draft-step collectives: it must still find the stock split and pass patched."""
    stock = run_property(rank_pool, 100, seed=99, patched=False, collective=False)
    patched = run_property(rank_pool, 100, seed=99, patched=True, collective=False)
    assert stock["violations"] > 0 and patched["violations"] == 0, (stock["first"], patched["first"])

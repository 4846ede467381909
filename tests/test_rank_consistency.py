"""Rank-consistency property, quick profile, on the real SGLang of this release (4 gloo ranks).

Patched: no random round may split the ranks. Stock (control): the same generator must find a split, and the
shrinker must reduce it to a small round (so the check can fail, and failures are readable).

The deployment's ``--moe-a2a-backend`` / ``--speculative-moe-a2a-backend`` pair is a dimension: the pool's baseline
ServerArgs (none set) and deepep/none, the FP4 NextN deployment whose target does not gather token counts while its
draft does (draft_token_counts). The pair is published on every rank and the plugin applied under it
(``RankPool.configure``): one scheduler process has one ServerArgs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from support import affected_only

from sglang_dp_mtp_fix.harness.decode_round import RoundResult
from sglang_dp_mtp_fix.harness.fuzz import PAIRS, check_round, run_property

pytestmark = affected_only

QUICK_ROUNDS = 300
PAIR_ROUNDS = {None: QUICK_ROUNDS, ("deepep", "none"): 200}  # wider batches: a deepep/none round costs more
DEEPEP_NONE = ("deepep", "none")


def _pair_id(pair: tuple[str, str] | None) -> str:
    return "/".join(pair) if pair else "baseline"


@pytest.fixture()
def pool(rank_pool):
    """The session's rank pool, put back to its baseline ServerArgs (stock) after the test, whatever it published."""
    yield rank_pool
    rank_pool.configure(None, patched=False)


@pytest.mark.parametrize("backends", PAIRS, ids=_pair_id)
def test_patched_ranks_never_split(pool, backends):
    result = run_property(pool, PAIR_ROUNDS[backends], seed=1234, patched=True, backends=backends)
    print(f"patched {_pair_id(backends)}: {result['violations']} violations in {result['rounds']} random rounds")
    assert result["violations"] == 0, result["first"]


def test_stock_control_finds_and_shrinks_the_split(pool):
    result = run_property(pool, QUICK_ROUNDS, seed=1234, patched=False)
    print(f"stock: {result['violations']} violations in {result['rounds']} random rounds; shrunk: {result['first']}")
    assert result["violations"] > 0
    shrunk = result["first"]["shrunk"]
    decode = [s for s in shrunk if s["kind"] == "decode"]
    assert 1 <= len(decode) <= 2 and any(s.get("seed") is False or s.get("merge_seedless_prebuilt") for s in decode)


def test_stock_control_deepep_none_splits_on_counts(pool):
    """deepep/none, stock: the generator finds splits that only the counts make: ranks on the same draft path with
    different buckets or padded rows (each rank pads its own count; a seedless batch splits the path instead)."""
    result = run_property(pool, 100, seed=1234, patched=False, backends=DEEPEP_NONE)
    print(f"stock deepep/none: {result['violations']} violations in 100 rounds: {result['kinds']}")
    assert result["gathers"] == {"target": False, "draft": True}, result["gathers"]
    assert result["kinds"].get("draft buckets differ across ranks", 0) > 0, result["kinds"]


def _decode(num_reqs: int, **extra: Any) -> dict[str, Any]:
    return {"kind": "decode", "num_reqs": num_reqs, "seed": True, "overlap": True, **extra}


# deepep/none rounds through SGLang's real PD-decode round and MLP sync (4 ranks), each with the draft-step
# collectives issued after the pre-flight: one bucket split, one path split (a rank above the draft graph's max_bs,
# 64), and both with seedless PD batches on other ranks (the vote and the counts together).
SCENARIO = {
    "bucket": [_decode(3), _decode(12), {"kind": "none"}, {"kind": "idle"}],
    "path": [_decode(2), _decode(65), _decode(5), {"kind": "none"}],
    "bucket+seedless": [_decode(3, seed=False), _decode(12), _decode(4, merge_seedless_prebuilt=True), _decode(1)],
    "path+seedless": [_decode(65), _decode(2, seed=False), {"kind": "idle"}, _decode(9)],
}


def test_deepep_none_stock_splits_the_draft_and_patched_never_does(pool):
    trace = list(SCENARIO.values())
    pool.configure(DEEPEP_NONE, patched=False)
    stock = dict(zip(SCENARIO, pool.run_trace(trace), strict=True))
    pool.configure(DEEPEP_NONE, patched=True)
    patched = dict(zip(SCENARIO, pool.run_trace(trace), strict=True))
    for name in SCENARIO:
        assert check_round(stock[name]) is not None, (name, stock[name])
        assert any(r.collective == "split" for r in stock[name]), name
        assert check_round(patched[name]) is None, (name, check_round(patched[name]))
        assert all(r.collective == "ok" for r in patched[name] if r.ran), name
    assert "draft buckets differ" in check_round(stock["bucket"])
    assert {r.draft_bucket for r in stock["bucket"] if r.ran and not r.idle} == {8, 16}
    assert {r.draft_bucket for r in patched["bucket"] if r.ran} == {16}
    assert "draft paths differ" in check_round(stock["path"])
    assert {(r.draft_path, r.draft_rows) for r in patched["path"] if r.ran} == {("eager", 65)}
    assert {(r.draft_path, r.draft_rows) for r in patched["bucket+seedless"] if r.ran} == {("eager", 12)}


def test_same_rounds_do_not_split_seeded_ranks_when_both_backends_gather(pool):
    """The control of the scenario: with the baseline deployment (target and draft gather alike), stock keeps the
    seeded rounds together; only the seedless ones split (the vote's bug, not the counts')."""
    pool.configure(None, patched=False)
    results = dict(zip(SCENARIO, pool.run_trace(list(SCENARIO.values())), strict=True))
    assert check_round(results["bucket"]) is None and check_round(results["path"]) is None
    assert "draft paths differ" in check_round(results["bucket+seedless"])


def test_checker_flags_generic_refusal_and_splits():
    ok = [RoundResult(rank=0, ran=True, draft_path="eager", decode_graph=True)]
    assert check_round(ok) is None
    split = ok + [RoundResult(rank=1, ran=True, draft_path="graph", decode_graph=True)]
    assert "draft paths differ" in check_round(split)
    refused = [RoundResult(rank=0, ran=True, draft_path="eager", decode_graph=False)]
    assert "generic graph refused" in check_round(refused)
    graph = {"ran": True, "draft_path": "graph", "decode_graph": True, "draft_gathers": True}
    buckets = [RoundResult(**graph, rank=0, draft_rows=8), RoundResult(**graph, rank=1, draft_rows=16)]
    assert "draft buckets differ" in check_round(buckets)
    dispatching = [replace(r, draft_gathers=False) for r in buckets]  # no gathered draft MoE: sizes may differ
    assert check_round(dispatching) is None


def test_fast_profile_checks_the_same_property(pool):
    """``fuzz --fast`` skips the draft-step collectives: it must still find the stock split and pass patched."""
    stock = run_property(pool, 100, seed=99, patched=False, collective=False)
    patched = run_property(pool, 100, seed=99, patched=True, collective=False)
    assert stock["violations"] > 0 and patched["violations"] == 0, (stock["first"], patched["first"])


def test_elastic_scale_up_mid_run_never_splits_the_draft(pool):
    """none/deepep: the target gathers, the draft does not, until elastic EP scale-up makes SGLang's
    ``require_mlp_tp_gather`` answer True for both (0.5.20; a stand-in here). The rounds after it must bucket the
    draft on the gathered counts on every rank: a draft answer read once would keep handing each rank ``[local]``
    while its runner now gathers (bucket split)."""
    trace = [SCENARIO["bucket"], SCENARIO["path"]]
    configured = pool.configure(("none", "deepep"), patched=True)
    assert {(c["target_gathers"], c["draft_gathers"]) for c in configured} == {(True, False)}
    before = pool.run_trace(trace[:1])  # a rank above max_bs would go eager alone: by design while nothing gathers
    after_answers = pool.scale_up()
    assert {(a["target_gathers"], a["draft_gathers"]) for a in after_answers} == {(True, True)}
    after = pool.run_trace(trace)
    for i, results in enumerate(before + after):
        assert check_round(results) is None, (i, check_round(results))
    for i, results in enumerate(after):  # before it each rank buckets its own count (no gathered MoE)
        assert all(r.collective == "ok" for r in results if r.ran), (i, [r.paths for r in results])
    assert {r.draft_bucket for r in after[0] if r.ran} == {16}
    assert all(r.global_num_tokens == [3, 12, 0, 0] for r in after[0] if r.ran)

"""The GPU tier's token judge (bench/gpu/server/tier/judge.py): plain data in, verdicts out (no SGLang imported).

A difference between two greedy answers to the same request is a near-tie when the reference's two best tokens were
closer than NEAR_TIE nats where the answers first differ, and a divergence otherwise; a request counts only its
identical prefix."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

JUDGE = Path(__file__).resolve().parents[1] / "bench" / "gpu" / "server" / "tier" / "judge.py"


def _judge() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tier_judge", JUDGE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _answer(ids: list[int], gaps: list[float]) -> dict[str, list[float | int]]:
    return {"ids": ids, "lp": [-4.85] * len(ids), "gap": gaps}


def test_identical_answers_count_every_token():
    j = _judge()
    ref = {"r1": _answer([5, 6, 7], [0.5, 0.5, 0.5]), "r2": _answer([8], [0.1])}
    cand = {"r1": _answer([5, 6, 7], [0.5, 0.5, 0.5]), "r2": _answer([8], [0.1]), "r3": _answer([1], [1])}
    out = j.compare(ref, cand)
    assert (out["requests_compared"], out["requests_identical"]) == (2, 2)
    assert (out["tokens_compared"], out["tokens_identical"], out["mismatches"]) == (4, 4, [])


def test_a_difference_is_judged_by_the_reference_gap_where_the_answers_first_differ():
    j = _judge()
    ref = {"tie": _answer([5, 6, 7, 8], [0.5, 0.5, 0.001, 0.5]), "real": _answer([5, 6, 7], [0.5, 0.9, 0.5])}
    cand = {"tie": _answer([5, 6, 9, 9], [0.5, 0.5, 0.002, 0.3]), "real": _answer([5, 4, 4], [0.5, 0.9, 0.5])}
    out = j.compare(ref, cand)
    assert (out["near_ties"], out["divergences"]) == (1, 1)
    assert out["tokens_identical"] == 2 + 1  # the identical prefixes only
    by = {m["rid"]: m for m in out["mismatches"]}
    assert (by["tie"]["pos"], by["tie"]["kind"], by["tie"]["ref_token"], by["tie"]["token"]) == (2, "near-tie", 7, 9)
    assert (by["real"]["pos"], by["real"]["kind"], by["real"]["ref_gap"]) == (1, "divergence", 0.9)


def test_a_shorter_answer_differs_where_it_ends():
    j = _judge()
    assert j.first_difference([1, 2, 3], [1, 2]) == 2
    assert j.first_difference([1, 2], [1, 2]) is None

"""Every served token judged (stage pd): one arm's greedy tokens against a reference's for the same requests, and
each difference explained by the logprob gap between the top two tokens where the two first differ.

Under greedy decoding two correct servers that see the same prompt and the same weights choose the same token at
every position, unless the top two are so close that a different batch (another reduction order in bf16) flips
them. So a difference is a *near-tie* when the reference's top-two gap at the first differing position is below
NEAR_TIE nats, and a *divergence* otherwise: only a divergence says a server computed something else. After the
first difference the two continuations have different contexts, so a request counts its identical prefix only.
"""

from __future__ import annotations

from typing import Any

NEAR_TIE = 0.02  # nats: bf16 noise in a dummy-weight model's near-flat logits (vocabulary 128) is far below this


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where the two token lists differ (a shorter list differs where it ends), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def at(values: list[Any], i: int) -> Any:
    return values[i] if 0 <= i < len(values) else None


def compare(ref: dict[str, dict[str, list[Any]]], cand: dict[str, dict[str, list[Any]]]) -> dict[str, Any]:
    """``ref`` and ``cand``: rid -> tokens_of(answer). Only requests both served are compared."""
    both = sorted(set(ref) & set(cand))
    out: dict[str, Any] = {"requests_compared": len(both), "requests_identical": 0, "tokens_compared": 0,
                           "tokens_identical": 0, "near_ties": 0, "divergences": 0, "mismatches": []}  # fmt: skip
    for rid in both:
        r, c = ref[rid], cand[rid]
        pos = first_difference(r["ids"], c["ids"])
        out["tokens_compared"] += len(c["ids"])
        if pos is None:
            out["requests_identical"] += 1
            out["tokens_identical"] += len(c["ids"])
            continue
        out["tokens_identical"] += pos
        gap = at(r.get("gap", []), pos)
        kind = "near-tie" if gap is not None and gap < NEAR_TIE else "divergence"
        out["near_ties" if kind == "near-tie" else "divergences"] += 1
        out["mismatches"].append({"rid": rid, "pos": pos, "of": len(c["ids"]), "kind": kind,
                                  "ref_token": at(r["ids"], pos), "token": at(c["ids"], pos), "ref_gap": gap,
                                  "gap": at(c.get("gap", []), pos), "ref_lp": at(r.get("lp", []), pos),
                                  "lp": at(c.get("lp", []), pos)})  # fmt: skip
    out["mismatches"] = out["mismatches"][:200]
    return out


def judge_leg(mine: dict[str, Any], theirs: dict[str, Any], reference: str) -> dict[str, Any]:
    """A leg's judgement against its reference leg, both as kept (``{"soak": ..., "alone": ...}`` of rid -> tokens):
    the fields a leg's JSON carries (stage pd in the call, pd_judge.py across calls)."""
    soak, alone = compare(theirs["soak"], mine["soak"]), compare(theirs["alone"], mine["alone"])
    return {"judge": {"reference": reference, "soak": soak, "alone": alone},
            "tokens_compared": soak["tokens_compared"] + alone["tokens_compared"],
            "tokens_identical": soak["tokens_identical"] + alone["tokens_identical"],
            "tokens_served": sum(len(t["ids"]) for part in mine.values() for t in part.values())}  # fmt: skip


def served_tokens(sent: list[dict[str, Any]]) -> dict[str, dict[str, list[Any]]]:
    """The plan's request name -> tokens, for every request of a leg that came back with exactly the tokens asked."""
    return {r.get("n", r["rid"]): r["tokens_out"] for r in sent if not r.get("problem") and "tokens_out" in r}

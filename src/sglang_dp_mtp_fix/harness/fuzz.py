"""Rank-consistency property check over SGLang's real PD-decode round + DP MLP sync.

``random_round`` draws one multi-rank situation (idle / empty / decode ranks; seed present or absent; overlap future
flags; overlap merges; non-last PP ranks without a draft worker; workers that do not seed from draft-extend).
``check_round`` is the property: every rank that runs takes the same draft path and the same generic (target-verify
/ draft-extend) path, and the generic graph is refused only when some rank really needs it. ``shrink`` reduces a
failing round to a minimal one (ranks emptied, fields dropped), hypothesis-style.

Quick profile: the test suite. Long profile: ``python -m sglang_dp_mtp_fix.harness.fuzz --rounds 100000``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

State = dict[str, Any]


def random_state(rng: random.Random) -> State:
    kind = rng.choices(["none", "idle", "decode"], weights=[3, 1, 6])[0]
    if kind != "decode":
        return {"kind": kind}
    state: State = {"kind": "decode", "num_reqs": rng.randint(1, 6), "seed": rng.random() > 0.15}
    if rng.random() < 0.6:
        state["overlap"] = True
        if rng.random() < 0.2:
            state["future_flag"] = rng.random() < 0.5
    if rng.random() < 0.1:
        state["merge_seedless_prebuilt"] = True
        state["overlap"] = True
    if rng.random() < 0.05:
        state["has_draft_worker"] = False
    if rng.random() < 0.05:
        state["seed_from_draft_extend"] = False
    return state


def random_round(rng: random.Random, world: int) -> list[State]:
    return [random_state(rng) for _ in range(world)]


def check_round(results: list[dict[str, Any]]) -> str | None:
    """None when the round is rank-consistent, else a description of the violation."""
    ran = [r for r in results if r.get("ran")]
    if not ran:
        return None
    paths = {r["rank"]: r["draft_path"] for r in ran}
    if len(set(paths.values())) > 1:
        return f"draft paths differ across ranks: {paths}"
    generic = {r["rank"]: r["decode_graph"] for r in ran}
    if len(set(generic.values())) > 1:
        return f"generic graph decisions differ: {generic}"
    if not all(generic.values()):
        return f"generic graph refused although every rank is a decode/idle rank: {generic}"
    return None


def _size(state: State) -> int:
    return {"none": 0, "idle": 1}.get(state.get("kind", "decode"), 2 + len(state))


def shrink(run_one: Any, states: list[State], budget: int = 200) -> list[State]:
    """Greedy shrinking (every accepted step strictly reduces the total size, so it terminates): empty ranks
    first, then drop optional fields, while the round still fails."""
    best = list(states)
    changed = True
    while changed and budget > 0:
        changed = False
        candidates = []
        for i, state in enumerate(best):
            candidates += [(i, {"kind": "none"}), (i, {"kind": "idle"})]
            candidates += [
                (i, {k: v for k, v in state.items() if k != key}) for key in state if key not in ("kind", "seed")
            ]
        for i, simpler in candidates:
            if _size(simpler) >= _size(best[i]):
                continue
            trial = best[:i] + [simpler] + best[i + 1 :]
            budget -= 1
            if run_one(trial):
                best, changed = trial, True
                break
    return best


def run_property(
    pool: Any, rounds: int, seed: int, patched: bool, chunk: int = 200, collective: bool = True
) -> dict[str, Any]:
    """Run ``rounds`` random rounds; returns counts and the first violation, shrunk.

    ``collective=False`` (``--fast``): the ranks skip the per-round draft-step collective emulation; the property is
    checked on the decisions every rank took after SGLang's real MLP sync (the same fields ``check_round`` reads
    either way: the emulation only turns a split into a gloo abort, it decides nothing).
    """
    pool.plugin("apply" if patched else "restore")
    rng = random.Random(seed)
    violations = 0
    first: dict[str, Any] | None = None
    done = 0
    while done < rounds:
        batch = [random_round(rng, pool.world) for _ in range(min(chunk, rounds - done))]
        for i, (states, results) in enumerate(zip(batch, pool.run_trace(batch, collective=collective), strict=True)):
            problem = check_round(results)
            if problem:
                violations += 1
                if first is None:
                    first = {"round": done + i, "states": states, "problem": problem}
        done += len(batch)
    if first is not None:

        def fails(states: list[State]) -> bool:
            return check_round(pool.run_trace([states], collective=collective)[0]) is not None

        first["shrunk"] = shrink(fails, first["states"])
    return {"rounds": rounds, "violations": violations, "first": first}


def main(argv: list[str] | None = None) -> int:
    from importlib.metadata import version

    from sglang_dp_mtp_fix.harness.pool import RankPool

    ap = argparse.ArgumentParser(description="rank-consistency property check (long profile)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=str, default=None, help="write the JSON result here")
    ap.add_argument(
        "--fast",
        action="store_true",
        help="skip the per-round draft-step collective emulation; compare the ranks' decisions after the real sync",
    )
    args = ap.parse_args(argv)
    t0 = time.time()
    collective = not args.fast
    with RankPool(args.ranks, load_plugins=True, env={"SGLANG_PLUGINS": "dp_mtp_fix"}) as pool:
        t_start = time.time()
        patched = run_property(pool, args.rounds, args.seed, patched=True, collective=collective)
        patched["wall_s"] = round(time.time() - t_start, 1)
        patched["ms_per_round"] = round(1000 * patched["wall_s"] / max(args.rounds, 1), 2)
        stock = run_property(pool, min(args.rounds, 2000), args.seed, patched=False, collective=collective)
    result = {
        "sglang_version": version("sglang"), "ranks": args.ranks, "seed": args.seed,
        "mode": "fast (decisions after the real MLP sync)" if args.fast else "full (with draft-step collectives)",
        "command": "python -m sglang_dp_mtp_fix.harness.fuzz " + " ".join(argv if argv is not None else sys.argv[1:]),
        "patched": patched, "stock_control": stock, "wall_s": round(time.time() - t0, 1),
    }  # fmt: skip
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    print(text)
    return 0 if patched["violations"] == 0 and stock["violations"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())

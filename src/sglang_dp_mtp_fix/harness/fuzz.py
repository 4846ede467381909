"""Rank-consistency property check over SGLang's real PD-decode round + DP MLP sync.

``random_round`` draws one multi-rank situation (idle / empty / decode ranks; seed present or absent; overlap future
flags; overlap merges; non-last PP ranks without a draft worker; workers that do not seed from draft-extend), under
one deployment's ``--moe-a2a-backend`` / ``--speculative-moe-a2a-backend`` pair (``backends``; a pair whose draft
answers ``require_mlp_tp_gather`` differently also draws batches across the draft graph's buckets and above its
``max_bs``). ``check_round`` is the property: every rank that runs takes the same draft path, and, when the draft
gathers, the same draft bucket (graph) or padded rows (eager); the same generic (target-verify / draft-extend) path;
and the generic graph is refused only when some rank really needs it. ``shrink`` reduces a
failing round to a minimal one (ranks emptied, fields dropped), hypothesis-style.

Quick profile: the test suite. Long profile: ``python -m sglang_dp_mtp_fix.harness.fuzz --rounds 100000``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang_dp_mtp_fix.harness.decode_round import RoundResult

State = dict[str, Any]


# Backend pairs (TARGET, DRAFT) of the quick profile: the default deployment, and the FP4 NextN one whose target
# does not gather token counts while its draft does (draft_token_counts).
PAIRS: tuple[tuple[str, str] | None, ...] = (None, ("deepep", "none"))


def random_state(rng: random.Random, wide: bool = False) -> State:
    """``wide``: batch sizes across the draft graph's buckets (8, 16, 32, 64) and, one in ten, above its max_bs."""
    kind = rng.choices(["none", "idle", "decode"], weights=[3, 1, 6])[0]
    if kind != "decode":
        return {"kind": kind}
    if wide:
        num_reqs = rng.randint(1, 20) if rng.random() > 0.1 else rng.randint(60, 70)
    else:
        num_reqs = rng.randint(1, 6)
    state: State = {"kind": "decode", "num_reqs": num_reqs, "seed": rng.random() > 0.15}
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


def random_round(rng: random.Random, world: int, wide: bool = False) -> list[State]:
    return [random_state(rng, wide) for _ in range(world)]


def check_round(results: list[RoundResult]) -> str | None:
    """None when the round is rank-consistent, else a description of the violation."""
    ran = [r for r in results if r.ran]
    if not ran:
        return None
    paths = {r.rank: r.draft_path for r in ran}
    if len(set(paths.values())) > 1:
        return f"draft paths differ across ranks: {paths}"
    # A draft that gathers (its MoE all-gathers every rank's rows) needs one size on every rank.
    rows = {r.rank: r.draft_rows for r in ran if r.draft_gathers}
    if len(set(rows.values())) > 1:
        what = "draft buckets" if set(paths.values()) == {"graph"} else "draft eager rows"
        return f"{what} differ across ranks: {rows}"
    generic = {r.rank: r.decode_graph for r in ran}
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
    pool: Any,
    rounds: int,
    seed: int,
    patched: bool,
    chunk: int = 200,
    collective: bool = True,
    backends: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``rounds`` random rounds; returns counts and the first violation, shrunk.

    ``backends``: the deployment's (``--moe-a2a-backend``, ``--speculative-moe-a2a-backend``), published on every
    rank before the plugin is applied (or left stock); None: the pool's baseline ServerArgs.

    ``collective=False`` (``--fast``): the ranks skip the per-round draft-step collective emulation; the property is
    checked on the decisions every rank took after SGLang's real MLP sync (the same fields ``check_round`` reads
    either way: the emulation only turns a split into a gloo abort, it decides nothing).
    """
    answers = pool.configure(backends, patched)[0]
    wide = answers["target_gathers"] != answers["draft_gathers"]
    rng = random.Random(seed)
    violations = 0
    kinds: dict[str, int] = {}  # violations by kind ("draft paths differ", "draft buckets differ", ...)
    first: dict[str, Any] | None = None
    done = 0
    while done < rounds:
        batch = [random_round(rng, pool.world, wide) for _ in range(min(chunk, rounds - done))]
        for i, (states, results) in enumerate(zip(batch, pool.run_trace(batch, collective=collective), strict=True)):
            problem = check_round(results)
            if problem:
                violations += 1
                kind = problem.split(":", 1)[0]
                kinds[kind] = kinds.get(kind, 0) + 1
                if first is None:
                    first = {"round": done + i, "states": states, "problem": problem}
        done += len(batch)
    if first is not None:

        def fails(states: list[State]) -> bool:
            return check_round(pool.run_trace([states], collective=collective)[0]) is not None

        first["shrunk"] = shrink(fails, first["states"])
    return {
        "rounds": rounds,
        "violations": violations,
        "kinds": kinds,
        "first": first,
        "backends": "/".join(backends) if backends else None,
        "gathers": {"target": answers["target_gathers"], "draft": answers["draft_gathers"]},
    }


def add_backend_arguments(ap: argparse.ArgumentParser) -> None:
    """SGLang's own two flags, so a deployment's values can be copied as they are."""
    ap.add_argument(
        "--moe-a2a-backend", default=None, metavar="TARGET", help="the target's MoE a2a backend (SGLang default: none)"
    )
    ap.add_argument(
        "--speculative-moe-a2a-backend",
        default=None,
        metavar="DRAFT",
        help="the draft's MoE a2a backend (SGLang default: the target's); e.g. --moe-a2a-backend deepep "
        "--speculative-moe-a2a-backend none, the FP4 NextN deployment",
    )


def backend_pair(args: argparse.Namespace) -> tuple[str, str] | None:
    """(target, draft) from the two flags, with SGLang's defaults; None when neither is given."""
    target, draft = args.moe_a2a_backend, args.speculative_moe_a2a_backend
    if target is None and draft is None:
        return None
    target = target or "none"
    return target, draft or target


def main(argv: list[str] | None = None) -> int:
    from importlib.metadata import version

    from sglang_dp_mtp_fix.harness.pool import RankPool

    ap = argparse.ArgumentParser(description="rank-consistency property check (long profile)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=str, default=None, help="write the JSON result here")
    add_backend_arguments(ap)
    ap.add_argument(
        "--fast",
        action="store_true",
        help="skip the per-round draft-step collective emulation; compare the ranks' decisions after the real sync",
    )
    args = ap.parse_args(argv)
    t0 = time.time()
    collective = not args.fast
    backends = backend_pair(args)
    with RankPool(args.ranks, load_plugins=True, env={"SGLANG_PLUGINS": "dp_mtp_fix"}) as pool:
        t_start = time.time()
        patched = run_property(pool, args.rounds, args.seed, patched=True, collective=collective, backends=backends)
        patched["wall_s"] = round(time.time() - t_start, 1)
        patched["ms_per_round"] = round(1000 * patched["wall_s"] / max(args.rounds, 1), 2)
        stock = run_property(
            pool, min(args.rounds, 2000), args.seed, patched=False, collective=collective, backends=backends
        )
    result = {
        "sglang_version": version("sglang"), "ranks": args.ranks, "seed": args.seed,
        "backends": "/".join(backends) if backends else None,
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
